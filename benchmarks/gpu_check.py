"""The GPU path checked on a machine with a GPU, in one prepared command (issue 28's `make gpu-check`).

    make gpu-check OUT=DIR                       (or: PYTHONPATH=src python benchmarks/gpu_check.py --out DIR)

Writes DIR/report.md and DIR/report.json as it goes (a run cut off still leaves what it did), each step in its
own try block and reported as it ended: finding what breaks is the point of a first run on a GPU. Steps:

1. the machine: torch, CUDA, the GPU, and which of the project's dependencies import (the GPU machine has torch
   preinstalled and no network: the project runs there from its source with PYTHONPATH=src);
2. the tests that take a device, on CUDA (pytest; the CUDA cases are skipped on machines without one):
   tests/unit/test_device.py, tests/unit/train/test_device_modes.py (and its jobs' half in tests/integration/),
   tests/unit/train/test_single.py, tests/unit/nn/test_nn.py, tests/unit/nn/test_nn_pytorch.py; pass / fail / skip
   counts, and each failure's last lines;
3. `bagpipe train` on CUDA: --mode reference (every table in GPU memory) against --mode single with caches of
   1% and 5% of the rows (the tables in host memory), alternated, median samples/s of --repeats runs each and
   the ratio to the reference; the same runs on the CPU for scale; and every CUDA run's waits of the host for the
   GPU in one steady iteration (summary.json's device_syncs_per_iteration, by torch's sync debug mode, with the
   lines that asked for them: device_sync_sites in report.json);
4. `bagpipe train --mode bagpipe --device cuda` (the oracle and a server on the CPU cores, a 5% cache) with one
   trainer on the GPU and with two trainers sharing it, against --mode reference on the GPU (alternated, medians):
   samples/s, the rows each trainer copied to the GPU per iteration (its H2D traffic) and the share of its loop it
   waited for rows, plans and sums;
5. where the training loop's wall time goes on the host, by line (py-spy, carried by `make gpu-wheels`): --mode
   single at 5% and a one-trainer bagpipe job on the GPU (a `.to(device)` or `.cpu()` high on the list is the
   host waiting for the device);
6. `bagpipe.nn` against `nn.EmbeddingBag` on the GPU (benchmarks/gpu_check_nn.py), with the cache's pinned
   allocations (reused staging buffers: a small number whatever the batches);
7. `--compile` (the dense model's loss and backward through torch.compile): the reference, --mode single at 5%
   and one bagpipe trainer compiled, against the reference uncompiled (the exactness of compiled runs on CUDA:
   step 2's tests/integration/test_compile_jobs.py; `--skip tests,train,bagpipe,profile,nn` runs this step alone).

Not here: NCCL among the trainers (refused: they sum in host memory over gloo; NCCL needs a GPU per trainer, and
this machine has one). A trainer's fetched rows go to its GPU on a side stream of each cache's own, through reused
pinned buffers: step 4 reports their allocations (summary.json's copies_to_device).
Exits 1 without a GPU unless --allow-cpu (to try the script itself on a CPU machine).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (files, -k expression): whole files that take a device, and the CUDA cases of the bagpipe jobs' equality tests
TESTS = [(["tests/unit/test_device.py", "tests/unit/train/test_device_modes.py",
            "tests/integration/test_device_modes_jobs.py", "tests/unit/train/test_single.py", "tests/unit/nn/test_nn.py",
            "tests/unit/nn/test_nn_pytorch.py"], ""), (["tests/integration/test_compile_jobs.py"], "cuda"),
         (["tests/integration/test_runtime_jobs.py"], "cuda")]
DEPENDENCIES = ["numpy", "tqdm", "matplotlib", "pyarrow", "orjson", "xxhash", "pytest", "xdist"]


class Report:
    """Steps' results, written to OUT/report.json and OUT/report.md after each step."""

    def __init__(self, out: Path) -> None:
        self.out, self.steps = out, {}
        out.mkdir(parents=True, exist_ok=True)

    def step(self, name: str, fn, *args, **kwargs) -> dict:
        started = time.perf_counter()
        try:
            result = {"ok": True, **fn(*args, **kwargs)}
        except Exception as err:  # a step that breaks is a finding, not the end of the check
            result = {"ok": False, "error": f"{type(err).__name__}: {err}", "where": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.perf_counter() - started, 1)
        self.steps[name] = result
        self.write()
        print(f"[gpu-check] {name}: {'ok' if result['ok'] else 'FAILED'} ({result['seconds']} s)", flush=True)
        return result

    def write(self) -> None:
        (self.out / "report.json").write_text(json.dumps(self.steps, indent=2, default=str))
        lines = ["# GPU check", ""]
        for name, result in self.steps.items():
            lines.append(f"## {name}: {'ok' if result['ok'] else 'FAILED'} ({result['seconds']} s)")
            lines.append("")
            if result.get("table"):
                lines += [result["table"], ""]
            for key, value in result.items():
                if key not in ("ok", "seconds", "table", "where", "runs", "profiles"):
                    lines.append(f"- {key}: {value}")
            if result.get("where"):
                lines += ["", "```", result["where"], "```"]
            lines.append("")
        (self.out / "report.md").write_text("\n".join(lines))


def machine() -> dict:
    import torch

    found = {}
    for name in DEPENDENCIES:
        try:
            found[name] = getattr(importlib.import_module(name), "__version__", "yes")
        except Exception as err:
            found[name] = f"missing ({type(err).__name__})"
    cuda = torch.cuda.is_available()
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if cuda else None, "gpus": torch.cuda.device_count(),
            "cpus": os.cpu_count(), "dependencies": found}


def run(command: list[str], *, timeout: float, env: dict | None = None, src: str = "") -> subprocess.CompletedProcess:
    """``command`` with the project imported from ``src`` (default this checkout's src/)."""
    first = str(Path(src).resolve()) if src else str(ROOT / "src")
    environment = dict(os.environ, PYTHONPATH=first + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    return subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=timeout)


def tests(timeout: float) -> dict:
    workers = ["-n", "4"] if importlib.util.find_spec("xdist") else []
    summaries, tails, passed = [], [], True
    for files, select in TESTS:
        done = run([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *workers, *files,
                    *(["-k", select] if select else [])], timeout=timeout)
        summary = next((line for line in reversed(done.stdout.splitlines()) if " in " in line
                        and any(word in line for word in ("passed", "failed", "skipped", "error"))), "")
        if done.returncode not in (0, 1):
            raise RuntimeError(f"pytest exited {done.returncode}: {summary or done.stderr[-2000:]}")
        summaries.append(f"{' '.join(files)}{f' -k {select}' if select else ''}: {summary.strip('= ')}")
        tails.append(done.stdout[-4000:])
        passed = passed and done.returncode == 0
    return {"summary": summaries, "all_passed": passed, "table": "\n".join(f"```\n{t}\n```" for t in tails)}


def train_command(run_dir: Path, data: Path, *, device: str, mode: str, cache_rows: int, args,
                  trainers: int = 1, compiled: bool = False) -> list[str]:
    command = [sys.executable, "-m", "bagpipe.cli", "train", "--data", str(data), "--run-dir", str(run_dir),
               "--overwrite", "--no-progress", "--mode", mode, "--device", device, "--batch-size",
               str(args.batch_size), "--iterations", str(args.iterations), "--emb-dim", str(args.dim),
               "--max-eval-rows", "1", *(["--compile"] if compiled else [])]
    if mode != "reference":
        command += ["--cache-rows", str(cache_rows)]
    if mode == "bagpipe":
        command += ["--trainers", str(trainers), "--servers", "1"]
    return command


def train_once(work: Path, data: Path, name: str, *, device: str, mode: str, cache_rows: int, args,
               trainers: int = 1, compiled: bool = False, src: str = "") -> dict:
    """One `bagpipe train` run's figures; ``src``: the project's source to run it from (default this one's)."""
    run_dir = work / name
    command = train_command(run_dir, data, device=device, mode=mode, cache_rows=cache_rows, args=args,
                            trainers=trainers, compiled=compiled)
    done = run(command, timeout=args.step_timeout, src=src)
    if done.returncode:
        raise RuntimeError(f"{name}: exit {done.returncode}: {done.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    iterations = max(summary.get("iterations", 1), 1)
    return {"samples_per_s": summary["samples_per_s"], "device": summary.get("device", device),
            "time_breakdown_ms": summary.get("time_breakdown_ms"), "cache_hit_rate": summary.get("cache_hit_rate"),
            # a bagpipe job's: rows each trainer copied to its device per iteration, and the share of its loop it
            # waited (rows, plans, lazily synced updates)
            "rows_to_device_per_trainer_iteration": summary["rows_fetched"] / iterations / trainers
            if mode == "bagpipe" else None,
            "stall_fraction": summary.get("embedding_stall_fraction"),
            # each trainer's pinned allocations for those copies (reused buffers: a few, not one per batch)
            "copies_to_device": summary.get("copies_to_device"),
            "fetch_wait_fraction": summary.get("fetch_wait_fraction"),
            # the host's waits for the GPU in one steady iteration (torch's sync debug mode; per trainer in a bagpipe
            # job) and the lines that asked for them: a step that never waits on the host has none
            "device_syncs_per_iteration": summary.get("device_syncs_per_iteration"),
            "device_sync_sites": summary.get("device_sync_sites")}


def synth_data(args) -> tuple[Path, int]:
    """The check's data (made once in --work), and its total row count."""
    data = Path(args.work) / "data"
    if not (data / "meta.json").exists():
        done = run([sys.executable, "-m", "bagpipe.cli", "synth", "--out", str(data), "--rows", str(args.rows),
                    "--max-rows-per-table", str(args.max_rows_per_table), "--seed", "0"], timeout=args.step_timeout)
        if done.returncode:
            raise RuntimeError(f"synth: {done.stderr[-2000:]}")
    return data, sum(json.loads((data / "meta.json").read_text())["table_sizes"])


def compare(args, cases: list[tuple], *, base: str) -> dict:
    """Each case (name, device, mode, cache rows, trainers[, options]) run --repeats times, alternated (a slow
    moment of the machine falls on every case alike); median samples/s against ``base``'s. Options: ``compiled``
    (--compile), ``src`` (another checkout's source, as --before's)."""
    data, total = synth_data(args)
    work = Path(args.work)
    keep = set(filter(None, args.cases.split(","))) if getattr(args, "cases", "") else None
    cases = [case for case in cases if keep is None or case[0] in keep or case[0] == base]
    runs: dict[str, list[dict]] = {name: [] for name, *_ in cases}
    for _ in range(args.repeats):
        for name, device, mode, cache_rows, trainers, *options in cases:
            runs[name].append(train_once(work, data, name, device=device, mode=mode, cache_rows=cache_rows,
                                         args=args, trainers=trainers, **(options[0] if options else {})))
    medians = {name: statistics.median(r["samples_per_s"] for r in results) for name, results in runs.items()}
    lines = [f"| case | ran on | median samples/s | vs {base} | rows to the device / trainer / iteration | stall "
             "| pinned allocations / trainer | device syncs / iteration |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, value in medians.items():
        last = runs[name][-1]
        moved = last["rows_to_device_per_trainer_iteration"]
        stall = last["stall_fraction"]
        pinned = [figures.get("pinned_allocations", 0) for figures in (last["copies_to_device"] or {}).values()]
        syncs = last["device_syncs_per_iteration"]
        syncs = ", ".join(map(str, syncs.values())) if isinstance(syncs, dict) else "" if syncs is None else str(syncs)
        lines.append(f"| {name} | {last['device']} | {value:,.0f} | {value / medians[base]:.2f}x | "
                     f"{'' if moved is None else f'{moved:,.0f}'} | {'' if stall is None else f'{stall:.1%}'} | "
                     f"{', '.join(map(str, pinned))} | {syncs} |")
    return {"rows": total, "batch_size": args.batch_size, "dim": args.dim, "iterations": args.iterations,
            "medians": medians, "table": "\n".join(lines), "runs": runs}


def ratio(medians: dict, case: str, base: str) -> float | None:
    """``case``'s median samples/s over ``base``'s (None where --cases left either out)."""
    return round(medians[case] / medians[base], 3) if case in medians and base in medians else None


def single_against_reference(args) -> dict:
    _, total = synth_data(args)
    result = compare(args, [("reference-cuda", "cuda", "reference", 0, 1),
                            ("single-1%-cuda", "cuda", "single", total // 100, 1),
                            ("single-5%-cuda", "cuda", "single", total // 20, 1),
                            ("reference-cpu", "cpu", "reference", 0, 1),
                            *([("reference-cuda-before", "cuda", "reference", 0, 1, {"src": args.before})]
                              if args.before else [])], base="reference-cuda")
    medians = result["medians"]
    before = {"reference_vs_before": ratio(medians, "reference-cuda", "reference-cuda-before")} if args.before else {}
    return {**result, "single_5%_vs_reference": ratio(medians, "single-5%-cuda", "reference-cuda"),
            **before, "target": "single at 5% >= 0.9x the reference with every table in GPU memory; the reference "
            ">= 3x its samples/s before issue 43 (--before)"}


def bagpipe_against_reference(args) -> dict:
    _, total = synth_data(args)
    result = compare(args, [("reference-cuda", "cuda", "reference", 0, 1),
                            ("bagpipe-1-trainer-cuda", "cuda", "bagpipe", total // 20, 1),
                            ("bagpipe-2-trainers-cuda", "cuda", "bagpipe", total // 20, 2)], base="reference-cuda")
    medians = result["medians"]
    return {**result, "one_trainer_vs_reference": ratio(medians, "bagpipe-1-trainer-cuda", "reference-cuda"),
            "target": "bagpipe with one GPU trainer within 15% of the reference on the GPU (>= 0.85x)"}


def compiled_against_eager(args) -> dict:
    """--compile on the GPU: the reference, --mode single at 5% and one bagpipe trainer with the dense model's loss
    and backward compiled, against the reference uncompiled (alternated; each compiled run's first iteration
    compiles, and the warm-up iterations leave it out of samples/s)."""
    _, total = synth_data(args)
    result = compare(args, [("reference-cuda", "cuda", "reference", 0, 1),
                            ("reference-cuda-compiled", "cuda", "reference", 0, 1, {"compiled": True}),
                            ("single-5%-cuda-compiled", "cuda", "single", total // 20, 1, {"compiled": True}),
                            ("bagpipe-1-trainer-cuda-compiled", "cuda", "bagpipe", total // 20, 1,
                             {"compiled": True})],
                     base="reference-cuda")
    medians = result["medians"]
    return {**result, "compiled_vs_eager": ratio(medians, "reference-cuda-compiled", "reference-cuda"),
            "target": "--compile on by default on a GPU where it pays (config.TrainConfig.compile)"}


# each mode's training loop as py-spy names its frame, and the first and last source lines of its iterations (the
# setup before and the evaluation and model write after are not what an iteration costs)
LOOPS = {"single": ("_train", "bagpipe/train/reference.py", "for iteration, batch in enumerate(batches", "bar.close()"),
         "bagpipe": ("train_loop", "bagpipe/runtime/trainer/loop.py", "while True:",
                     'stats.extra["time_breakdown_ms"]')}


def loop_frames(mode: str) -> tuple[str, range]:
    """The frame prefix of ``mode``'s training loop and the lines of its iterations."""
    function, path, first, last = LOOPS[mode]
    lines = (ROOT / "src" / path).read_text().splitlines()
    start = next(n for n, line in enumerate(lines, 1) if first in line)
    stop = next(n for n, line in enumerate(lines, 1) if n > start and last in line)
    return f"{function} ({path}:", range(start, stop)


def py_spy(args) -> str:
    found = args.py_spy or shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise RuntimeError("py-spy is not installed (make gpu-wheels carries it; or --py-spy PATH)")
    return found


def loop_lines(raw: Path, loop: str, lines: range, *, top: int = 12) -> dict:
    """py-spy's raw samples (``frame;frame;... count``, idle ones included) of the training loop's iterations
    (frame ``loop`` at one of ``lines``), by where they were: the loop's own line, the innermost line of this
    project, and the innermost frame of all; each a share of the iterations' samples (their wall time)."""
    by_loop, by_project, by_leaf = Counter(), Counter(), Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        at = next((i for i, frame in enumerate(frames) if frame.startswith(loop)), None)
        if at is None or not count.isdigit() or int(frames[at].rpartition(":")[2].rstrip(")")) not in lines:
            continue
        count = int(count)
        total += count
        below = frames[at:]
        by_loop[below[0]] += count
        by_project[next(frame for frame in reversed(below) if "(bagpipe/" in frame)] += count
        by_leaf[below[-1]] += count

    def shares(counter: Counter) -> list[tuple[str, float]]:
        return [(frame, round(count / max(total, 1), 4)) for frame, count in counter.most_common(top)]
    return {"samples": total, "loop_lines": shares(by_loop), "project_lines": shares(by_project),
            "innermost": shares(by_leaf)}


def host_profile(args) -> dict:
    """Where the training loop's wall time goes on the host, by line: py-spy samples (idle included: time
    blocked on the device, a queue or a socket counts) of --mode single at 5% and of a one-trainer bagpipe job,
    both on the GPU. A ``.to(device)`` or ``.cpu()`` high on the list is the host waiting for the GPU."""
    spy = py_spy(args)
    data, total = synth_data(args)
    cases = [("single-5%-cuda", "single", total // 20), ("bagpipe-1-trainer-cuda", "bagpipe", total // 20)]
    found, lines = {}, []
    for name, mode, cache_rows in cases:
        raw = Path(args.out) / f"py_spy_{name}.txt"
        command = [spy, "record", "--subprocesses", "--idle", "--rate", "250", "--format", "raw", "-o", str(raw),
                   "--", *train_command(Path(args.work) / f"profile-{name}", data, device="cuda", mode=mode,
                                        cache_rows=cache_rows, args=args)]
        done = run(command, timeout=args.step_timeout)
        if done.returncode or not raw.exists():
            raise RuntimeError(f"py-spy on {name}: exit {done.returncode}: {done.stderr[-2000:]}")
        found[name] = loop_lines(raw, *loop_frames(mode))
        lines += [f"### {name}: {found[name]['samples']} samples of its training loop", ""]
        for title, key in (("the loop's line", "loop_lines"), ("the innermost line of bagpipe", "project_lines"),
                           ("the innermost frame", "innermost")):
            lines += [f"| {title} | share |", "| --- | ---: |"]
            lines += [f"| `{frame}` | {share:.1%} |" for frame, share in found[name][key]]
            lines.append("")
    return {"profiles": found, "table": "\n".join(lines)}


def nn_check(args) -> dict:
    out = Path(args.out) / "gpu_check_nn.json"
    done = run([sys.executable, str(ROOT / "benchmarks" / "gpu_check_nn.py"), "--batches", "100", "--out",
                str(out)], timeout=args.step_timeout)
    if done.returncode:
        raise RuntimeError(f"gpu_check_nn.py exited {done.returncode}: {done.stderr[-2000:]}")
    return {"result": json.loads(out.read_text()) if out.exists() else None, "stdout": done.stdout[-3000:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the report's directory")
    p.add_argument("--work", default="", help="data and run dirs (default OUT/work)")
    p.add_argument("--rows", type=int, default=262_144)
    p.add_argument("--max-rows-per-table", type=int, default=1_000_000)  # 1% of the rows: more than a batch touches
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step-timeout", type=float, default=240.0, help="seconds any one command may take")
    p.add_argument("--skip", default="", help="comma-separated steps to leave out: tests, train, bagpipe, profile, "
                   "nn, compile")
    p.add_argument("--py-spy", default="", help="py-spy's path (default: on PATH or beside this Python)")
    p.add_argument("--before", default="", help="another checkout's src/ (e.g. from before issue 43): its reference "
                   "on the GPU is one more case of the train step, and the report gives today's reference against it")
    p.add_argument("--cases", default="", help="comma-separated cases to run (default all; each step's base "
                   "case always runs), e.g. reference-cuda-before,single-5%%-cuda,bagpipe-1-trainer-cuda")
    p.add_argument("--allow-cpu", action="store_true", help="run without a GPU (to try the script itself)")
    args = p.parse_args(argv)
    args.work = args.work or str(Path(args.out) / "work")
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu-check: no CUDA device here (--allow-cpu to try the script anyway)", file=sys.stderr)
        return 1
    skip = set(filter(None, args.skip.split(",")))
    report = Report(Path(args.out))
    report.step("machine", machine)
    if "tests" not in skip:
        report.step("tests on CUDA", tests, args.step_timeout)
    if "train" not in skip:
        report.step("bagpipe train on CUDA: single against reference", single_against_reference, args)
    if "bagpipe" not in skip:
        report.step("bagpipe train --mode bagpipe, trainers on CUDA, against reference", bagpipe_against_reference,
                    args)
    if "profile" not in skip:
        report.step("where the training loop's time goes on the host (py-spy)", host_profile, args)
    if "nn" not in skip and torch.cuda.is_available():
        report.step("bagpipe.nn against nn.EmbeddingBag", nn_check, args)
    if "compile" not in skip:
        report.step("--compile against the reference uncompiled", compiled_against_eager, args)
    return 0 if all(result["ok"] for result in report.steps.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
