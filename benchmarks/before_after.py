"""What the before/after benchmarks share (bench_startup.py, bench_threads.py): their command line, their work
dir, the two source trees they alternate, and the synthetic data they make once."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


def parse(doc: str, *, name: str, repeats: int,
          more: Callable[[argparse.ArgumentParser], None] | None = None) -> tuple[argparse.Namespace, Path, dict]:
    """The arguments (``--before-src``, ``--repeats``, ``--work-dir``, ``--out``, and what ``more`` adds), the work
    dir, and ``{"before": the given src/, "after": this tree's}``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--before-src", required=True, help="the src/ folder of the code to compare with")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--work-dir", default=None, help="data and run dirs (default: a new temporary dir)")
    parser.add_argument("--out", default=f"runs/{name}/result.json")
    if more is not None:
        more(parser)
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix=f"{name}_"))
    return args, work, {"before": Path(args.before_src).resolve(), "after": ROOT / "src"}


def synth_once(data: Path, *flags: str) -> Path:
    """``bagpipe synth --out data FLAGS`` by this tree's code, unless ``data`` holds it already."""
    if not (data / "meta.json").exists():
        subprocess.run([sys.executable, "-m", "bagpipe.cli", "synth", "--out", str(data), *flags], check=True,
                       capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    return data
