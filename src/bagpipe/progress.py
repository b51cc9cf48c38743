"""Progress bars on a terminal, silence elsewhere; one logger set-up with role and rank."""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm


def progress(*, total: int, desc: str, unit: str = "it", enabled: bool = True, initial: int = 0) -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, initial=initial,
                disable=not (enabled and sys.stderr.isatty()))


def setup_logging(*, role: str, rank: int = 0, level: int = logging.INFO) -> logging.Logger:
    """Configure the root logger once, so every line says which role and rank wrote it."""
    fmt = f"%(asctime)s {role}[{rank}] %(levelname)s %(message)s"
    root = logging.getLogger()
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)
    return logging.getLogger("bagpipe")
