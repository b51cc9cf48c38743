"""What erasure-coded servers cost: samples/s of the same job with a parity server and without one.

    .venv/bin/python benchmarks/bench_parity.py [--repeats 3] [--iterations 600] [--parity 3]
        [--recovery] [--restart] [--replacement] [--trainer-replacement] [--oracle-replacement] [--no-overhead]
        [--out runs/bench_parity/result.json] [--work-dir DIR]

One `--mode bagpipe` job (DLRM, Adagrad, 2 trainers, a 5% cache per trainer) on Zipf 1.2 data (bench_scaling's:
the Criteo Kaggle tables capped at 100k rows, 840,543 rows), its rows on --parity data servers, run without
parity and with `--servers parity+1 --parity K` (one parity server holding the XOR of the K shards' rows and
optimizer state; every write-back's delta goes to it and is acknowledged once folded in), the two interleaved in
every repeat; medians of the steady-state samples/s and their ratio (and each repeat's), the parity server's CPU
time per iteration and peak RSS against a data server's, and the deltas it folded in. The last repeat with parity
also checks the parity against its group at the end (--check-parity, after the timed iterations).

Recovery (--recovery, one more run with parity, metrics every 10 iterations): data server 1 is SIGKILLed when it
receives the write-back of iteration --iterations / 2 (BAGPIPE_FAULTS); the job goes on with its shard served by
the parity server while the launcher starts a replacement, which copies the shard from it and takes it back. From
metrics.jsonl and summary.json: samples/s of the windows before the loss, of the windows while the shard was being
rebuilt (and the 100 iterations after the move), the time the loss cost (the window around it, against a median
window), how long moving the shard took, and the rebuild's time per million rows; and, once replaced, the seconds
from the loss to the replacement joined and to the shard taken back, its copy per million rows, the handover's
seconds (the stand-in frozen to the route moved back) and the samples/s from the loss to the shard taken back.

Replacement (--replacement, one more run with parity, metrics every 10): the parity server is SIGKILLed when it
receives a delta of iteration --iterations / 2; the launcher starts a replacement, the RPC world is re-formed
around it and it makes the parity from its group while training goes on. From metrics.jsonl and summary.json:
samples/s of the windows before the loss, while the replacement starts (loss to joined), while it makes the parity
(joined to whole) and after; the seconds from the loss to the replacement joined and to its parity whole; the
re-formation's seconds; the time the loss cost (the slowest window around it against a median window); and how long
making the parity took per million rows of the group.

Restart (--restart, one more run with parity and a checkpoint every --checkpoint-every iterations, metrics every
10): trainer 1 (which parity does not cover) is SIGKILLed a third of the way between two checkpoints past the
middle; the local launcher stops the job and starts it again from the newest checkpoint. From summary.json's
"restarts": the seconds from the death to every role stopped, to training resumed (trainer 0's first iteration)
and to the iteration reached before the death, the iterations trained again, against the median time of an
iteration before the death.

Trainer replacement (--trainer-replacement, one more run with parity, metrics every 10 iterations,
replace_trainers on, the default): trainer 1 is SIGKILLed after iteration --iterations / 2; trainer 0 waits in its gradient
sum while the launcher starts a replacement, which joins the re-formed RPC world and trainers' group, adds its shares
to the sums that failed and takes trainer 0's state at its next boundary. From summary.json's "failures" and
metrics.jsonl: the seconds from the death to the replacement joined and to training resumed (its state taken over),
the sums done again, samples/s of the windows before the death, of those from the death to training resumed, and of
the 100 iterations after, and the time the loss cost (the slowest window around it against a median window).

Oracle replacement (--oracle-replacement, two more runs with parity, a checkpoint every --checkpoint-every
iterations, metrics every 10): the oracle is SIGKILLed while it plans iteration --iterations / 2. In the first the
launcher starts a replacement, which re-forms the RPC world, plans again from the start and serves the plans the
trainers lack; from summary.json's "failures" and metrics.jsonl, the same figures as for a trainer's replacement
(death to joined, death to training resumed: the first new plan served) and the planning done again. The second
runs with replace_oracle off (--no-replace-oracle): the launcher restarts the job from its newest checkpoint, and its "restarts"
record gives the death to training resumed there, in the same invocation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

from bench_checkpoint import MODEL, TOTAL_ROWS
from bench_models import cpu_snapshot
from bench_reference import _foreign_fraction
from bench_scaling import BATCH, data_set

from bagpipe.config import TrainConfig
from bagpipe.runtime.launch import launch_local


def job(data: Path, run_dir: Path, *, iterations: int, data_servers: int, parity: int, check: bool) -> TrainConfig:
    return TrainConfig(data=str(data), run_dir=str(run_dir), mode="bagpipe", iterations=iterations, batch_size=BATCH,
                       optimizer="adagrad", lr=0.01, seed=0, warmup_iterations=20, log_every=50, max_eval_rows=2048,
                       trainers=2, servers=data_servers + (data_servers // parity if parity else 0), parity=parity,
                       check_parity=check, cache_rows=TOTAL_ROWS // 20, timeout=120.0, model=MODEL)


def recovery(data: Path, work: Path, args) -> dict:
    kill_at = args.iterations // 2
    config = dataclasses.replace(job(data, work / "recovery", iterations=args.iterations, data_servers=args.parity,
                                     parity=args.parity, check=True), log_every=10)
    summary = launch_local(config, show_progress=False, overwrite=True,
                           env={"BAGPIPE_FAULTS": f"server1@write-back {kill_at}:kill"})
    windows = [record for record in map(json.loads, (work / "recovery" / "metrics.jsonl").read_text().splitlines())
               if "window_samples_per_s" in record]
    (failure,) = summary["failures"]
    parity = summary["parity"][0]
    standing_in = parity.get("standing_in") or parity["handed_back"][0]  # handed back once replaced
    moved_at, rebuilt_at = failure["at"], failure["at"] + standing_in["rebuilt_after_s"]
    durations = [b["time"] - a["time"] for a, b in zip(windows, windows[1:])]
    hit = next(i for i, w in enumerate(windows) if w["iteration"] > kill_at)  # the window the loss fell in
    before = [w["window_samples_per_s"] for w in windows[2:hit - 1]]  # past warm-up, before the loss
    during = [w["window_samples_per_s"] for w in windows if moved_at < w["time"] <= rebuilt_at]
    after = [w["window_samples_per_s"] for w in windows[hit + 1:hit + 11]]
    normal = statistics.median(durations)
    result = {"kill_at_iteration": kill_at, "failure": failure, "standing_in": standing_in,
              "samples_per_s_before": statistics.median(before),
              "samples_per_s_while_rebuilding": statistics.median(during) if during else None,
              "windows_while_rebuilding": len(during),
              "samples_per_s_100_iterations_after": statistics.median(after),
              "ratio_after_to_before": statistics.median(after) / statistics.median(before),
              "loss_cost_s": max(durations[hit - 2:hit + 8]) - normal,  # the slowest window around the loss
              "window_durations_around_loss_s": [round(d, 3) for d in durations[hit - 2:hit + 8]],
              "median_window_s": normal,
              "rebuild_s_per_million_rows": 1e6 * standing_in["rebuilt_after_s"] / standing_in["rows"],
              "parity_check": parity["check"]}
    if failure.get("replaced"):  # a replacement process copied the shard from the stand-in and took it back
        taken_back_at = failure["at"] + failure["recovered_in_s"]
        until = [w["window_samples_per_s"] for w in windows if moved_at < w["time"] <= taken_back_at]
        back = [w["window_samples_per_s"] for w in windows if w["time"] > taken_back_at][:10]
        result.update({
            "joined_in_s": failure["joined_in_s"], "taken_back_in_s": failure["recovered_in_s"],
            "copied_in_s": failure["copied_in_s"], "handover_s": failure["handover_s"],
            "rows_copied": failure["rows_copied"], "rows_copied_again": failure["rows_copied_again"],
            "copy_s_per_million_rows": 1e6 * failure["copied_in_s"] / failure["rows_copied"],
            "samples_per_s_until_taken_back": statistics.median(until) if until else None,
            "windows_until_taken_back": len(until),
            "ratio_until_taken_back_to_before": statistics.median(until) / statistics.median(before) if until
            else None,
            "samples_per_s_100_iterations_after_taken_back": statistics.median(back) if back else None})
    return result


def replacement(data: Path, work: Path, args) -> dict:
    kill_at = args.iterations // 2
    config = dataclasses.replace(job(data, work / "replacement", iterations=args.iterations,
                                     data_servers=args.parity, parity=args.parity, check=True), log_every=10)
    summary = launch_local(config, show_progress=False, overwrite=True,
                           env={"BAGPIPE_FAULTS": f"server{args.parity}@delta {kill_at}:kill"})
    windows = [record for record in map(json.loads, (work / "replacement" / "metrics.jsonl").read_text().splitlines())
               if "window_samples_per_s" in record]
    (failure,) = summary["failures"]
    lost_at = failure["at"]
    joined_at, recovered_at = lost_at + failure["joined_in_s"], lost_at + failure["recovered_in_s"]
    durations = [b["time"] - a["time"] for a, b in zip(windows, windows[1:])]
    hit = next(i for i, w in enumerate(windows) if w["time"] > lost_at)  # the window the loss fell in
    before = [w["window_samples_per_s"] for w in windows[2:hit - 1]]  # past warm-up, before the loss
    starting = [w["window_samples_per_s"] for w in windows if lost_at < w["time"] <= joined_at]
    making = [w["window_samples_per_s"] for w in windows if joined_at < w["time"] <= recovered_at]
    after = [w["window_samples_per_s"] for w in windows if w["time"] > recovered_at][:10]
    rows = TOTAL_ROWS
    median = statistics.median
    return {"kill_at_iteration": kill_at, "failure": failure, "epochs": summary["epochs"],
            "unprotected_write_backs": summary["unprotected_write_backs"],
            "samples_per_s_before": median(before),
            "samples_per_s_while_the_replacement_starts": median(starting) if starting else None,
            "windows_while_the_replacement_starts": len(starting),
            "samples_per_s_while_the_parity_is_made": median(making) if making else None,
            "windows_while_the_parity_is_made": len(making),
            "samples_per_s_100_iterations_after": median(after) if after else None,
            "ratio_during_to_before": median(starting + making) / median(before) if starting + making else None,
            "loss_cost_s": max(durations[hit - 2:hit + 8]) - median(durations),  # the slowest window around it
            "window_durations_around_loss_s": [round(d, 3) for d in durations[hit - 2:hit + 8]],
            "median_window_s": median(durations),
            "made_s_per_million_rows": 1e6 * failure["made_in_s"] / rows,
            "parity_check": summary["parity"][0]["check"], "samples_per_s": summary["samples_per_s"]}


def restart(data: Path, work: Path, args) -> dict:
    every = args.checkpoint_every
    kill_at = (args.iterations // 2 // every) * every + every // 3
    config = dataclasses.replace(job(data, work / "restart", iterations=args.iterations, data_servers=args.parity,
                                     parity=args.parity, check=False), log_every=10, checkpoint_every=every)
    summary = launch_local(config, show_progress=False, overwrite=True,
                           env={"BAGPIPE_FAULTS": f"trainer1@iteration {kill_at}:kill"})
    (record,) = summary["restarts"]
    windows = [w for w in map(json.loads, (work / "restart" / "metrics.jsonl").read_text().splitlines())
               if "window_samples_per_s" in w and w["time"] < record["failed_at"]]
    seconds_per_iteration = statistics.median(BATCH / w["window_samples_per_s"] for w in windows[2:])
    return {"kill_at_iteration": kill_at, "checkpoint_every": every, "restart": record,
            "median_iteration_s_before": seconds_per_iteration,
            # the restart's cost in iterations' time: from the death until back where the job was
            "caught_up_in_iterations": record["caught_up_in_s"] / seconds_per_iteration,
            "samples_per_s": summary["samples_per_s"]}


def trainer_replacement(data: Path, work: Path, args) -> dict:
    kill_at = args.iterations // 2
    config = dataclasses.replace(job(data, work / "trainer_replacement", iterations=args.iterations,
                                     data_servers=args.parity, parity=args.parity, check=False), log_every=10)
    summary = launch_local(config, show_progress=False, overwrite=True,
                           env={"BAGPIPE_FAULTS": f"trainer1@iteration {kill_at}:kill"})
    assert "restarts" not in summary, "the job was restarted, not the trainer replaced"
    (failure,) = summary["failures"]
    return {"kill_at_iteration": kill_at, "sums_done_again": failure["sums_again"],
            **_replaced(work / "trainer_replacement", summary)}


def oracle_replacement(data: Path, work: Path, args) -> dict:
    kill_at = args.iterations // 2
    runs = {}
    for name, replace in (("oracle_replacement", True), ("oracle_restart", False)):
        config = dataclasses.replace(job(data, work / name, iterations=args.iterations, data_servers=args.parity,
                                         parity=args.parity, check=False), log_every=10,
                                     checkpoint_every=args.checkpoint_every, replace_oracle=replace)
        runs[name] = launch_local(config, show_progress=False, overwrite=True,
                                  env={"BAGPIPE_FAULTS": f"oracle@planned {kill_at}:kill"})
    replaced, restarted = runs["oracle_replacement"], runs["oracle_restart"]
    assert "restarts" not in replaced and len(restarted["restarts"]) == 1
    (failure,) = replaced["failures"]
    (restart,) = restarted["restarts"]
    return {"kill_at_iteration": kill_at, **_replaced(work / "oracle_replacement", replaced),
            "replay_s": failure["replay_s"], "replayed_iterations": failure["replayed_iterations"],
            "restart": restart, "restart_death_to_training_resumed_s": restart["resumed_in_s"],
            "replaced_to_restarted": failure["recovered_in_s"] / restart["resumed_in_s"]}


def _replaced(run: Path, summary: dict) -> dict:
    """The figures of a run that lost one process and replaced it (``summary``'s only failure): seconds from the
    death to the replacement joined and to training resumed, and samples/s of the metrics windows before the death,
    until resumed and of the 100 iterations after, with the time the loss cost (the slowest window around it against
    a median window)."""
    windows = [w for w in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if "window_samples_per_s" in w]
    (failure,) = summary["failures"]
    lost_at, resumed_at = failure["at"], failure["at"] + failure["recovered_in_s"]
    durations = [b["time"] - a["time"] for a, b in zip(windows, windows[1:])]
    hit = next(i for i, w in enumerate(windows) if w["time"] > lost_at)  # the window the loss fell in
    before = [w["window_samples_per_s"] for w in windows[2:hit - 1]]  # past warm-up, before the loss
    during = [w["window_samples_per_s"] for w in windows if lost_at < w["time"] <= resumed_at + 1e-9]
    after = [w["window_samples_per_s"] for w in windows if w["time"] > resumed_at][1:11]  # past the loss's window
    median = statistics.median
    return {"failure": failure, "epochs": summary["epochs"],
            "death_to_replacement_joined_s": failure["joined_in_s"],
            "death_to_training_resumed_s": failure["recovered_in_s"],
            "samples_per_s_before": median(before), "windows_until_resumed": len(during),
            "samples_per_s_100_iterations_after": median(after) if after else None,
            "ratio_after_to_before": median(after) / median(before) if after else None,
            "loss_cost_s": max(durations[hit - 2:hit + 8]) - median(durations),
            "window_durations_around_loss_s": [round(d, 3) for d in durations[hit - 2:hit + 8]],
            "median_window_s": median(durations), "samples_per_s": summary["samples_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default=None, help="data and run dirs (default: a new temporary dir)")
    parser.add_argument("--out", default="runs/bench_parity/result.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=600)
    parser.add_argument("--parity", type=int, default=3, help="data servers, all in one parity group")
    parser.add_argument("--recovery", action="store_true", help="also: a run that loses data server 1 midway")
    parser.add_argument("--restart", action="store_true", help="also: a run that loses trainer 1 midway and is "
                        "started again from its newest checkpoint")
    parser.add_argument("--replacement", action="store_true", help="also: a run that loses its parity server "
                        "midway, replaced while training goes on")
    parser.add_argument("--trainer-replacement", action="store_true", help="also: a run that loses trainer 1 midway, "
                        "replaced while the other waits")
    parser.add_argument("--oracle-replacement", action="store_true", help="also: a run that loses the oracle "
                        "midway, replaced while the others wait, and one restarted from its checkpoint instead")
    parser.add_argument("--checkpoint-every", type=int, default=100,
                        help="--restart, --oracle-replacement: the runs' checkpoint interval")
    parser.add_argument("--no-overhead", action="store_true", help="skip the runs with and without parity")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_parity_"))
    data = data_set(work, zipf=1.2, iterations=args.iterations)
    kinds = {"none": 0, "parity": args.parity}
    samples: dict[str, list[float]] = {kind: [] for kind in kinds}
    server_cpu: dict[str, list[float]] = {"data server": [], "parity server": []}  # CPU ms per iteration
    server_rss: dict[str, list[float]] = {"data server": [], "parity server": []}  # MiB
    parity_stats, foreign = [], []
    extras = {name: measure for name, measure in (("recovery", recovery), ("restart", restart),
                                                  ("replacement", replacement),
                                                  ("trainer_replacement", trainer_replacement),
                                                  ("oracle_replacement", oracle_replacement)) if getattr(args, name)}
    if args.no_overhead:
        result = {"settings": vars(args), **{name: measure(data, work, args) for name, measure in extras.items()}}
        write(args.out, result)
        print(json.dumps({name: result[name] for name in extras}, indent=1))
        return
    for repeat in range(args.repeats):
        for kind, parity in kinds.items():
            check = parity > 0 and repeat == args.repeats - 1
            config = job(data, work / kind, iterations=args.iterations, data_servers=args.parity, parity=parity,
                         check=check)
            before = cpu_snapshot()
            summary = launch_local(config, show_progress=False, overwrite=True)
            foreign.append(_foreign_fraction(before, cpu_snapshot()) or 0.0)
            samples[kind].append(summary["samples_per_s"])
            if parity:
                parity_stats.append(summary["parity"][0])
                for role, name in (("data server", "server0"), ("parity server", f"server{args.parity}")):
                    server_cpu[role].append(1e3 * summary["cpu_s"][name] / args.iterations)
                    server_rss[role].append(summary["peak_rss_bytes"][name] / 2**20)
            print(json.dumps({"kind": kind, "repeat": repeat, "samples_per_s": summary["samples_per_s"],
                              **({"parity": summary["parity"]} if parity else {})}), flush=True)
    medians = {kind: statistics.median(values) for kind, values in samples.items()}
    result = {"settings": vars(args), "samples_per_s": samples, "medians": medians,
              "ratio_parity_to_none": medians["parity"] / medians["none"],
              "pairwise_ratios": [p / n for n, p in zip(samples["none"], samples["parity"])],
              "server_cpu_ms_per_iteration": {role: statistics.median(v) for role, v in server_cpu.items()},
              "server_peak_rss_mb": {role: statistics.median(v) for role, v in server_rss.items()},
              "parity": parity_stats[-1], "other_cpu_median": statistics.median(foreign)}
    for name, measure in extras.items():
        result[name] = measure(data, work, args)
    write(args.out, result)
    print(f"no parity {medians['none']:,.0f} samples/s, --parity {args.parity} {medians['parity']:,.0f} samples/s "
          f"({result['ratio_parity_to_none']:.3f}x; pairwise {[round(r, 3) for r in result['pairwise_ratios']]}); "
          f"CPU ms per iteration {result['server_cpu_ms_per_iteration']}, peak RSS MiB {result['server_peak_rss_mb']}; "
          f"parity {parity_stats[-1]}; other CPU {result['other_cpu_median']:.1%}")
    print(f"wrote {args.out}")


def write(path: str, result: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
