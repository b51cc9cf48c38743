"""The partitioned oracle's own work per iteration, in one process: the plan (``plan_partitioned_spaces``) and each
trainer's messages (``protocol.part_messages``), CPU time of each, on bench_peers' data and shape.

    .venv/bin/python benchmarks/bench_partitioned_oracle.py [--iterations 120] [--work-dir DIR]
    PYTHONPATH=OTHER/src .venv/bin/python benchmarks/bench_partitioned_oracle.py ...   # another checkout's code

26 tables x 100,000 rows (bench_peers.make_data, made once in --work-dir), global batch 2,048 over 2 trainers, each
caching 260,000 rows (10%), lookahead 200, --keep-within 4. The batches are read and split into key matrices
before the clock starts, as the oracle's reader does apart from planning; the first 20 iterations are left out.
Code from before ``plan_partitioned(..., inverse=True)`` (which placed ids by a search per trainer and space) is
timed the way it ran then, so one command compares two checkouts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_peers import BATCH, make_data  # noqa: E402

import bagpipe.runtime.protocol as protocol  # noqa: E402
from bagpipe.config import ModelConfig  # noqa: E402
from bagpipe.data.batches import read_batch  # noqa: E402
from bagpipe.data.binary import open_dataset  # noqa: E402
from bagpipe.embeddings import EmbeddingLayout, valid_keys  # noqa: E402
from bagpipe.models import model_tables  # noqa: E402
from bagpipe.planner import PlannerConfig  # noqa: E402
from bagpipe.planner.partitioned import plan_partitioned_spaces  # noqa: E402

TRAINERS, CACHE_ROWS, LOOKAHEAD, KEEP_WITHIN, WARMUP = 2, 260_000, 200, 4, 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=120)
    parser.add_argument("--work-dir", default=None, help="where the data is made (once) and kept")
    args = parser.parse_args()
    if args.iterations <= WARMUP:
        parser.error(f"--iterations must be over the {WARMUP} left out")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_partitioned_oracle_"))
    data = open_dataset(make_data(work, iterations=args.iterations))
    layout = EmbeddingLayout(model_tables(ModelConfig(emb_dim=16), data.schema), data.schema)
    batches = [read_batch(data.train, slice(i * BATCH, (i + 1) * BATCH)) for i in range(args.iterations)]
    parts = [[layout.keys(part.ids.numpy()) for part in batch.slices(TRAINERS)] for batch in batches]
    slices = [[[valid_keys(part[s]) for part in trainer_parts] for s in range(len(layout.spaces))]
              for trainer_parts in parts]
    configs = [PlannerConfig(num_rows=space.num_rows, cache_rows=CACHE_ROWS, lookahead=LOOKAHEAD,
                             num_trainers=TRAINERS, keep_within=KEEP_WITHIN) for space in layout.spaces]
    placed = "inverse" in plan_partitioned_spaces.__code__.co_varnames  # (this checkout's plan places ids)
    steps_of = plan_partitioned_spaces(iter(slices), configs, **({"inverse": True} if placed else {}))
    plan_s = messages_s = 0.0
    for i in range(args.iterations):
        started = time.thread_time()
        steps = next(steps_of)
        planned = time.thread_time()
        protocol.part_messages(i, steps, batches[i], parts[i] if placed else layout)
        if i >= WARMUP:
            plan_s += planned - started
            messages_s += time.thread_time() - planned
    timed = args.iterations - WARMUP
    print(f"{'ids placed by the plan' if placed else 'ids placed by a search'}: plan {1e3 * plan_s / timed:.2f} ms "
          f"an iteration, messages {1e3 * messages_s / timed:.2f} ms, together {1e3 * (plan_s + messages_s) / timed:.2f} "
          f"ms ({timed} iterations after {WARMUP})")


if __name__ == "__main__":
    main()
