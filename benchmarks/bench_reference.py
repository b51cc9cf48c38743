"""Throughput of the binary reader and of the reference trainer, on synthetic Criteo-shaped data.

Run from the repository root::

    .venv/bin/python benchmarks/bench_reference.py            # full run, 2-4 minutes on 2 cores
    .venv/bin/python benchmarks/bench_reference.py --quick    # smoke run, well under a minute
    .venv/bin/python benchmarks/bench_reference.py --threads 1,2 --json-out runs/bench.json

What it does:

1. ``bagpipe.synth.generate`` writes Criteo-format TSV (26 tables, the criteo-kaggle sizes capped
   at ``--max-rows-per-table``) into a temporary directory (or ``--work-dir``), and
   ``bagpipe.data.preprocess.preprocess`` converts it to the binary format (timed: rows/s).
2. Reader: whole passes over the train split (at least 0.2 s of them per sample), batch by batch
   (``--batch-size``), through ``iterate_batches`` into torch tensors, in file order and
   shuffled; and the same slices read straight from the memory maps as numpy copies. The page
   cache is warm (the files were just written). Target: more than 1M rows/s.
3. Trainer: ``bagpipe.train.reference.train_reference`` for every (arch, optimizer, threads), repeated
   ``--train-repeats`` times with the configurations interleaved, so that a burst of load from
   another process does not land on one configuration only. The figure is the trainer's own
   steady-state samples/s (warm-up iterations excluded; batch reading included).
4. Phases: the trainer's ``train_step`` split by manual timers (read, lookup, forward, backward,
   dense optimizer, row optimizer), median milliseconds per iteration.
5. Micro: two candidate speed-ups of the hot path, timed against the current code on the same
   shapes, with a check that they give bit-identical results.

Every figure is a median over repeats. The result is printed as one JSON object, then as markdown
tables. ``foreign_cpu`` is the share of the machine's CPU time used by other processes (or stolen
by the host) while a measurement ran: above ~0.1 the figure is contaminated and a warning is
printed, and the trainer table also gives the median over the quiet runs alone. With 2 cores and
2 torch threads, any other busy process stalls every parallel region (a 3-10x slowdown).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bagpipe.config import ModelConfig, TrainConfig
from bagpipe.data.batches import batch_rows, batches_per_epoch, iterate_batches
from bagpipe.data.binary import BinarySplit, is_preprocessed, open_dataset
from bagpipe.data.preprocess import preprocess
from bagpipe.train.reference import build_model, build_tables, train_reference
from bagpipe.synth import generate, resolve_table_sizes

READER_TARGET_ROWS_PER_S = 1_000_000
# The figure the project brief quotes for TorchRec's unfused DLRM on a comparable 2-core CPU
# machine. It is NOT measured by this script; it is only the yardstick the brief sets.
TORCHREC_UNFUSED_SAMPLES_PER_S = 25_000
DEFAULT_ARCHS = "13-512-256-16:512-256-1,13-64-16:64-32-1"
FOREIGN_CPU_WARN = 0.10


# ---------------------------------------------------------------------------------------------
# How busy the rest of the machine was while we measured (Linux /proc/stat; None elsewhere).


def _cpu_snapshot() -> tuple[float, float, float] | None:
    try:
        with open("/proc/stat") as handle:
            fields = [int(x) for x in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    busy_s = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user..steal
    own = os.times()
    return time.perf_counter(), busy_s, own.user + own.system


def _foreign_fraction(start, end) -> float | None:
    if start is None or end is None:
        return None
    wall = end[0] - start[0]
    if wall <= 0.05:  # /proc/stat ticks are 10 ms: too coarse for shorter spans
        return None
    foreign = (end[1] - start[1]) - (end[2] - start[2])
    return round(max(foreign, 0.0) / ((os.cpu_count() or 1) * wall), 3)


@contextmanager
def cpu_watch(record: dict, key: str = "foreign_cpu"):
    start = _cpu_snapshot()
    try:
        yield
    finally:
        record[key] = _foreign_fraction(start, _cpu_snapshot())


@contextmanager
def torch_threads(threads: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def median(values) -> float:
    return float(statistics.median(values)) if values else float("nan")


def worst(values) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# 1. Data


def prepare_data(work: Path, args) -> tuple[Path, dict]:
    """Synthesize and preprocess, or reuse a matching data set already in ``work``."""
    sizes = resolve_table_sizes(tables=None, table_sizes=None, max_rows_per_table=args.max_rows_per_table)
    raw, binary = work / "raw", work / "binary"
    wanted = {"train_rows": args.rows, "test_rows": args.test_rows, "seed": args.seed, "table_sizes": sizes}
    info: dict = {"train_rows": args.rows, "test_rows": args.test_rows, "tables": len(sizes),
                  "table_rows": sum(sizes), "max_rows_per_table": args.max_rows_per_table}
    meta_path = binary / "meta.json"
    if not args.regenerate and is_preprocessed(binary) and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if all(meta.get(k) == v for k, v in wanted.items()):
            say(f"reusing {binary}")
            info.update(reused=True, synth_s=None, preprocess_s=None, preprocess_rows_per_s=None)
            return binary, info
    say(f"synthesizing {args.rows} + {args.test_rows} rows into {raw}")
    started = time.perf_counter()
    generate(raw, rows=args.rows, test_rows=args.test_rows, seed=args.seed, table_sizes=sizes,
             show_progress=False)
    info["synth_s"] = round(time.perf_counter() - started, 3)
    say("preprocessing")
    with cpu_watch(info, "preprocess_foreign_cpu"):
        started = time.perf_counter()
        preprocess(raw, binary, show_progress=False)
        seconds = time.perf_counter() - started
    info.update(reused=False, preprocess_s=round(seconds, 3),
                preprocess_rows_per_s=round((args.rows + args.test_rows) / seconds),
                tsv_bytes=sum(p.stat().st_size for p in raw.glob("*.tsv")))
    return binary, info


# ---------------------------------------------------------------------------------------------
# 2. Reader


def _pass_iterate(split: BinarySplit, batch_size: int, shuffle: bool) -> int:
    iterations = batches_per_epoch(split, batch_size)
    rows = 0
    for batch in iterate_batches(split, batch_size=batch_size, iterations=iterations, shuffle=shuffle,
                                 shuffle_seed=0):
        rows += len(batch)
    return rows


def _pass_memmap(split: BinarySplit, batch_size: int) -> int:
    rows = 0
    for selector in batch_rows(split, batch_size=batch_size, iterations=batches_per_epoch(split, batch_size),
                               shuffle=False, shuffle_seed=0):
        labels = np.array(split.labels[selector])
        np.array(split.dense[selector])
        np.array(split.ids[selector])
        rows += len(labels)
    return rows


def bench_reader(split: BinarySplit, *, batch_size: int, repeats: int, min_seconds: float = 0.2) -> dict:
    variants = {
        "iterate_batches": lambda: _pass_iterate(split, batch_size, shuffle=False),
        "iterate_batches_shuffled": lambda: _pass_iterate(split, batch_size, shuffle=True),
        "memmap_slices": lambda: _pass_memmap(split, batch_size),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    foreign: list[float | None] = []
    for _ in range(repeats):  # interleaved, so noise is shared out
        for name, run in variants.items():
            watch: dict = {}
            with cpu_watch(watch):
                started, rows = time.perf_counter(), 0
                while True:  # whole passes, until the sample is long enough to time well
                    rows += run()
                    seconds = time.perf_counter() - started
                    if seconds >= min_seconds:
                        break
            samples[name].append(rows / seconds)
            foreign.append(watch["foreign_cpu"])
    result = {
        "batch_size": batch_size,
        "rows_per_pass": batches_per_epoch(split, batch_size) * batch_size,
        "repeats": repeats,
        "min_seconds_per_sample": min_seconds,
        "target_rows_per_s": READER_TARGET_ROWS_PER_S,
        "worst_foreign_cpu": worst(foreign),
    }
    for name, values in samples.items():
        result[name] = {"median_rows_per_s": round(median(values)), "min_rows_per_s": round(min(values)),
                        "max_rows_per_s": round(max(values))}
    result["meets_target"] = result["iterate_batches"]["median_rows_per_s"] > READER_TARGET_ROWS_PER_S
    return result


# ---------------------------------------------------------------------------------------------
# 3. Trainer


def parse_archs(text: str) -> list[tuple[str, str]]:
    archs = []
    for part in text.split(","):
        bottom, sep, top = part.strip().partition(":")
        if not sep:
            raise SystemExit(f"--archs: expected BOTTOM:TOP pairs such as 13-64-16:64-32-1, got {part!r}")
        archs.append((bottom, top))
    return archs


def parse_threads(text: str) -> list[int]:
    if not text:
        return [torch.get_num_threads()]
    threads = [int(x) for x in text.split(",") if x.strip()]
    if not threads or any(t <= 0 for t in threads):
        raise SystemExit(f"--threads: expected positive integers, got {text!r}")
    return threads


def make_config(data: Path, run_dir: Path, *, arch: tuple[str, str], optimizer: str, args) -> TrainConfig:
    return TrainConfig(
        data=str(data), run_dir=str(run_dir), iterations=args.train_iterations, batch_size=args.batch_size,
        optimizer=optimizer, lr=0.01, warmup_iterations=args.warmup, log_every=10**9,
        max_eval_rows=args.batch_size, eval_batch_size=args.batch_size,
        model=ModelConfig(emb_dim=args.emb_dim, arch_mlp_bot=arch[0], arch_mlp_top=arch[1]),
    )


def bench_trainer(data: Path, work: Path, *, archs, optimizers, threads_list, args) -> list[dict]:
    configs = [(a, o, t) for t in threads_list for a in archs for o in optimizers]
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    for repeat in range(args.train_repeats):
        for arch, optimizer, threads in configs:
            say(f"train repeat {repeat + 1}/{args.train_repeats}: {arch[0]} / {arch[1]}, {optimizer}, "
                f"{threads} thread(s)")
            config = make_config(data, work / "runs" / "bench", arch=arch, optimizer=optimizer, args=args)
            watch: dict = {}
            with torch_threads(threads), cpu_watch(watch):
                summary = train_reference(config, show_progress=False, overwrite=True)
            runs[(arch, optimizer, threads)].append({"samples_per_s": summary["samples_per_s"],
                                                     "foreign_cpu": watch["foreign_cpu"]})
    results = []
    for (arch, optimizer, threads), samples in runs.items():
        rates = [s["samples_per_s"] for s in samples]
        clean = [s["samples_per_s"] for s in samples if (s["foreign_cpu"] or 0.0) <= FOREIGN_CPU_WARN]
        med = median(rates)
        results.append({
            "arch_mlp_bot": arch[0], "arch_mlp_top": arch[1], "optimizer": optimizer, "threads": threads,
            "median_samples_per_s": round(med), "min_samples_per_s": round(min(rates)),
            "max_samples_per_s": round(max(rates)), "runs": len(rates),
            "ms_per_iteration": round(args.batch_size / med * 1e3, 2),
            "vs_torchrec_unfused": round(med / TORCHREC_UNFUSED_SAMPLES_PER_S, 2),
            # The same median over the runs during which the rest of the machine stayed quiet.
            "clean_runs": len(clean),
            "median_clean_samples_per_s": round(median(clean)) if clean else None,
            "worst_foreign_cpu": worst(s["foreign_cpu"] for s in samples),
            "per_run": [{"samples_per_s": round(s["samples_per_s"]), "foreign_cpu": s["foreign_cpu"]}
                        for s in samples],
        })
    return results


# ---------------------------------------------------------------------------------------------
# 4. Where an iteration's time goes (the same calls as reference.train_step, with timers between)

PHASES = ("read", "lookup", "forward", "backward", "dense_optimizer", "row_optimizer")


def profile_phases(data: Path, *, arch: tuple[str, str], optimizer: str, threads: int, args) -> dict:
    torch.use_deterministic_algorithms(True)  # as train_reference does
    dataset = open_dataset(data)
    config = make_config(data, Path("unused"), arch=arch, optimizer=optimizer, args=args)
    model = build_model(config, dataset.schema)
    tables = build_tables(config, dataset.schema)
    dense_optimizer = tables.optimizer.dense_optimizer(model.parameters())
    iterations = min(args.phase_iterations, batches_per_epoch(dataset.train, args.batch_size))
    warmup = min(args.warmup, iterations - 1)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    unique_rows: list[int] = []
    watch: dict = {}
    with torch_threads(threads), cpu_watch(watch):
        batches = iterate_batches(dataset.train, batch_size=args.batch_size, iterations=iterations)
        for iteration in range(iterations):
            t0 = time.perf_counter()
            batch = next(batches)
            t1 = time.perf_counter()
            embeddings, lookups = tables.lookup(batch.ids)
            t2 = time.perf_counter()
            loss = F.binary_cross_entropy_with_logits(model(batch.dense_x, embeddings), batch.target)
            t3 = time.perf_counter()
            dense_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            t4 = time.perf_counter()
            dense_optimizer.step()
            t5 = time.perf_counter()
            tables.apply_gradients(lookups)
            loss.item()
            t6 = time.perf_counter()
            if iteration >= warmup:
                for phase, (a, b) in zip(PHASES, ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6))):
                    times[phase].append((b - a) * 1e3)
                unique_rows.append(sum(lookup.index.numel() for lookup in lookups))
    phases = {p: round(median(v), 3) for p, v in times.items()}
    total = sum(phases.values())
    return {
        "arch_mlp_bot": arch[0], "arch_mlp_top": arch[1], "optimizer": optimizer, "threads": threads,
        "median_ms": phases, "sum_of_medians_ms": round(total, 3),
        "share": {p: round(v / total, 3) for p, v in phases.items()},
        "unique_rows_per_batch": int(median(unique_rows)), "foreign_cpu": watch["foreign_cpu"],
    }


# ---------------------------------------------------------------------------------------------
# 5. Candidate speed-ups, timed on the trainer's shapes against what the code does today


def _time_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1e3)
    return round(median(samples), 3)


def micro_benchmarks(*, batch_size: int, tables: int, dim: int, unique_rows: int, threads: int,
                     repeats: int) -> dict:
    torch.use_deterministic_algorithms(True)
    generator = torch.Generator().manual_seed(0)
    inverse = torch.randint(0, unique_rows, (batch_size, tables), generator=generator)
    rows0 = torch.randn(unique_rows, dim, generator=generator)
    grad_out = torch.randn(batch_size, tables, dim, generator=generator)

    def embedding_today():  # the former embeddings.py: F.embedding(inverse, rows)
        rows = rows0.clone().requires_grad_(True)
        F.embedding(inverse, rows).backward(grad_out)
        return rows.grad

    def embedding_index_select():  # backward is an index_add_ instead of embedding_dense_backward
        rows = rows0.clone().requires_grad_(True)
        rows.index_select(0, inverse.reshape(-1)).view(batch_size, tables, dim).backward(grad_out)
        return rows.grad

    features = tables + 1
    pair_rows, pair_cols = torch.tril_indices(features, features, offset=-1)
    flat_pairs = pair_rows * features + pair_cols
    dots0 = torch.randn(batch_size, features, features, generator=generator)
    grad_pairs = torch.randn(batch_size, pair_rows.numel(), generator=generator)

    def interaction_today():  # the former models/dlrm.py: dots[:, pair_rows, pair_cols]
        dots = dots0.clone().requires_grad_(True)
        out = dots[:, pair_rows, pair_cols]
        out.backward(grad_pairs)
        return out, dots.grad

    def interaction_index_select():  # one flat index; backward is an index_add_ along dim 1
        dots = dots0.clone().requires_grad_(True)
        out = dots.flatten(1).index_select(1, flat_pairs)
        out.backward(grad_pairs)
        return out, dots.grad

    with torch_threads(threads):
        same_embedding = torch.equal(embedding_today(), embedding_index_select())
        (out_a, grad_a), (out_b, grad_b) = interaction_today(), interaction_index_select()
        same_interaction = torch.equal(out_a, out_b) and torch.equal(grad_a, grad_b)
        results = {}
        for name, today, candidate, same in (
            ("embedding_fwd_bwd", embedding_today, embedding_index_select, same_embedding),
            ("interaction_gather_fwd_bwd", interaction_today, interaction_index_select, same_interaction),
        ):
            a, b = [], []
            for _ in range(3):  # interleave today/candidate so both see the same load
                a.append(_time_ms(today, repeats))
                b.append(_time_ms(candidate, repeats))
            results[name] = {"today_ms": median(a), "candidate_ms": median(b),
                             "saved_ms": round(median(a) - median(b), 3), "bit_identical": same}
    results["embedding_fwd_bwd"]["today"] = "F.embedding(inverse, rows) (before; embeddings.py now uses the candidate)"
    results["embedding_fwd_bwd"]["candidate"] = "rows.index_select(0, inverse.reshape(-1)).view(B, T, D)"
    results["interaction_gather_fwd_bwd"]["today"] = "dots[:, pair_rows, pair_cols] (before; models/dlrm.py now uses the candidate)"
    results["interaction_gather_fwd_bwd"]["candidate"] = "dots.flatten(1).index_select(1, pair_rows * F + pair_cols)"
    results["note"] = "includes a clone of the input in both variants; shapes as in the trainer"
    return results


# ---------------------------------------------------------------------------------------------
# Output


def environment() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu, "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "torch_threads_default": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
        "python": platform.python_version(), "platform": platform.platform(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def all_foreign(results: dict) -> list[float | None]:
    return ([results["reader"]["worst_foreign_cpu"]] + [r["worst_foreign_cpu"] for r in results["trainer"]]
            + [p["foreign_cpu"] for p in results.get("phases", [])])


def fmt_rate(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def markdown(results: dict) -> str:
    env, data, reader = results["environment"], results["data"], results["reader"]
    lines = [
        f"machine: {env['cpu']} ({env['cpu_count']} cores), torch {env['torch']}, "
        f"default torch threads {env['torch_threads_default']}, CUDA {env['cuda']}",
        f"command: {results['command']}",
        "",
        "| reader (train split, batch %d, warm page cache) | median rows/s | min | max |" % reader["batch_size"],
        "| --- | ---: | ---: | ---: |",
    ]
    for name in ("iterate_batches", "iterate_batches_shuffled", "memmap_slices"):
        r = reader[name]
        lines.append(f"| {name} | {fmt_rate(r['median_rows_per_s'])} | {fmt_rate(r['min_rows_per_s'])} "
                     f"| {fmt_rate(r['max_rows_per_s'])} |")
    lines.append(f"\ntarget {READER_TARGET_ROWS_PER_S:,} rows/s: "
                 f"{'met' if reader['meets_target'] else 'NOT met'} "
                 f"({reader['iterate_batches']['median_rows_per_s'] / READER_TARGET_ROWS_PER_S:.1f}x)")
    if data.get("preprocess_rows_per_s"):
        lines.append(f"preprocess (Criteo TSV -> binary): {fmt_rate(data['preprocess_rows_per_s'])} rows/s")
    lines += [
        "",
        f"| reference trainer (batch {results['settings']['batch_size']}, dim {results['settings']['emb_dim']}) "
        "| opt | threads | median samples/s | min | max | ms/it | vs 25k (TorchRec unfused, BRIEF) "
        "| median of quiet runs (n) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results["trainer"]:
        lines.append(f"| {r['arch_mlp_bot']} / {r['arch_mlp_top']} | {r['optimizer']} | {r['threads']} "
                     f"| {fmt_rate(r['median_samples_per_s'])} | {fmt_rate(r['min_samples_per_s'])} "
                     f"| {fmt_rate(r['max_samples_per_s'])} | {r['ms_per_iteration']} "
                     f"| {r['vs_torchrec_unfused']:.2f}x "
                     f"| {fmt_rate(r['median_clean_samples_per_s'])} ({r['clean_runs']}/{r['runs']}) |")
    if results.get("phases"):
        lines += ["", "| phase, median ms/iteration | " + " | ".join(PHASES) + " | sum |",
                  "| --- |" + " ---: |" * (len(PHASES) + 1)]
        for p in results["phases"]:
            lines.append(f"| {p['arch_mlp_bot']} / {p['arch_mlp_top']}, {p['optimizer']}, {p['threads']}t | "
                         + " | ".join(f"{p['median_ms'][k]:.2f}" for k in PHASES)
                         + f" | {p['sum_of_medians_ms']:.2f} |")
    if results.get("micro"):
        lines += ["", "| candidate speed-up (median ms, fwd+bwd) | today | candidate | saved | bit-identical |",
                  "| --- | ---: | ---: | ---: | --- |"]
        for name in ("embedding_fwd_bwd", "interaction_gather_fwd_bwd"):
            m = results["micro"][name]
            lines.append(f"| {m['candidate']} | {m['today_ms']:.2f} | {m['candidate_ms']:.2f} "
                         f"| {m['saved_ms']:.2f} | {m['bit_identical']} |")
    foreign = all_foreign(results)
    lines.append(f"\nworst foreign CPU share during a measurement: {worst(foreign)}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a fast smoke run: small data, few iterations")
    p.add_argument("--work-dir", default=None, help="keep data here and reuse it (default: a temp dir)")
    p.add_argument("--regenerate", action="store_true", help="rebuild the data even if --work-dir has it")
    p.add_argument("--rows", type=int, default=300_000, help="training rows")
    p.add_argument("--test-rows", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rows-per-table", type=int, default=100_000)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--emb-dim", type=int, default=16)
    p.add_argument("--archs", default=DEFAULT_ARCHS, help="comma-separated BOTTOM:TOP pairs")
    p.add_argument("--optimizers", default="sgd,adagrad")
    p.add_argument("--threads", default="", help="comma-separated torch thread counts (default: torch's)")
    p.add_argument("--reader-repeats", type=int, default=7)
    p.add_argument("--train-iterations", type=int, default=40, help="iterations per trainer run")
    p.add_argument("--warmup", type=int, default=5, help="iterations excluded from samples/s")
    p.add_argument("--train-repeats", type=int, default=5)
    p.add_argument("--phase-iterations", type=int, default=40)
    p.add_argument("--no-phases", action="store_true", help="skip the per-phase breakdown")
    p.add_argument("--no-micro", action="store_true", help="skip the candidate speed-up micro-benchmarks")
    p.add_argument("--json-out", default=None, help="also write the JSON results to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.rows, args.test_rows = min(args.rows, 40_000), min(args.test_rows, 4096)
        args.reader_repeats, args.train_repeats = min(args.reader_repeats, 3), 1
        args.train_iterations, args.warmup, args.phase_iterations = 12, 3, 12
    if args.rows < args.batch_size:
        raise SystemExit(f"--rows {args.rows} is fewer than one batch of {args.batch_size}")
    archs = parse_archs(args.archs)
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    threads_list = parse_threads(args.threads)
    results: dict = {
        "command": " ".join([".venv/bin/python", "benchmarks/bench_reference.py", *(argv or sys.argv[1:])]),
        "environment": environment(),
        "settings": {k: getattr(args, k) for k in ("quick", "batch_size", "emb_dim", "train_iterations", "warmup",
                                                   "train_repeats", "reader_repeats", "phase_iterations")},
        "torchrec_unfused_samples_per_s": {"value": TORCHREC_UNFUSED_SAMPLES_PER_S,
                                           "source": "project brief; not measured by this script"},
    }
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bagpipe-bench-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data, results["data"] = prepare_data(work, args)
        dataset = open_dataset(data)
        say("reader")
        results["reader"] = bench_reader(dataset.train, batch_size=args.batch_size, repeats=args.reader_repeats)
        results["trainer"] = bench_trainer(data, work, archs=archs, optimizers=optimizers,
                                           threads_list=threads_list, args=args)
        if not args.no_phases:
            say("phases")
            results["phases"] = [profile_phases(data, arch=a, optimizer=o, threads=t, args=args)
                                 for t in threads_list for a in archs for o in optimizers]
        if not args.no_micro:
            say("micro-benchmarks")
            unique = results["phases"][0]["unique_rows_per_batch"] if results.get("phases") else 9000
            results["micro"] = micro_benchmarks(batch_size=args.batch_size, tables=dataset.train.num_tables,
                                                dim=args.emb_dim, unique_rows=unique, threads=threads_list[0],
                                                repeats=5 if args.quick else 20)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    foreign = all_foreign(results)
    if (worst(foreign) or 0.0) > FOREIGN_CPU_WARN:
        say(f"WARNING: other processes used up to {worst(foreign):.0%} of the CPU during a measurement; "
            "these figures are contaminated, rerun on a quiet machine")
    text = json.dumps(results, indent=2)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(text + "\n")
    print(text)
    print()
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
