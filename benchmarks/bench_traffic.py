"""What one trainer moves per iteration with a replicated and with a partitioned cache (issue 26).

    .venv/bin/python benchmarks/bench_traffic.py [--work-dir DIR] [--trainers 8] [--keep-within 0] [--quick]

Synthetic data over the Criteo Kaggle cardinalities (26 tables, 33.8M rows), Zipf ids (exponents 1.05 and 1.2),
50 global batches of 16,384 (``--quick``: 8 batches); caches of 500,000 rows per trainer, lookahead 50, width 16,
SGD; ``--keep-within N``: the partitioned plan's keepers and joins (``bagpipe train --keep-within``, default 4 there;
0 here, the first published table). For each exponent, ``plan-stats``' traffic (planner/stats.traffic): rows fetched, written back and
synchronised and bytes per trainer per iteration in both designs, and their ratios, printed as the markdown table
of docs/history/benchmarks.md; the raw figures go to WORK_DIR/traffic.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bagpipe.data.binary import open_dataset
from bagpipe.data.preprocess import preprocess
from bagpipe.planner.stats import traffic
from bagpipe.synth import CRITEO_KAGGLE_TABLE_SIZES, generate

BATCH, CACHE_ROWS, LOOKAHEAD = 16_384, 500_000, 50
EXPONENTS = (1.05, 1.2)
ROWS = {"rows_fetched_per_iteration": "rows fetched", "rows_written_back_per_iteration": "rows written back",
        "rows_exchanged_per_iteration": "distinct rows exchanged",
        "rows_synchronised_per_iteration": "row gradients sent", "bytes_per_iteration": "bytes sent"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--trainers", type=int, default=8)
    parser.add_argument("--keep-within", type=int, default=0, help="the partitioned plan's --keep-within (default 0)")
    parser.add_argument("--quick", action="store_true", help="8 global batches instead of 50")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_traffic_"))
    batches = 8 if args.quick else 50
    results = {}
    for exponent in EXPONENTS:
        data = work / f"bin{exponent}"
        if not (data / "meta.json").is_file():
            generate(work / f"tsv{exponent}", rows=BATCH * batches, test_rows=BATCH, seed=0,
                     table_sizes=list(CRITEO_KAGGLE_TABLE_SIZES), zipf=exponent)
            preprocess(work / f"tsv{exponent}", data)
        results[exponent] = traffic(open_dataset(data).train, batch_size=BATCH, cache_rows=CACHE_ROWS,
                                    lookahead=LOOKAHEAD, trainers=args.trainers, iterations=batches,
                                    keep_within=args.keep_within)
        print(json.dumps({"zipf": exponent, **results[exponent]}), flush=True)
    (work / "traffic.json").write_text(json.dumps({str(z): r for z, r in results.items()}, indent=1))
    header = " | ".join(f"Zipf {z} replicated | partitioned | ratio" for z in EXPONENTS)
    print(f"\n| per trainer per iteration | {header} |")
    print("| --- |" + " ---: | ---: | ---: |" * len(EXPONENTS))
    for key, name in ROWS.items():
        cells = []
        for exponent in EXPONENTS:
            result = results[exponent]
            cells += [f"{result['replicated'][key]:,.0f}", f"{result['partitioned'][key]:,.0f}",
                      f"{result['partitioned_vs_replicated'][key]:.2f}x"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
