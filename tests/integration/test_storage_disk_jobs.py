"""The disk tier: a store on disk answers every fetch, write-back, snapshot and restore exactly as the
memory tier does, whatever its DRAM cache evicts, and its process holds no more than its budget."""


import json
import subprocess
import sys
import textwrap

import pytest

from helpers.jobs import assert_same_parameters, job_config, reference_of
from helpers.paths import TESTS


def test_a_shard_four_times_its_budget_keeps_the_process_within_it(tmp_path):
    """A fresh process: its resident memory after imports, then its peak while it initialises a shard
    of 5x the budget on disk and fetches and writes back every row of it (a checkpoint read too)."""
    budget = 24 << 20
    script = textwrap.dedent(f"""
        import json, sys
        import numpy as np, torch
        from pathlib import Path
        from bagpipe.optim import make_row_optimizer
        from bagpipe.storage import RowStore, StorageSpec
        from bagpipe.heap import bounded_heap
        from helpers.layouts import layout_of

        def status(field):
            line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))
            return int(line.split()[1]) * 1024

        layout = layout_of([260_000], 64)
        bounded_heap()  # as the server does for the disk tier
        def train(store, steps):
            keys = np.random.default_rng(0).permutation(store.num_rows)
            for version, part in enumerate(np.array_split(keys, steps)):
                rows, state = store.fetch(part, np.full(len(part), -1), timeout=5)
                store.write_back(part, rows + 1, state + 1, version=version)
            store.begin_snapshot(steps, expected_rows=store.num_rows, since=None)
            return sum(len(local) for local, _, _ in store.snapshot_chunks(timeout=5))

        # the same code on a small shard first: libraries loaded, thread pools started
        small = RowStore(layout=layout_of([1000], 64), space=0, optimizer=make_row_optimizer("adagrad", lr=0.1),
                         seed=0, storage=StorageSpec("disk", Path(sys.argv[1]) / "small", 1 << 16))
        train(small, 4)
        small.close()
        before = status("VmRSS:")
        with open("/proc/self/clear_refs", "w") as f:  # peak from here (VmHWM reset)
            f.write("5")
        store = RowStore(layout=layout, space=0, optimizer=make_row_optimizer("adagrad", lr=0.1), seed=0,
                         storage=StorageSpec("disk", Path(sys.argv[1]), {budget}))
        written = train(store, 60)
        shard = store.rows.num_rows * store.rows.record_bytes
        print(json.dumps({{"before": before, "peak": status("VmHWM:"), "shard": shard, "written": written,
                          "stats": store.rows.stats()}}))
        store.close()
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "storage")], capture_output=True, text=True,
                         timeout=300, cwd=TESTS)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["shard"] >= 5 * budget and result["written"] == 260_000
    assert result["stats"]["disk_rows_written"] > 0
    # the cache is within the budget; transients come on top: one initialisation block (65536 x 64 floats,
    # 16 MiB) while the shard is written, a step's arrays (~4 MiB)
    grown = result["peak"] - result["before"]
    assert grown <= budget + (24 << 20), (grown / 2**20, result)


@pytest.mark.parametrize("optimizer", ["adam"])
def test_a_job_on_the_disk_tier_trains_exactly_as_the_reference(small_binary, tmp_path, optimizer):
    """Servers on disk with a DRAM cache of a few rows (most fetches read the file, most write-backs are
    evicted to it), write-backs delayed so that fetches wait on disk too: the export equals the reference's."""
    from bagpipe.rundir import export
    from bagpipe.runtime.launch import launch_local

    config = job_config(small_binary, tmp_path / "bagpipe", optimizer=optimizer, iterations=60, storage="disk",
                        storage_budget_mb=0.01, storage_dir=str(tmp_path / "storage"))
    summary = launch_local(config, show_progress=False, extra_trainer_args=["--writeback-delay", "0.01"])
    assert summary["storage"]["disk_rows_read"] > 0 and summary["storage"]["disk_rows_written"] > 0
    assert summary["server_fetches_waited"] > 0
    assert not list((tmp_path / "storage").iterdir())  # the servers' working files are gone
    assert_same_parameters(export(config.run_dir, tmp_path / "ours.pt"), reference_of(config, tmp_path / "reference"))
