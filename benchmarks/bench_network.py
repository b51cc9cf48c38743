"""Whole jobs over a bandwidth-limited link, on one machine: bagpipe (partitioned, replicated, no cache), TorchRec
and the one-process reference, each job in a network namespace of its own whose loopback is shaped (issue 29).

    sudo .venv/bin/python benchmarks/bench_network.py [--rates 100mbit,1gbit,10gbit,none] [--dims 16,128]
        [--systems bagpipe-partitioned,bagpipe,bagpipe-none,torchrec-tw,torchrec-rw,reference]
        [--repeats 3] [--iterations 60] [--warmup 10] [--cache-fraction 0.1] [--work-dir DIR] [--out FILE.jsonl]
        [--layout loopback|hosts] [--trainers 2,4]
    .venv/bin/python benchmarks/bench_network.py --report FILE.jsonl ...     # the tables of recorded runs
    .venv/bin/python benchmarks/bench_network.py --project FILE.jsonl ...    # the projection against them

Every process of a job talks over 127.0.0.1, so a job started inside `unshare --net` with
`tc qdisc add dev lo root tbf rate R burst B latency 100ms` sends every byte between its processes (RPC,
gloo, TorchRec's all-to-alls) across a link of rate R; nothing outside the namespace is affected. `none` is
an unshaped namespace (loopback at its own speed: 26-36 Gbit/s for one TCP stream on this machine, measured
by each unshaped run). The netem delay qdisc is
not available in this kernel: the shaping is bandwidth only.

Data and model are bench_peers.py's (26 Criteo-shaped tables of 100,000 rows, DLRM, global batch 2048, 2 trainers
or processes, SGD). Systems, alternated within each repeat so that machine noise falls on all alike:

- bagpipe-partitioned  `--mode bagpipe --cache-mode partitioned` (each trainer caches its slices' rows)
- bagpipe              the replicated cache (every trainer the planned rows)
- bagpipe-none         `--policy none`: each batch's rows prefetched, nothing kept (no cache)
- torchrec-tw, -rw     TorchRec DMP on 2 processes over gloo, table-wise / row-wise sharding (its own venv)
- reference            one process, every table in memory: no network (the ceiling)

Inside a namespace a bagpipe job's RPC (plans, fetches, write-backs) carries its tensors over TCP (TensorPipe's
`basic` channel, `--rpc-channels basic`), as it must between machines: left to choose, TensorPipe moves tensors
between two processes of one machine by cross-memory attach, which no link shapes (measured: a job's fetches then
add nothing to the link's bytes).

Each run records samples/s (steady state), the bytes that crossed the link (the loopback's transmit counter
inside the namespace: from the job's start to its end, start-up and evaluation included, and over its steady state
alone, read every 5 ms and interpolated over the job's `timed_window`) per iteration, and for bagpipe each role's
stall and time breakdown. Prints a Markdown table per (rate, dim): medians of the repeats.
Needs root, `unshare` and `tc`; says so and exits 0 where it cannot make a namespace (no test depends on it).

`--layout hosts` runs each process on a host of its own instead (bagpipe.hosts: network namespaces joined by a
bridge, each host's link shaped to the rate in both directions, as each machine of a cluster has its own link):
bagpipe's store and oracle on one host, its server on one, each trainer on one, started by their own command lines
(bagpipe.hostjobs); `--trainers 2,4`. Link bytes are every host's transmitted bytes, and each host's apart
(`host_bytes`). TorchRec's ranks (as many as the trainers) each on a host of its own too, over gloo on the hosts'
links (benchmarks/peer/torchrec_dlrm.py --rank-netns); the reference in this process (no network).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_peers  # noqa: E402  (the data, model and each system's runner)

from bagpipe.hosts import LATENCY, burst_bytes, rate_bits  # noqa: E402  (tc's rates, as the hosts shape them)

SYSTEMS = ("bagpipe-partitioned", "bagpipe", "bagpipe-none", "torchrec-tw", "torchrec-rw", "reference")
NO_NETWORK = ("reference",)
# Set inside a shaped namespace: there a bagpipe job's RPC must carry tensors over TCP (TensorPipe's "basic" channel),
# as between machines; left to choose, TensorPipe moves them between processes of one machine by cross-memory attach
# (the "cma" channel), past the link (bench_peers.run_bagpipe reads it).
SHAPED_ENV = "BAGPIPE_SHAPED_LINK"


def shaped(command: list[str], rate: str) -> list[str]:
    """``command`` run in a network namespace of its own, its loopback up and, unless ``rate`` is "none", shaped
    to ``rate`` (every byte between the command's processes crosses it)."""
    setup = f"ip link set lo up && export {SHAPED_ENV}={rate}"
    if rate != "none":
        setup += f" && tc qdisc add dev lo root tbf rate {rate} burst {burst_bytes(rate)} latency {LATENCY}"
    return ["unshare", "--net", "--", "sh", "-c", f'{setup} && exec "$@"', "sh", *command]


def cannot_shape() -> str | None:
    """Why no shaped namespace can be made here, or None."""
    if os.geteuid() != 0:
        return "not root (unshare --net and tc need it)"
    for tool in ("unshare", "tc", "ip"):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH"
    done = subprocess.run(["unshare", "--net", "sh", "-c", "ip link set lo up && tc qdisc add dev lo root tbf "
                           "rate 1gbit burst 512kb latency 100ms && tc qdisc show dev lo"],
                          capture_output=True, text=True)
    if done.returncode or "tbf" not in done.stdout:
        return f"could not shape a namespace's loopback: {done.stderr.strip() or done.stdout.strip()}"
    return None


def lo_tx_bytes() -> int:
    """The loopback's bytes sent, in this process's network namespace (/proc/net/dev is per namespace; /sys shows
    the namespace that mounted it)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])  # receive: 8 fields, then transmit bytes
    raise RuntimeError("no loopback in /proc/net/dev")


class LinkSampler:
    """The loopback's transmit counter read every few milliseconds on a thread, with the wall-clock time of each
    reading: the bytes that crossed the link over any span of the run (its steady state) by interpolation."""

    def __init__(self, every_s: float = 0.005):
        self.readings: list[tuple[float, int]] = [(time.time(), lo_tx_bytes())]
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self.readings.append((time.time(), lo_tx_bytes()))

    def stop(self) -> int:
        """Stops sampling; the bytes sent since the sampler started."""
        self._stop.set()
        self._thread.join()
        self.readings.append((time.time(), lo_tx_bytes()))
        return self.readings[-1][1] - self.readings[0][1]

    def bytes_between(self, start: float, end: float) -> float:
        """The bytes sent between two wall-clock times (linear between readings)."""
        times, counts = zip(*self.readings)
        if not times[0] <= start <= end <= times[-1]:
            raise ValueError(f"span {start:.3f}-{end:.3f} outside the readings {times[0]:.3f}-{times[-1]:.3f}")
        return float(np.interp(end, times, counts) - np.interp(start, times, counts))


def loopback_gbit(megabytes: int = 512) -> float:
    """A TCP stream's rate over this namespace's loopback, one process to another (the unshaped link)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        chunk = b"\0" * (1 << 20)

        def send() -> None:
            with socket.create_connection(("127.0.0.1", port)) as out:
                for _ in range(megabytes):
                    out.sendall(chunk)

        sender = threading.Thread(target=send)
        started = time.perf_counter()
        sender.start()
        conn, _ = server.accept()
        received, buffer = 0, bytearray(1 << 20)
        with conn:
            while received < megabytes << 20:
                got = conn.recv_into(buffer)
                if not got:
                    break
                received += got
        sender.join()
        return received * 8 / (time.perf_counter() - started) / 1e9


def inside(args) -> None:
    """In a shaped namespace (``shaped``): one system's run, its row as JSON on stdout."""
    work = Path(args.work_dir)
    data = bench_peers.make_data(work, iterations=args.iterations)
    cache_rows = int(args.cache_fraction * bench_peers.TABLES * bench_peers.ROWS_PER_TABLE)
    run_dir = work / f"run_{args.system}"
    loopback = loopback_gbit() if args.rate == "none" else None  # before the job: its bytes are not counted
    sampler = LinkSampler()
    row = run_one(args, data, run_dir, cache_rows)
    row["link_bytes"] = sampler.stop()
    if loopback is not None:
        row["loopback_gbit"] = loopback
    if row.get("timed_window"):  # the steady state's bytes, per timed iteration
        start, end = row["timed_window"]
        row["steady_link_bytes_per_iteration"] = sampler.bytes_between(start, end) / (args.iterations - args.warmup)
    if args.rate != "none":
        shown = subprocess.run(["tc", "-s", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
        row["tc"] = " ".join(shown.split())
    print("ROW " + json.dumps(row), flush=True)


def run_one(args, data: Path, run_dir: Path, cache_rows: int) -> dict:
    peers = argparse.Namespace(iterations=args.iterations, warmup=args.warmup, optimizer=args.optimizer, lr=args.lr,
                               dim=args.dim, keep_within=args.keep_within, torchrec_sharding="table_wise")
    system = args.system
    if system == "bagpipe-partitioned":
        return bench_peers.run_bagpipe(peers, data, run_dir, cache_rows, cache_mode="partitioned")
    if system == "bagpipe":
        return bench_peers.run_bagpipe(peers, data, run_dir, cache_rows)
    if system == "bagpipe-none":
        return bench_peers.run_bagpipe(peers, data, run_dir, cache_rows, policy="none")
    if system in ("torchrec-tw", "torchrec-rw"):
        peers.torchrec_sharding = "table_wise" if system == "torchrec-tw" else "row_wise"
        return bench_peers.run_torchrec(peers, data, run_dir, cache_rows)
    if system == "reference":
        return bench_peers.run_reference(peers, data, run_dir, cache_rows)
    raise ValueError(f"unknown system {system!r}: one of {', '.join(SYSTEMS)}")


def run_in_namespace(args, *, system: str, rate: str, dim: int) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--inside", "--system", system, "--rate", rate,
               "--dim", str(dim), "--iterations", str(args.iterations), "--warmup", str(args.warmup),
               "--optimizer", args.optimizer, "--lr", str(args.lr), "--cache-fraction", str(args.cache_fraction),
               "--keep-within", str(args.keep_within), "--work-dir", str(args.work_dir)]
    done = subprocess.run(shaped(command, rate), capture_output=True, text=True, timeout=args.run_timeout)
    rows = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    if done.returncode or not rows:
        raise RuntimeError(f"{system} at {rate}, dim {dim}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(rows[-1])


def run_on_hosts(args, *, system: str, rate: str, dim: int, trainers: int) -> dict:
    """One bagpipe job across hosts, each with its own link shaped to ``rate`` (none: unshaped); or the reference, in
    this process (it has no network)."""
    data = bench_peers.make_data(Path(args.work_dir), iterations=args.iterations)
    cache_rows = int(args.cache_fraction * bench_peers.TABLES * bench_peers.ROWS_PER_TABLE)
    run_dir = Path(args.work_dir) / f"hosts_{system}"
    if system == "reference":
        row = run_one(argparse.Namespace(**{**vars(args), "system": system, "dim": dim}), data, run_dir, cache_rows)
        return {**row, "link_bytes": 0}
    from bagpipe.hostjobs import HostJob, JobShape
    from bagpipe.hosts import LINK, Hosts

    def sent(hosts: Hosts) -> dict[str, int]:
        """Each host's bytes sent on its link so far (what it receives is not counted)."""
        return {name: int(hosts.run(name, ["cat", f"/sys/class/net/{LINK}/statistics/tx_bytes"]).stdout)
                for name in hosts.hosts}

    if system in ("torchrec-tw", "torchrec-rw"):  # each rank on a host of its own
        peers = argparse.Namespace(iterations=args.iterations, warmup=args.warmup, optimizer=args.optimizer,
                                   lr=args.lr, dim=dim, torchrec_sharding="table_wise" if system == "torchrec-tw"
                                   else "row_wise")
        with Hosts([f"rank{r}" for r in range(trainers)], rate=None if rate == "none" else rate) as hosts:
            before = sent(hosts)
            row = bench_peers.run_torchrec(peers, data, run_dir, cache_rows, processes=trainers, placed=[
                "--rank-netns", ",".join(hosts[f"rank{r}"].namespace for r in range(trainers)),
                "--master-addr", hosts.address("rank0")])
            after = sent(hosts)
        host_bytes = {name: after[name] - before[name] for name in after}
        return {**row, "link_bytes": sum(host_bytes.values()), "host_bytes": host_bytes}

    options = ["--iterations", str(args.iterations), "--mini-batch-size", str(bench_peers.BATCH),
               "--optimizer", args.optimizer, "--lr", str(args.lr), "--seed", "0",
               "--warmup-iterations", str(args.warmup), "--log-every", "20", "--max-eval-rows", str(bench_peers.BATCH),
               "--emb-dim", str(dim), "--arch-mlp-bot", bench_peers.bottom(dim), "--arch-mlp-top", bench_peers.TOP,
               "--cache-size", str(cache_rows), "--lookahead", "200", "--timeout", "120",
               # tensors by TCP, as between machines: between namespaces of one machine TensorPipe could move them
               # by cross-memory attach, past the links
               "--rpc-channels", "basic",
               "--policy", "none" if system == "bagpipe-none" else "lookahead",
               "--cache-mode", "partitioned" if system == "bagpipe-partitioned" else "replicated"]
    if system == "bagpipe-partitioned":
        options += ["--keep-within", str(args.keep_within)]
    shape = JobShape(trainers=trainers, servers=1, options=tuple(options))
    cwd = run_dir.parent / f"{run_dir.name}_t{trainers}_{rate}_{dim}"
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    with Hosts(shape.hosts(), rate=None if rate == "none" else rate) as hosts:
        before = sent(hosts)
        job = HostJob(hosts, shape, data=data, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})
        job.start_all()
        if not job.supervise(replace=lambda role, code: False, timeout=args.run_timeout):
            raise RuntimeError(f"{system} on hosts at {rate}, dim {dim}, {trainers} trainers failed: "
                               + " | ".join(job.log(role.name, 600) for role in job.roles if role.exits[-1]))
        after = sent(hosts)
    summary = json.loads((job.run_dir / "summary.json").read_text())
    host_bytes = {name: after[name] - before[name] for name in after}
    return {"samples_per_s": summary["samples_per_s"], "startup_s": summary["startup_s"],
            "timed_window": summary["timed_window"], "final_loss": summary["final_train_loss"],
            "embedding_stall_fraction": summary["embedding_stall_fraction"],
            "time_breakdown_ms": summary["time_breakdown_ms"],
            "allreduce_bytes_per_iteration": summary["allreduce_bytes_per_iteration"],
            "allreduce_main_bytes_per_iteration": summary["allreduce_main_bytes_per_iteration"],
            "rows_exchanged_per_iteration": summary["rows_exchanged_per_iteration"],
            "link_bytes": sum(host_bytes.values()), "host_bytes": host_bytes}


def table(rows: list[dict], *, rate: str, dim: int, args) -> str:
    by_system: dict[str, list[dict]] = {}
    for row in rows:
        by_system.setdefault(row["system"], []).append(row)
    medians = {s: statistics.median(r["samples_per_s"] for r in runs) for s, runs in by_system.items()}
    base = next((s for s in ("torchrec-tw", "torchrec-rw") if s in medians), None)
    where = f", {rows[0]['trainers']} trainers, each process on a host of its own" \
        if rows and rows[0].get("layout") == "hosts" else ""
    lines = [f"\n**{'unshaped' if rate == 'none' else rate}, dim {dim}{where}** ({args.iterations} iterations, "
             f"{args.warmup} warm-up, medians of {args.repeats}; link MB: the whole job's, start-up and evaluation "
             f"included, over its iterations, and the steady state's per timed iteration)\n",
             f"| system | samples/s | runs | vs {base or '-'} | link MB / iteration: job / steady | embedding stall | "
             f"trainer ms / iteration: cache / lookup / forward / backward / sync / optimizer |",
             "| --- | ---: | --- | ---: | ---: | ---: | --- |"]
    for system, runs in by_system.items():
        each = ", ".join(f"{r['samples_per_s']:,.0f}" for r in runs)
        ratio = f"{medians[system] / medians[base]:.2f}x" if base else "-"
        link = statistics.median(r["link_bytes"] for r in runs) / args.iterations / 1e6 \
            if system not in NO_NETWORK else 0.0
        steady = [r["steady_link_bytes_per_iteration"] for r in runs if "steady_link_bytes_per_iteration" in r]
        link = f"{link:.2f} / " + (f"{statistics.median(steady) / 1e6:.2f}" if steady else "-")
        stall = (f"{statistics.median(r['embedding_stall_fraction'] for r in runs):.1%}"
                 if "embedding_stall_fraction" in runs[0] else "")
        phases = ""
        if "time_breakdown_ms" in runs[0] and runs[0]["time_breakdown_ms"]:
            names = ("cache", "lookup", "forward", "backward", "sync", "optimizer")
            phases = " / ".join(f"{statistics.median(r['time_breakdown_ms'].get(n, 0.0) for r in runs):.1f}"
                                for n in names)
        lines.append(f"| {system} | {medians[system]:,.0f} | {each} | {ratio} | {link} | {stall} | {phases} |")
    return "\n".join(lines)


def report(paths: list[str]) -> None:
    """The tables of recorded runs, one per (rate, dim) in the order first recorded."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in read_rows(paths):
        groups.setdefault((row["rate"], row["dim"]), []).append(row)
    for (rate, dim), rows in groups.items():
        shown = argparse.Namespace(iterations=rows[0]["iterations"], warmup=rows[0]["warmup"],
                                   repeats=1 + max(r["repeat"] for r in rows))
        print(table(rows, rate=rate, dim=dim, args=shown))


def read_rows(paths: list[str]) -> list[dict]:
    return [json.loads(line) for path in paths for line in Path(path).read_text().splitlines() if line.strip()]


def blocking_bytes(row: dict, trainers: int = 2) -> float | None:
    """Of a run's bytes on the link per iteration, those its iteration waits for (None: not recorded).

    TorchRec: all of them (its all-to-alls and the dense all-reduce run inside the iteration, one after another).
    Bagpipe: the main gradient sum's (the dense gradients and, replicated, the rows used again next iteration; each
    trainer sends 2 (T - 1) / T of the buffer in a ring), and with the partitioned cache the shared rows' exchange,
    which goes out just before the dense sum and so delays it on a shared link. Fetches, write-backs, plans, the
    early bucket and the background sums go out while the trainers compute."""
    if row["system"].startswith("torchrec"):
        return row.get("steady_link_bytes_per_iteration")
    if "allreduce_main_bytes_per_iteration" not in row:
        return None
    ring = 2 * (trainers - 1) / trainers
    blocking = trainers * ring * row["allreduce_main_bytes_per_iteration"]
    return blocking + trainers * row.get("rows_exchanged_per_iteration", 0.0) * row["dim"] * 4


def iteration_ms(compute_ms: float, blocking: float, busiest: float, rate: str) -> float:
    """The model's iteration at ``rate``: max(C + K / R, L / R), K the bytes the iteration waits for and L those of
    the busiest link (the rest hides behind the compute until that link is busy all the time)."""
    per_ms = rate_bits(rate) / 8 / 1e3  # bytes the link carries in a millisecond
    return max(compute_ms + blocking / per_ms, busiest / per_ms)


def project(paths: list[str], *, trainers: int = 2) -> list[str]:
    """The projection's model held against the runs of ``paths``: each system's iteration at each rate R predicted
    from its unshaped runs and the bytes it moves, against the measured one.

    Model (one link that every byte of the job crosses, as in a shaped namespace): an iteration takes
    max(C + K / R, B / R), where B is the job's bytes on the link per iteration in the steady state, K those of them
    the iteration waits for (``blocking_bytes``), and C the iteration without the link: the unshaped runs' time less
    K at the loopback's measured rate. The rest (B - K) hides behind the compute until the link is busy all the time.
    The projection as first written (bench_scaling.py) gave each trainer a link of its own and counted only its
    bytes: max(C + K / T / R, B / T / R) here; shown beside it."""
    rows = [r for r in read_rows(paths) if r["system"] not in NO_NETWORK]
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["system"], row["dim"]), []).append(row)

    def median(values) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    lines = ["| system | dim | rate | measured ms / iteration | C ms | B MB | K MB | projected: one shared link | "
             "error | as first written: a link per trainer | error |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    worst = 0.0
    for (system, dim), runs in groups.items():
        steady = median(r.get("steady_link_bytes_per_iteration") for r in runs)
        blocking = median(blocking_bytes(r, trainers) for r in runs)
        unshaped = [r for r in runs if r["rate"] == "none"]
        loopback = median(r.get("loopback_gbit") for r in unshaped)
        if steady is None or blocking is None or not unshaped or loopback is None:
            continue
        ms = {rate: 1e3 * bench_peers.BATCH / median(r["samples_per_s"] for r in runs if r["rate"] == rate)
              for rate in dict.fromkeys(r["rate"] for r in runs)}
        compute = ms["none"] - 1e3 * blocking * 8 / (loopback * 1e9)
        for rate, measured in ms.items():
            if rate == "none":
                continue
            shared = iteration_ms(compute, blocking, steady, rate)
            own = iteration_ms(compute, blocking / trainers, steady / trainers, rate)
            worst = max(worst, abs(shared / measured - 1))
            lines.append(f"| {system} | {dim} | {rate} | {measured:,.1f} | {compute:.1f} | {steady / 1e6:.2f} | "
                         f"{blocking / 1e6:.2f} | {shared:,.1f} | {shared / measured - 1:+.0%} | {own:,.1f} | "
                         f"{own / measured - 1:+.0%} |")
    lines.append(f"\nlargest error of the shared-link model: {worst:.0%}")
    return lines


def project_hosts(paths: list[str]) -> list[str]:
    """The projection held against runs with a link per host (``--layout hosts``): an iteration at rate R takes
    max(C + K / R, L / R), where C is the same job's iteration on unshaped links (the veths' own speed, tens of
    Gbit/s: what crosses them costs C next to nothing), K the bytes a trainer waits for on its own link
    (``blocking_bytes`` over the trainers; TorchRec: all of its busiest link's), and L the bytes per iteration of
    the busiest host's link (each host's transmitted bytes over the whole job, start-up and evaluation included:
    the server's, for bagpipe). The model of the one shared loopback (``project``) gives every byte of the job to
    one link instead."""
    rows = [r for r in read_rows(paths) if r.get("layout") == "hosts" and r["system"] not in NO_NETWORK]
    groups: dict[tuple[str, int, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["system"], row["dim"], row["trainers"]), []).append(row)
    lines = ["| system | dim | trainers | rate | measured ms / iteration | C ms | K MB | L MB (busiest link) | "
             "projected | error |", "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    worst = 0.0
    for (system, dim, trainers), runs in groups.items():
        by_rate = {rate: [r for r in runs if r["rate"] == rate] for rate in dict.fromkeys(r["rate"] for r in runs)}
        if "none" not in by_rate:
            continue
        compute = statistics.median(1e3 * bench_peers.BATCH / r["samples_per_s"] for r in by_rate["none"])
        for rate, shaped in by_rate.items():
            if rate == "none":
                continue
            busiest = statistics.median(max(r["host_bytes"].values()) / r["iterations"] for r in shaped)
            if system.startswith("torchrec"):
                blocking = busiest
            else:
                blocking = statistics.median(blocking_bytes(r, trainers) for r in shaped) / trainers
            measured = statistics.median(1e3 * bench_peers.BATCH / r["samples_per_s"] for r in shaped)
            projected = iteration_ms(compute, blocking, busiest, rate)
            worst = max(worst, abs(projected / measured - 1))
            cells = (system, dim, trainers, rate, f"{measured:,.1f}", f"{compute:.1f}", f"{blocking / 1e6:.2f}",
                     f"{busiest / 1e6:.2f}", f"{projected:,.1f}", f"{projected / measured - 1:+.0%}")
            lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return [*lines, f"\nlargest error of the link-per-host model: {worst:.0%}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="100mbit,1gbit,10gbit,none")
    p.add_argument("--dims", default="16,128")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--optimizer", choices=("sgd", "adagrad"), default="sgd")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--cache-fraction", type=float, default=0.10, help="rows each bagpipe trainer caches")
    p.add_argument("--keep-within", type=int, default=4, help="bagpipe-partitioned's --keep-within")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one job may take")
    p.add_argument("--layout", choices=("loopback", "hosts"), default="loopback",
                   help="loopback: a job's processes share one shaped loopback; hosts: each on a host with a link "
                        "of its own")
    p.add_argument("--trainers", default="2", help="--layout hosts: trainer counts, comma-separated (2,4)")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default=None, help="every run as JSON lines (appended)")
    p.add_argument("--report", nargs="+", default=None, metavar="FILE.jsonl",
                   help="print the tables of runs recorded with --out (their own iterations and repeats), run nothing")
    p.add_argument("--project", nargs="+", default=None, metavar="FILE.jsonl",
                   help="hold the projection's model against runs recorded with --out (see project()), run nothing")
    # one run inside a namespace (the outer process starts these)
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--rate", help=argparse.SUPPRESS)
    p.add_argument("--dim", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inside:
        inside(args)
        return 0
    if args.report:
        report(args.report)
        return 0
    if args.project:
        hosts = any(r.get("layout") == "hosts" for r in read_rows(args.project))
        print("\n".join(project_hosts(args.project) if hosts else project(args.project)))
        return 0
    rates, dims, systems = args.rates.split(","), [int(d) for d in args.dims.split(",")], args.systems.split(",")
    for rate in rates:
        rate_bits(rate)  # a bad rate fails now, not after an hour
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown systems {unknown}: any of {', '.join(SYSTEMS)}")
    why = cannot_shape()
    if args.layout == "hosts":
        from bagpipe.hosts import available

        why = None if available()[0] else available()[1]
    if why:
        print(f"bench_network: skipped: {why}", file=sys.stderr)
        return 0
    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="bench_network_")
    bench_peers.make_data(Path(args.work_dir), iterations=args.iterations)  # once, before any namespace
    if any(s.startswith("torchrec") for s in systems):
        subprocess.run(["bash", str(HERE / "peer" / "setup_torchrec.sh")], check=True, stdout=sys.stderr)
    out = open(args.out, "a") if args.out else None
    tables = []
    counts = [int(t) for t in args.trainers.split(",")] if args.layout == "hosts" else [2]
    for rate, dim, trainers in itertools.product(rates, dims, counts):
        rows = []
        for repeat in range(args.repeats):
            for system in systems:
                if args.layout == "hosts":
                    row = run_on_hosts(args, system=system, rate=rate, dim=dim, trainers=trainers)
                else:
                    row = run_in_namespace(args, system=system, rate=rate, dim=dim)
                row.update(system=system, rate=rate, dim=dim, repeat=repeat, iterations=args.iterations,
                           warmup=args.warmup, layout=args.layout, trainers=trainers)
                rows.append(row)
                steady = row.get("steady_link_bytes_per_iteration")
                print(f"{rate} dim {dim} {trainers} trainers repeat {repeat} {system}: "
                      f"{row['samples_per_s']:,.0f} samples/s, {row['link_bytes'] / args.iterations / 1e6:.2f} "
                      f"MB/iteration on the link" + (f" ({steady / 1e6:.2f} in the steady state)" if steady else ""),
                      flush=True)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
        tables.append(table(rows, rate=rate, dim=dim, args=args))
        print(tables[-1], flush=True)
    print("\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
