"""The fixed cost of a training step, measured on the CPU: aten operations dispatched per iteration (each one a
kernel launch and its Python on a GPU; ``host reads``: values read back from a tensor, a wait on a GPU) and host
milliseconds per iteration at a tiny batch, where the step's own overhead is all there is.

    .venv/bin/python benchmarks/bench_step.py [--repeats 3] [--out FILE.json]
    .venv/bin/python benchmarks/bench_step.py --before OTHER_CHECKOUT [--repeats 3]   # before/after, alternated
    .venv/bin/python benchmarks/bench_step.py --phases [--iterations 300]   # where a batch-64 step's time goes

Cases (26 tables of 100,000 rows unless said, the gpu-check's shape of DLRM at a smaller scale; ids drawn as
``bagpipe synth`` draws them, Zipf 1.2):
- ``nn``: ``bagpipe.nn.CachedEmbeddingBagCollection``, Adagrad, forward + backward with the fused steps (the
  embedding side alone: the backward starts from given output gradients), an LRU cache of 5%, at 4 and 26 tables;
  also its samples/s at batch 2,048, dim 16 (one DLRM-sized lookup per table);
- ``reference``: ``reference.train_step`` (DLRM, every table in memory), the loss read every iteration as
  ``--mode reference`` reads it;
- ``single``: the same step over ``--mode single``'s ``CachedTables`` (a 5% cache, planned by ``Lookahead``);
- ``job reference|single|bagpipe``: whole ``bagpipe train`` jobs (one trainer for bagpipe), batch 64, dim 8, on
  ``bagpipe synth`` data made once in ``--work-dir`` (26 tables of up to 100,000 rows): the steady ms per
  iteration of the summary's phases, and the operations and host reads of the last warm-up iteration that the
  summary records (``ops_per_iteration``; trainer 0's for bagpipe; code from before it records none).
Counts are of one steady iteration; ms are medians over ``--iterations`` after a warm-up, one thread. With
``--before`` every case runs in a child process per checkout, the two alternated ``--repeats`` times, and the
table gives both and their ratio (ops are deterministic; ms medians of the repeats). A case the other checkout
cannot run is reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROWS, WARMUP = 100_000, 5
OPCOUNT = Path(__file__).resolve().parent.parent / "src" / "bagpipe" / "opcount.py"


def OpCounter():
    """This checkout's counter, whichever checkout's code is measured (one from before it has none)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_step_opcount", OPCOUNT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.OpCounter()


def _zipf_ids(generator, *, batch: int, tables: int, rows: int):
    """``[batch, tables]`` ids drawn as ``bagpipe synth`` draws them (Zipf 1.2: about 1% of the rows take over 90%
    of the lookups), the same draw in every checkout."""
    import numpy as np
    import torch

    from bagpipe.synth import DEFAULT_ZIPF, ZipfSampler

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    rng = np.random.default_rng(seed)
    samplers = [ZipfSampler(num_rows=rows, exponent=DEFAULT_ZIPF, rng=np.random.default_rng(t)) for t in range(tables)]
    return torch.from_numpy(np.stack([sampler.sample(batch, rng) for sampler in samplers], axis=1))


def case_nn(*, tables: int, batch: int, dim: int, iterations: int) -> dict:
    import torch

    from bagpipe.nn import CachedEmbeddingBagCollection

    shapes = [(ROWS, dim)] * tables
    collection = CachedEmbeddingBagCollection(shapes, cache_rows=ROWS * tables // 20, optimizer="adagrad", lr=0.01)
    generator = torch.Generator().manual_seed(0)
    batches = [[column.unsqueeze(1) for column in _zipf_ids(generator, batch=batch, tables=tables, rows=ROWS).T]
               for _ in range(iterations + WARMUP)]
    grads = [torch.ones(batch, dim)] * tables

    def step(inputs) -> None:
        torch.autograd.backward(collection(inputs), grads)

    for inputs in batches[:WARMUP - 1]:
        step(inputs)
    with OpCounter() as ops:
        step(batches[WARMUP - 1])
    times = []
    for inputs in batches[WARMUP:]:
        start = time.perf_counter()
        step(inputs)
        times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    return {"ops": ops.total, "host_reads": ops.host_reads, "ms": ms, "samples_per_s": batch / ms * 1e3}


def _dlrm_step_parts(config, schema, *, mode: str, batch: int, iterations: int, lookahead: int):
    """The model, its tables (``single``: behind a 5% cache planned by ``Lookahead``), dense optimizer and the
    loop of ``iterations`` + warm-up batches (ids drawn as ``bagpipe synth`` draws them) of the DLRM cases."""
    import torch

    from bagpipe.data.batches import Batch
    from bagpipe.nn import CachedTables, Lookahead
    from bagpipe.train.reference import build_model, build_tables

    tables = len(schema.features)
    model, embedding_tables = build_model(config, schema), build_tables(config, schema)
    dense_optimizer = embedding_tables.optimizer.dense_optimizer(model.parameters())
    generator = torch.Generator().manual_seed(0)
    batches = [Batch(dense_x=torch.rand(batch, 13, generator=generator),
                     ids=_zipf_ids(generator, batch=batch, tables=tables, rows=ROWS),
                     target=torch.randint(0, 2, (batch,), generator=generator).float())
               for _ in range(iterations + WARMUP)]
    loop = batches
    if mode == "single":
        cache_rows = embedding_tables.layout.split_cache(ROWS * tables // 20, batch_size=batch)
        embedding_tables = CachedTables.over(embedding_tables, cache_rows=cache_rows, policy="lru")
        loop = Lookahead(batches, embedding_tables, ids=lambda b: b.ids, lookahead=lookahead)
    return model, embedding_tables, dense_optimizer, loop


def case_dlrm(*, mode: str, tables: int, batch: int, dim: int, iterations: int, compiled: bool = False) -> dict:
    from bagpipe.config import ModelConfig, TrainConfig
    from bagpipe.data.schema import Schema
    from bagpipe.train.reference import train_step

    schema = Schema.one_hot([ROWS] * tables, num_dense=13)
    config = TrainConfig(data="-", run_dir="-", optimizer="adagrad", lr=0.01, seed=1,
                         model=ModelConfig(emb_dim=dim, arch_mlp_bot=f"13-64-{dim}", arch_mlp_top="128-64-1"),
                         **({"compile": True} if compiled else {}))
    model, embedding_tables, dense_optimizer, loop = _dlrm_step_parts(config, schema, mode=mode, batch=batch,
                                                                      iterations=iterations, lookahead=16)
    times, ops = [], None
    for i, item in enumerate(loop):
        start = time.perf_counter()
        if i == WARMUP - 1 and not compiled:  # (under a dispatch mode a compiled graph runs otherwise: not counted)
            with OpCounter() as ops:
                train_step(model, embedding_tables, dense_optimizer, item)
            continue
        train_step(model, embedding_tables, dense_optimizer, item)
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return {"ops": ops.total if ops else None, "host_reads": ops.host_reads if ops else None,
            "ms": statistics.median(times) * 1e3}


def case_phases(*, mode: str, iterations: int) -> dict:
    """Where a tiny-batch step's time goes, phase by phase, at the jobs' shape (DLRM 13-64-8 / 512-256-1, dim 8,
    26 tables, batch 64, Adam as `bagpipe train` defaults DLRM to, one thread): ms (medians) and operations of
    each phase. ``single``: a 5% cache planned by ``Lookahead`` (its planning is the ``data`` phase)."""
    from bagpipe.config import ModelConfig, TrainConfig
    from bagpipe.data.schema import Schema

    tables, batch, dim = 26, 64, 8
    schema = Schema.one_hot([ROWS] * tables, num_dense=13)
    config = TrainConfig(data="-", run_dir="-", optimizer="adam", lr=0.001, seed=1,
                         model=ModelConfig(emb_dim=dim, arch_mlp_bot=f"13-64-{dim}", arch_mlp_top="512-256-1"))
    model, embedding_tables, dense_optimizer, loop = _dlrm_step_parts(config, schema, mode=mode, batch=batch,
                                                                      iterations=iterations, lookahead=200)
    times: dict[str, list[float]] = {}
    ops: dict[str, int] = {}
    items = iter(loop)
    for i in range(iterations + WARMUP):
        counting = i == WARMUP - 1
        mark = time.perf_counter()

        def phase(name: str, work):
            nonlocal mark
            if counting:
                with OpCounter() as counter:
                    value = work()
                ops[name] = counter.total
            else:
                value = work()
            now = time.perf_counter()
            if i >= WARMUP:
                times.setdefault(name, []).append(now - mark)
            mark = now
            return value

        item = phase("data", lambda: next(items))
        embeddings, lookups = phase("lookup", lambda: embedding_tables.lookup(item.ids))
        loss = phase("forward", lambda: model.loss(model(item.dense_x, embeddings), item.target))
        phase("backward", lambda: (dense_optimizer.zero_grad(set_to_none=True), loss.backward()))
        phase("dense optimizer", dense_optimizer.step)
        phase("row optimizer", lambda: embedding_tables.apply_gradients(lookups))
    return {"ms": {name: statistics.median(found) * 1e3 for name, found in times.items()}, "ops": ops}


def case_job(*, mode: str, data: Path, work: Path, src: Path, iterations: int) -> dict:
    """A whole ``bagpipe train`` job on ``src``'s code (one trainer for ``--mode bagpipe``), batch 64, dim 8, one
    thread: its steady ms per iteration (the phases of its summary added up) and, where that code records them,
    trainer 0's operations and host reads in its last warm-up iteration."""
    run_dir = work / f"run-{mode}"
    extra = {"reference": [], "single": ["--cache-rows", "130000"],
             "bagpipe": ["--trainers", "1", "--cache-rows", "130000"]}[mode]
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "bagpipe.cli", "train", "--data", str(data), "--run-dir", str(run_dir),
                           "--overwrite", "--mode", mode, *extra, "--iterations", str(iterations + 20),
                           "--batch-size", "64", "--emb-dim", "8", "--arch-mlp-bot", "13-64-8", "--threads", "1",
                           "--no-progress"], env=env, capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]}
    summary = json.loads((run_dir / "summary.json").read_text())
    ops, reads = summary.get("ops_per_iteration"), summary.get("host_reads_per_iteration")
    if isinstance(ops, dict):  # a job of trainers: trainer 0's
        ops, reads = ops.get("trainer0"), reads.get("trainer0")
    return {"ops": ops, "host_reads": reads, "ms": sum(summary["time_breakdown_ms"].values())}


JOBS = ("reference", "single", "bagpipe")

CASES = {
    "nn 4 tables, batch 64, dim 8": lambda it: case_nn(tables=4, batch=64, dim=8, iterations=it),
    "nn 26 tables, batch 64, dim 8": lambda it: case_nn(tables=26, batch=64, dim=8, iterations=it),
    "nn 26 tables, batch 2048, dim 16": lambda it: case_nn(tables=26, batch=2048, dim=16, iterations=it),
    "reference, batch 64, dim 8": lambda it: case_dlrm(mode="reference", tables=26, batch=64, dim=8, iterations=it),
    "single 5%, batch 64, dim 8": lambda it: case_dlrm(mode="single", tables=26, batch=64, dim=8, iterations=it),
    "reference, batch 2048, dim 16": lambda it: case_dlrm(mode="reference", tables=26, batch=2048, dim=16,
                                                          iterations=it),
    "single 5%, batch 2048, dim 16": lambda it: case_dlrm(mode="single", tables=26, batch=2048, dim=16,
                                                          iterations=it),
    # --compile (the dense model's loss and its backward through torch.compile; its first iteration compiles)
    "reference compiled, batch 64, dim 8": lambda it: case_dlrm(mode="reference", tables=26, batch=64, dim=8,
                                                                iterations=it, compiled=True),
    "reference compiled, batch 2048, dim 16": lambda it: case_dlrm(mode="reference", tables=26, batch=2048, dim=16,
                                                                   iterations=it, compiled=True),
}


def run_child(case: str, iterations: int, src: Path, work: Path) -> dict:
    """One case in a fresh process on ``src``'s code, one thread."""
    if case.startswith("job "):
        return case_job(mode=case.split()[1], data=work / "data", work=work, src=src, iterations=iterations)
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, __file__, "--child", case, "--iterations", str(iterations)],
                          env=env, capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["exit code %d" % done.returncode])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", type=Path, help="another checkout: its code is measured too, alternated")
    parser.add_argument("--case", action="append", choices=[*CASES, *(f"job {mode}" for mode in JOBS)],
                        help="default: every case")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--work-dir", type=Path, default=Path("runs/bench_step"), help="the jobs' data and runs")
    parser.add_argument("--phases", action="store_true", help="instead: where a batch-64 step's time goes, phase by "
                        "phase, for the reference and --mode single at the jobs' shape (this checkout, one thread)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phases:
        import torch

        torch.set_num_threads(1)
        found = {mode: case_phases(mode=mode, iterations=max(args.iterations, 100)) for mode in ("reference", "single")}
        print("| phase | " + " | ".join(f"{mode} ms (ops)" for mode in found) + " |")
        print("| --- | " + " | ".join("---:" for _ in found) + " |")
        for name in found["single"]["ms"]:
            print(f"| {name} | " + " | ".join(f"{r['ms'][name]:.2f} ({r['ops'].get(name, 0)})" for r in found.values())
                  + " |")
        print("| step | " + " | ".join(f"{sum(r['ms'].values()):.2f} ({sum(r['ops'].values())})"
                                       for r in found.values()) + " |")
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(found, indent=2))
        return
    if args.child:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(CASES[args.child](args.iterations)))
        return
    here = Path(__file__).resolve().parent.parent / "src"
    checkouts = {"after": here} if args.before is None else {"before": args.before.resolve() / "src", "after": here}
    cases = args.case or [*CASES, *(f"job {mode}" for mode in JOBS)]
    if any(case.startswith("job ") for case in cases) and not (args.work_dir / "data").exists():
        subprocess.run([sys.executable, "-m", "bagpipe.cli", "synth", "--out", str(args.work_dir / "data"), "--rows",
                        "40000", "--test-rows", "2000", "--seed", "1", "--max-rows-per-table", "100000"],
                       env={**os.environ, "PYTHONPATH": str(here)}, check=True, capture_output=True)
    results: dict = {}
    for case in cases:
        runs = {name: [] for name in checkouts}
        for _ in range(args.repeats):
            for name, src in checkouts.items():  # alternated: the machine's drift falls on both alike
                runs[name].append(run_child(case, args.iterations, src, args.work_dir))
        results[case] = {name: _summary(found) for name, found in runs.items()}
        print(_line(case, results[case]), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


def _summary(runs: list[dict]) -> dict:
    if any("error" in run for run in runs):
        return {"error": next(run["error"] for run in runs if "error" in run)}
    summary = {"ops": runs[0]["ops"], "host_reads": runs[0]["host_reads"],  # (None: not recorded by that code)
               "ms": statistics.median(run["ms"] for run in runs)}
    if "samples_per_s" in runs[0]:
        summary["samples_per_s"] = statistics.median(run["samples_per_s"] for run in runs)
    return summary


def _line(case: str, result: dict) -> str:
    parts = []
    for name, summary in result.items():
        if "error" in summary:
            parts.append(f"{name}: cannot run ({summary['error']})")
            continue
        counted = "ops not recorded" if summary["ops"] is None else f"{summary['ops']} ops ({summary['host_reads']} host reads)"
        text = f"{name}: {counted}, {summary['ms']:.2f} ms"
        if "samples_per_s" in summary:
            text += f", {summary['samples_per_s']:,.0f} samples/s"
        parts.append(text)
    if len(result) == 2 and not any("error" in s for s in result.values()):
        before, after = result["before"], result["after"]
        ops = f"ops {after['ops'] / before['ops']:.2f}x, " if before["ops"] and after["ops"] else ""
        parts.append(f"after/before: {ops}ms {after['ms'] / before['ms']:.2f}x")
    return f"{case}: " + "; ".join(parts)


if __name__ == "__main__":
    main()
