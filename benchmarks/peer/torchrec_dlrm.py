"""TorchRec's DLRM on our preprocessed binary data: the peer that bagpipe is measured against.

    bash benchmarks/peer/setup_torchrec.sh        # once: creates .venv-torchrec
    .venv-torchrec/bin/python benchmarks/peer/torchrec_dlrm.py --data DIR [--processes 2]
        [--sharding table_wise|row_wise|column_wise|data_parallel|auto] [--optimizer sgd|adagrad]
        [--lr 0.01] [--dim 16] [--batch-size 2048] [--iterations 200] [--warmup 20] [--threads 1]

DIR is a data set written by `bagpipe preprocess` / `bagpipe synth` (or its train/ split
itself): train/header.json, labels.f32, dense.f32 [rows, 13] (already log-transformed) and
ids.<dtype> [rows, 26]. It is read with numpy memory maps; bagpipe itself is not imported, since
this runs in the separate TorchRec environment.

The model is ours: an EmbeddingBagCollection of one table per sparse feature (dim D, sum
pooling of the single id each sample has per table), dense arch 13-512-256-D, TorchRec's
InteractionArch (the dense vector and the strictly-upper-triangle pairwise dot products), over
arch 512-256-1, BCE with logits. It is wrapped in DistributedModelParallel over gloo on
--processes processes that this script starts itself (127.0.0.1, a free port). Embeddings use
TorchRec's fused optimizer (apply_optimizer_in_backward: EXACT_SGD or EXACT_ADAGRAD, per-element
Adagrad like ours, eps 1e-10); dense parameters are in DDP with torch.optim SGD / Adagrad.
Sharding kernels are FUSED (data_parallel: DENSE, the only kernel TorchRec has for it).
TorchRec offers row_wise only on cuda/tpu; here a sharder subclass allows it on CPU (it runs,
over gloo). column_wise splits every table into D / processes columns (--cw-min-partition).

Global batch i is rows [i*B, (i+1)*B) (wrapping around at the end of the split); each process
takes its contiguous 1/N of it. As in bagpipe, --iterations counts every iteration and the
first --warmup of them are excluded from samples/s: samples_per_s = B x (iterations - warmup)
/ the wall time between a barrier after the warm-up and a barrier after the last iteration.
startup_s runs from this launcher's start to rank 0's first iteration done.

Exactly one JSON line goes to stdout (everything else to stderr):
{"system": "torchrec", "sharding", "processes", "samples_per_s", "startup_s",
 "peak_rss_bytes": [per process], "final_loss" (the last global batch's mean loss),
 "iterations", "optimizer", ...}
A failure in any process, or --timeout, stops every process and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

NUM_DENSE = 13
SHARDINGS = ("table_wise", "row_wise", "column_wise", "data_parallel", "auto")
ADAGRAD_EPS = 1e-10  # as bagpipe's Adagrad (torch.optim.Adagrad's default)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="preprocessed data set directory (or its train/ split)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--sharding", choices=SHARDINGS, default="table_wise")
    parser.add_argument("--optimizer", choices=("sgd", "adagrad"), default="sgd")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--dim", type=int, default=16, help="embedding dimension D")
    parser.add_argument("--batch-size", type=int, default=2048, help="global batch size")
    parser.add_argument("--iterations", type=int, default=200, help="all iterations, warm-up included")
    parser.add_argument("--warmup", type=int, default=20, help="first iterations left out of samples/s")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    parser.add_argument("--cw-min-partition", type=int, default=None,
                        help="column_wise: columns per shard (default D / processes, so every table is split)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--const-init", type=float, default=None,
                        help="start every embedding weight at this value (to compare shardings and process "
                             "counts: the default random init differs between shardings)")
    parser.add_argument("--profile", action="store_true",
                        help="rank 0: torch.profiler over the measured iterations, top operators to stderr")
    parser.add_argument("--verbose", action="store_true", help="keep TorchRec's warnings")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    parser.add_argument("--pg-timeout", type=float, default=120.0, help="seconds for one collective")
    parser.add_argument("--rank-netns", default="",
                        help="network namespaces, comma-separated, one per rank: each rank runs in its own (a host of "
                             "bagpipe.hosts, `ip netns exec`; root), meeting at --master-addr over the hosts' links")
    parser.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address (with --rank-netns: its host's)")
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    if args.batch_size % args.processes:
        parser.error(f"--batch-size {args.batch_size} is not divisible by --processes {args.processes}")
    if args.iterations < 1 or not 0 <= args.warmup < args.iterations:
        parser.error("need --iterations >= 1 and 0 <= --warmup < --iterations")
    if args.threads < 1 or args.dim < 1:
        parser.error("--threads and --dim must be positive")
    if args.rank_netns and len(args.rank_netns.split(",")) != args.processes:
        parser.error(f"--rank-netns names {len(args.rank_netns.split(','))} namespaces for {args.processes} processes")
    return args


def split_dir(data: str) -> Path:
    path = Path(data)
    return path if (path / "header.json").is_file() else path / "train"


def read_header(directory: Path) -> dict:
    header_path = directory / "header.json"
    if not header_path.is_file():
        raise SystemExit(f"torchrec_dlrm: {directory}: not a preprocessed split (no header.json); "
                         "make one with `bagpipe synth` or `bagpipe preprocess`")
    header = json.loads(header_path.read_text())
    for key in ("rows", "num_dense", "table_sizes", "id_dtype"):
        if key not in header:
            raise SystemExit(f"torchrec_dlrm: {header_path}: no '{key}'")
    if int(header["num_dense"]) != NUM_DENSE:
        raise SystemExit(f"torchrec_dlrm: {header_path}: num_dense {header['num_dense']}, expected {NUM_DENSE}")
    return header


# ----------------------------------------------------------------------------------------------
# Launcher: starts one worker process per rank, watches them, prints rank 0's result.


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    """In a child, before exec: get SIGKILL if the launcher dies, so no worker is left behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: the launcher's own clean-up still applies
        pass


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + 5.0
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    started = time.time()
    directory = split_dir(args.data)
    header = read_header(directory)
    if int(header["rows"]) < args.batch_size:
        raise SystemExit(f"torchrec_dlrm: {directory} has {header['rows']} rows, fewer than one batch")
    with tempfile.TemporaryDirectory(prefix="torchrec_dlrm_") as tmp:
        result_path = Path(tmp) / "result.json"
        env_common = {
            **os.environ,
            "MASTER_ADDR": args.master_addr,
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(args.processes),
            "LOCAL_WORLD_SIZE": str(args.processes),
            "OMP_NUM_THREADS": str(args.threads),
            "TORCHREC_DLRM_T0": repr(started),
            "TORCHREC_DLRM_RESULT": str(result_path),
        }
        procs: list[subprocess.Popen] = []

        def on_signal(signum, _frame):
            stop(procs)
            print(f"torchrec_dlrm: stopped by signal {signum}; all workers ended", file=sys.stderr)
            sys.exit(128 + signum)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            namespaces = args.rank_netns.split(",") if args.rank_netns else []
            for rank in range(args.processes):
                env = {**env_common, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                command = [sys.executable, os.path.abspath(__file__), "--worker", *argv]
                if namespaces:  # a host of its own: gloo on the host's link
                    command = ["ip", "netns", "exec", namespaces[rank], *command]
                    env.update(GLOO_SOCKET_IFNAME="eth0", LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
                procs.append(subprocess.Popen(command, env=env, stdout=sys.stderr, preexec_fn=die_with_parent))
            deadline = time.monotonic() + args.timeout
            while True:
                codes = [proc.poll() for proc in procs]
                failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
                if failed:
                    stop(procs)
                    names = ", ".join(f"rank {rank} (exit {code})" for rank, code in failed)
                    print(f"torchrec_dlrm: FAILED: {names}; the other workers were stopped", file=sys.stderr)
                    return 1
                if all(code == 0 for code in codes):
                    break
                if time.monotonic() > deadline:
                    stop(procs)
                    print(f"torchrec_dlrm: FAILED: not finished within --timeout {args.timeout:g} s; "
                          "all workers stopped", file=sys.stderr)
                    return 124
                time.sleep(0.1)
        finally:
            stop(procs)
        if not result_path.is_file():
            print("torchrec_dlrm: FAILED: rank 0 exited without a result", file=sys.stderr)
            return 1
        print(result_path.read_text().strip(), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------
# Worker: one rank of DistributedModelParallel.


def log(rank: int, message: str) -> None:
    print(f"[torchrec_dlrm rank {rank}] {message}", file=sys.stderr, flush=True)


def worker(args: argparse.Namespace) -> None:
    t0 = float(os.environ["TORCHREC_DLRM_T0"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    import resource
    from datetime import timedelta

    import numpy as np
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    if not args.verbose:
        import logging
        import warnings

        warnings.filterwarnings("ignore")
        logging.getLogger("torchrec").setLevel(logging.ERROR)
        torch._logging.set_logs(all=logging.ERROR)
    import fbgemm_gpu  # noqa: F401  (registers the CPU operators TorchRec needs)
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingType
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    class CpuRowWiseSharder(EmbeddingBagCollectionSharder):
        """TorchRec offers row-wise sharding only on cuda/tpu; on CPU it must be allowed explicitly."""

        def sharding_types(self, compute_device_type: str) -> list[str]:
            return [*super().sharding_types(compute_device_type), ShardingType.ROW_WISE.value]

    # ---- data: memory-mapped, each rank reads its own contiguous slice of every global batch
    directory = split_dir(args.data)
    header = read_header(directory)
    rows, sizes = int(header["rows"]), [int(s) for s in header["table_sizes"]]
    id_dtype = np.dtype(header["id_dtype"])
    tables = len(sizes)
    labels_mm = np.memmap(directory / "labels.f32", dtype=np.float32, mode="r", shape=(rows,))
    dense_mm = np.memmap(directory / "dense.f32", dtype=np.float32, mode="r", shape=(rows, NUM_DENSE))
    ids_mm = np.memmap(directory / f"ids.{id_dtype.name}", dtype=id_dtype, mode="r", shape=(rows, tables))
    batches = rows // args.batch_size
    local = args.batch_size // world
    if rank == 0 and args.iterations > batches:
        log(rank, f"{args.iterations} iterations but {batches} batches in {directory}: wrapping around")
    keys = [f"f{t}" for t in range(tables)]
    lengths = torch.ones(tables * local, dtype=torch.int32)

    def batch(i: int):
        start = (i % batches) * args.batch_size + rank * local
        ids = torch.from_numpy(np.ascontiguousarray(ids_mm[start:start + local].T, dtype=np.int64))
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids.reshape(-1), lengths=lengths)
        dense = torch.from_numpy(np.array(dense_mm[start:start + local]))
        labels = torch.from_numpy(np.array(labels_mm[start:start + local]))
        return dense, kjt, labels

    # ---- process group
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.pg_timeout))
    torch.manual_seed(args.seed)
    device = torch.device("cpu")

    # ---- model, built on the meta device and materialised shard by shard by DMP
    init_fn = None if args.const_init is None else (lambda weight: torch.nn.init.constant_(weight, args.const_init))
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{t}", embedding_dim=args.dim, num_embeddings=size,
                                   feature_names=[keys[t]], pooling=PoolingType.SUM, init_fn=init_fn)
                for t, size in enumerate(sizes)],
        device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                 dense_arch_layer_sizes=[512, 256, args.dim], over_arch_layer_sizes=[512, 256, 1],
                 dense_device=device)
    if args.optimizer == "sgd":
        emb_class, emb_kwargs = torch.optim.SGD, {"lr": args.lr}
    else:
        emb_class, emb_kwargs = torch.optim.Adagrad, {"lr": args.lr, "eps": ADAGRAD_EPS}
    apply_optimizer_in_backward(emb_class, model.sparse_arch.parameters(), emb_kwargs)

    constraints = None
    if args.sharding != "auto":
        sharding = getattr(ShardingType, args.sharding.upper()).value
        kernel = (EmbeddingComputeKernel.DENSE if args.sharding == "data_parallel"
                  else EmbeddingComputeKernel.FUSED).value
        min_partition = None
        if args.sharding == "column_wise":
            min_partition = args.cw_min_partition or max(1, args.dim // world)
        constraints = {f"t{t}": ParameterConstraints(sharding_types=[sharding], compute_kernels=[kernel],
                                                     min_partition=min_partition)
                       for t in range(tables)}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, local_world_size=world, compute_device=device.type),
        batch_size=local, constraints=constraints)
    sharders = [CpuRowWiseSharder()] if args.sharding == "row_wise" else None
    plan = planner.collective_plan(model, sharders, pg=dist.GroupMember.WORLD)
    if rank == 0:
        summary: dict[str, int] = {}
        for param_sharding in plan.plan["sparse_arch.embedding_bag_collection"].values():
            ranks = param_sharding.ranks or list(range(world))  # data_parallel: every rank
            key = f"{param_sharding.sharding_type}/{param_sharding.compute_kernel} on ranks {ranks}"
            summary[key] = summary.get(key, 0) + 1
        log(rank, "plan: " + "; ".join(f"{k}: {n} tables" for k, n in sorted(summary.items())))
    model = DistributedModelParallel(module=model, device=device, plan=plan, sharders=sharders)
    # Dense parameters (in DDP) get a torch.optim optimizer; fused (in-backward) ones are left out.
    dense_class = torch.optim.SGD if args.optimizer == "sgd" else torch.optim.Adagrad
    dense_kwargs = {"lr": args.lr} if args.optimizer == "sgd" else {"lr": args.lr, "eps": ADAGRAD_EPS}
    dense_optimizer = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                            lambda params: dense_class(params, **dense_kwargs))
    optimizer = CombinedOptimizer([model.fused_optimizer, dense_optimizer])
    loss_fn = torch.nn.BCEWithLogitsLoss()

    # ---- training
    startup_s = None
    timed_from = time.perf_counter()
    if args.warmup == 0:
        dist.barrier()
        timed_from = time.perf_counter()
    loss = torch.zeros(())
    profiler = None
    for i in range(args.iterations):
        if args.profile and rank == 0 and i == args.warmup:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        dense, kjt, labels = batch(i)
        optimizer.zero_grad()
        logits = model(dense_features=dense, sparse_features=kjt)
        loss = loss_fn(logits.squeeze(-1), labels)
        loss.backward()
        optimizer.step()
        if i == 0:
            startup_s = time.time() - t0
        if i + 1 == args.warmup:
            dist.barrier()
            timed_from = time.perf_counter()
            timed_window = [time.time(), None]  # the steady state in wall-clock time (a link's bytes are read over it)
    dist.barrier()
    wall = time.perf_counter() - timed_from
    timed_window[1] = time.time()
    if profiler is not None:
        profiler.__exit__(None, None, None)
        log(rank, "profile of the measured iterations (wall time inflated by the profiler):\n"
            + profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))

    final_loss = loss.detach().clone()
    dist.all_reduce(final_loss)
    rss = [None] * world
    dist.all_gather_object(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if rank == 0:
        measured = args.iterations - args.warmup
        result = {
            "system": "torchrec", "sharding": args.sharding, "processes": world,
            "samples_per_s": round(args.batch_size * measured / wall, 1),
            "startup_s": round(startup_s, 3), "peak_rss_bytes": rss,
            "final_loss": round(final_loss.item() / world, 6),
            "iterations": args.iterations, "warmup": args.warmup, "optimizer": args.optimizer,
            "lr": args.lr, "dim": args.dim, "batch_size": args.batch_size, "threads": args.threads,
            "measured_wall_s": round(wall, 3), "timed_window": timed_window, "torch": torch.__version__,
        }
        Path(os.environ["TORCHREC_DLRM_RESULT"]).write_text(json.dumps(result) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    argv = sys.argv[1:]
    if argv and argv[0] == "--worker":
        args = parse_args(argv[1:])
        try:
            worker(args)
        except BaseException:  # noqa: BLE001 - any failure: say which rank, exit non-zero at once
            log(int(os.environ.get("RANK", -1)), "FAILED:\n" + traceback.format_exc())
            sys.stderr.flush()
            os._exit(1)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(0)  # skip interpreter tear-down (gloo / fbgemm threads)
    args = parse_args(argv)
    sys.exit(launch(args, argv))


if __name__ == "__main__":
    main()
