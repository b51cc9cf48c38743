"""bagpipe.nn's modules with their full tables on disk (storage="disk": storage.DiskRows behind a DRAM budget):
the same training as nn.EmbeddingBag bit for bit, whatever the device cache and the DRAM cache evict, and a
process that holds the caches, not the table."""


import json
import subprocess
import sys
import textwrap


def test_a_table_on_disk_many_times_the_budget_keeps_the_process_within_it(tmp_path):
    """A fresh process: resident memory after a small warm-up, then its peak while it makes a 3M-row table
    (192 MiB of rows, as much again of Adagrad state) on disk and trains on it through a 5,000-row cache."""
    budget = 8 << 20
    script = textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        import torch
        from bagpipe.heap import bounded_heap
        from bagpipe.nn import CachedEmbeddingBag
        from bagpipe.storage import StorageSpec

        def status(field):
            line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))
            return int(line.split()[1]) * 1024

        def train(module, num_rows, steps):
            generator = torch.Generator().manual_seed(0)
            for _ in range(steps):
                ids = torch.randint(0, num_rows, (4096,), generator=generator)
                module(ids, torch.arange(0, 4096, 4)).sum().backward()

        torch.set_num_threads(1)
        bounded_heap()
        directory = Path(sys.argv[1])
        small = CachedEmbeddingBag(10_000, 16, cache_rows=5000, optimizer="adagrad",
                                   storage=StorageSpec("disk", directory, 1 << 16))
        train(small, 10_000, 3)
        del small
        before = status("VmRSS:")
        with open("/proc/self/clear_refs", "w") as f:  # peak from here (VmHWM reset)
            f.write("5")
        num_rows = 3_000_000
        module = CachedEmbeddingBag(num_rows, 16, cache_rows=5000, optimizer="adagrad",
                                    storage=StorageSpec("disk", directory, {budget}))
        train(module, num_rows, 30)
        stats = {{**module.rows.host.stats(), **module.rows.stats}}
        print(json.dumps({{"before": before, "peak": status("VmHWM:"), "file": module.rows.host.path.stat().st_size,
                          "stats": stats}}))
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["file"] == 3_000_000 * 4 * (16 + 16 + 1)
    assert result["stats"]["disk_rows_written"] > 0 and result["stats"]["rows_written_back"] > 0
    # the DRAM cache, the device cache (5,000 rows and their state: 0.6 MiB) and a batch's transients
    grown = result["peak"] - result["before"]
    assert grown <= budget + (24 << 20), (grown / 2**20, result)
