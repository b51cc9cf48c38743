"""How long a job stalls after a data server's loss, iteration by iteration.

    .venv/bin/python benchmarks/bench_failover.py [--fault "server1@write-back 20:kill"] [--iterations 400]
        [--work-dir DIR]

The tests' job (tests/integration/test_replacement_jobs.py: DLRM on a small synthetic Criteo-shaped set, Adagrad,
2 trainers, `--servers 4 --parity 3`, lookahead 20, `--writeback-delay 0.01`), metrics logged every iteration, a data server
SIGKILLed by the fault. Prints every gap of more than 0.2 s between two logged iterations, in seconds from the
loss, the metrics events (server lost, server back) and the job's wall time. Run it from a checkout, or with
PYTHONPATH at another tree's src/ to compare two commits on the same data.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bagpipe.config import ModelConfig, TrainConfig
from bagpipe.data.preprocess import preprocess
from bagpipe.runtime.launch import launch_local
from bagpipe.synth import generate, resolve_table_sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", default="server1@write-back 20:kill")
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--work-dir", default=None, help="data and run dir (default: a new temporary dir)")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_failover_"))
    data = work / "small_bin"
    if not (data / "meta.json").exists():
        sizes = resolve_table_sizes(tables=None, table_sizes=None, max_rows_per_table=40)
        generate(work / "small_tsv", rows=40_000, test_rows=10_000, seed=3, table_sizes=sizes, show_progress=False)
        preprocess(work / "small_tsv", data, show_progress=False)
    run = work / "run"
    config = TrainConfig(data=str(data), run_dir=str(run), mode="bagpipe", iterations=args.iterations, batch_size=128,
                         optimizer="adagrad", lr=0.05, seed=5, trainers=2, servers=4, parity=3, check_parity=True,
                         cache_rows=700, lookahead=20, timeout=20.0, warmup_iterations=2, log_every=1,
                         max_eval_rows=2000, model=ModelConfig(emb_dim=8, arch_mlp_bot="13-16-8",
                                                               arch_mlp_top="16-1"))
    summary = launch_local(config, show_progress=False, overwrite=True,
                           env={"BAGPIPE_FAULTS": args.fault},
                           extra_trainer_args=["--writeback-delay", "0.01"])
    lost_at = summary["failures"][0]["at"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    previous = None
    for record in records:
        if "event" in record:
            print(f"{record['time'] - lost_at:7.2f} s  {record['event']}")
        elif previous is not None and record["time"] - previous["time"] > 0.2:
            print(f"{previous['time'] - lost_at:7.2f} s  gap of {record['time'] - previous['time']:.2f} s before "
                  f"iteration {record['iteration']}")
        if "event" not in record:
            previous = record
    print(f"train_s {summary['train_s']:.1f}; failures {json.dumps(summary['failures'])}", file=sys.stderr)


if __name__ == "__main__":
    main()
