"""The network failing under a job across hosts: every scenario of bagpipe.hostjobs.SCENARIOS (links down shorter and
longer than the liveness window, packet loss, whole hosts lost, a partition), each on fresh hosts (bagpipe.hosts:
network namespaces joined by a bridge), each checked bit for bit against the one-process reference.

    sudo .venv/bin/python benchmarks/network_faults.py [--only NAME [--only NAME ...]] [--repeats 1] [--out FILE.jsonl]

Prints one Markdown row per scenario: its outcome ("exact": the job ended by itself, bit for bit the reference;
"failed, resumed exact": it ended with an error naming the loss and `bagpipe train --resume` from its newest
checkpoint ended bit for bit), whether that is the outcome the scenario must give, the time to recover
(summary.json's failures: the longest recovered_in_s or joined_in_s), the seconds the job took beyond the unfaulted
one (with a resume, both runs: bounded by the liveness window, 3 s, plus --timeout, 20 s, plus the fault's own
length and a restart), the job's wall time and steady-state samples/s against the unfaulted job's, measured in the
same run (its median of runs before and after the scenarios), and the roles the operator started again. Delay is made by a relay of the project's own on the host's link
(bagpipe.hosts.Hosts.delay: frames held 50 +- 20 ms, in order in each direction), as this kernel has no netem.

Needs root and iproute2 (packet loss and partitions also iptables, delay ethtool: those scenarios are skipped,
saying so, without them); says so and exits 0 where namespaces cannot be made.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bagpipe import hosts as hosts_module
from bagpipe.config import config_from_dict
from bagpipe.data.preprocess import preprocess
from bagpipe.hostjobs import SCENARIOS, Outcome, run_scenario
from bagpipe.rundir import export
from bagpipe.synth import generate, resolve_table_sizes
from bagpipe.train.reference import train_reference


def small_data(work: Path) -> Path:
    """tests/conftest.py's small data: Criteo's 26 tables capped at 40 rows, 40k train rows."""
    out = work / "data"
    if not (out / "train").exists():
        sizes = resolve_table_sizes(tables=None, table_sizes=None, max_rows_per_table=40)
        generate(work / "tsv", rows=40_000, test_rows=10_000, seed=3, table_sizes=sizes, show_progress=False)
        preprocess(work / "tsv", out, show_progress=False)
    return out


def reference_checker(work: Path, data: Path):
    """``same_as(run_dir)``: the run's model bit for bit the reference's for its config (trained here, as each role
    computes: the trainers' slices, one thread)."""
    def same_as(run_dir: Path) -> bool:
        config = config_from_dict(json.loads((run_dir / "config.json").read_text()))
        reference_dir = Path(tempfile.mkdtemp(dir=work, prefix="reference-"))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            train_reference(dataclasses.replace(config, mode="reference", data=str(data), run_dir=str(reference_dir),
                                                slices=config.trainers), show_progress=False, overwrite=True)
        finally:
            torch.set_num_threads(threads)
        ours, theirs = export(run_dir, run_dir.parent / "export.pt"), export(reference_dir, reference_dir / "e.pt")
        shutil.rmtree(reference_dir, ignore_errors=True)
        return (ours["dense"].keys() == theirs["dense"].keys()
                and all(torch.equal(ours["dense"][k], theirs["dense"][k]) for k in ours["dense"])
                and all(torch.equal(a, b) for a, b in zip(ours["embeddings"], theirs["embeddings"], strict=True)))
    return same_as


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="a scenario's name; repeated for several "
                        "(default: every one)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each scenario")
    parser.add_argument("--work-dir", default=None, help="where the data and runs go (default: a temporary dir)")
    parser.add_argument("--out", default=None, help="append each run's record to this JSONL file")
    args = parser.parse_args()
    # SIGTERM ends it as Ctrl-C does: through the hosts' clean-up (a run killed outright leaves namespaces that the
    # next one to make hosts sweeps)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ok, why = hosts_module.available()
    if not ok:
        print(f"network_faults: cannot make hosts here ({why}); nothing run")
        return 0
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only]
    unknown = set(args.only) - {s.name for s in SCENARIOS}
    if unknown:
        parser.error(f"no scenario {sorted(unknown)}; there are: {[s.name for s in SCENARIOS]}")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="network-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    data = small_data(work)
    same_as = reference_checker(work, data)

    def run(item, index: int) -> Outcome:
        cwd = work / f"run-{index}"
        shutil.rmtree(cwd, ignore_errors=True)
        cwd.mkdir()
        started = time.monotonic()
        try:
            outcome = run_scenario(item, data=data, cwd=cwd, same_as=same_as)
        except Exception as err:  # a scenario that went wrong is a row that fails, not the end of the table
            outcome = Outcome(item.name if item else "no fault", f"error: {err}", False, time.monotonic() - started,
                              None, None, 0, detail=str(err))
        print(f"  {outcome.scenario}: {outcome.outcome} ({time.monotonic() - started:.0f} s)"
              + (f" {outcome.detail[:300]}" if not outcome.passed else ""), file=sys.stderr, flush=True)
        if args.out:
            with open(args.out, "a") as out:
                out.write(json.dumps(dataclasses.asdict(outcome)) + "\n")
        return outcome

    counter = iter(range(10_000))
    baseline = [run(None, next(counter))]
    results: dict[str, list[Outcome]] = {}
    for item in chosen:
        if item.needs and shutil.which(item.needs) is None:
            print(f"  {item.name}: skipped (needs {item.needs}: apt-get install {item.needs})", file=sys.stderr)
            continue
        results[item.name] = [run(item, next(counter)) for _ in range(args.repeats)]
    baseline.append(run(None, next(counter)))
    base_wall = statistics.median(b.wall_s for b in baseline)
    base_rate = statistics.median(b.samples_per_s for b in baseline if b.samples_per_s)
    print(f"\nunfaulted job: {base_wall:.1f} s wall, {base_rate:,.0f} samples/s (medians of {len(baseline)}; "
          f"{'exact' if all(b.passed for b in baseline) else 'NOT exact'})\n")
    print("| scenario | outcome | as it must | recovered in (s) | s past the unfaulted job | wall vs unfaulted "
          "| samples/s vs unfaulted | started again |")
    print("|---|---|---|---|---|---|---|---|")
    failed = 0
    for item in chosen:
        if item.name not in results:
            continue
        runs = results[item.name]
        passed = all(r.passed for r in runs)
        failed += not passed
        recovered = [r.recovered_s for r in runs if r.recovered_s is not None]
        rates = [r.samples_per_s for r in runs if r.samples_per_s and r.outcome == "exact"]  # (a resume's: not the job's)
        recovered_text = f"{statistics.median(recovered):.1f}" if recovered else "-"
        rate_text = f"{statistics.median(rates) / base_rate:.2f}x" if rates else "-"
        wall = statistics.median(r.wall_s for r in runs)
        print(f"| {item.name} | {runs[0].outcome} | {'yes' if passed else 'NO'} | {recovered_text} | "
              f"{wall - base_wall:.1f} | {wall / base_wall:.2f}x | {rate_text} | "
              f"{statistics.median(r.restarts for r in runs):.0f} |")
    return 1 if failed or not all(b.passed for b in baseline) else 0


if __name__ == "__main__":
    sys.exit(main())
