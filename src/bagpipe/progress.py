"""Progress: a bar on a terminal, a log line every few seconds elsewhere (a job's output redirected to a file, a
scheduler's log); one logger set-up with role and rank."""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable

from tqdm import tqdm

log = logging.getLogger("bagpipe")

EVERY_S = 10.0  # a progress line this often off a terminal
FIRST_S = 3.0  # and the first this soon: the total and an estimate once the first iterations are done


def progress(*, total: int, desc: str, unit: str = "it", enabled: bool = True, initial: int = 0,
             samples_per_unit: int = 0) -> tqdm | LogProgress:
    """A tqdm bar where stderr is a terminal; a :class:`LogProgress` (the same calls) where it is not; nothing
    shown when not ``enabled`` (--no-progress). ``samples_per_unit``: the batch size, for the lines' samples/s."""
    if enabled and not sys.stderr.isatty():
        return LogProgress(total=total, desc=desc, unit=unit, initial=initial, samples_per_unit=samples_per_unit)
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, initial=initial, disable=not enabled)


def duration(seconds: float) -> str:
    """``1h02m``, ``4m10s``, ``12s``."""
    seconds = max(int(round(seconds)), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def _amount(value: float, unit: str) -> str:
    if unit == "B":
        for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
            if value >= scale:
                return f"{value / scale:,.1f} {name}"
        return f"{value:,.0f} B"
    return f"{value:,.0f}"


class LogProgress:
    """tqdm's calls (``update``, ``set_postfix``, ``refresh``, ``close``, ``n``, ``with``) as a log line on stderr
    at most every ``every_s``: ``train: 1,200 of 5,000 it (24%), 3,456 samples/s, loss 0.4567, ETA 2m05s``. The
    rate is taken after the first update (what came before or with it, start-up, a first iteration's warm-up or the
    iterations of a resumed run, is not this run's pace); ``refresh`` lets a caller that waits on others (the
    launcher) keep the lines coming while the count stands still. The last line is written at ``close`` when the
    work ended after the one before."""

    def __init__(self, *, total: int, desc: str, unit: str = "it", initial: int = 0, samples_per_unit: int = 0,
                 every_s: float = EVERY_S, first_s: float = FIRST_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.samples_per_unit = samples_per_unit
        self.every_s, self._clock = every_s, clock
        self.postfix: dict[str, str] = {}
        self._started = clock()
        self._due = self._started + first_s
        self._first: tuple[float, int] | None = None  # (when, count) at the first update
        self._printed_at_n: int | None = None
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._first is None:  # (what the first update brings came at an unknown pace: start-up, warm-up)
            self._first = (self._clock(), self.n)
        self.refresh()

    def set_postfix(self, **values) -> None:
        self.postfix = {key: str(value) for key, value in values.items()}

    def refresh(self) -> None:
        now = self._clock()
        if now >= self._due:
            self._write(now)

    def close(self) -> None:
        if not self.closed and self._printed_at_n is not None and self._printed_at_n != self.n:
            self._write(self._clock())
        self.closed = True

    def __enter__(self) -> "LogProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def rate(self, now: float) -> float | None:
        """Units a second since the first update; None before there is a pace to tell."""
        if self._first is None or now <= self._first[0] or self.n <= self._first[1]:
            return None
        return (self.n - self._first[1]) / (now - self._first[0])

    def line(self, now: float) -> str:
        parts = [f"{self.desc}: {_amount(self.n, self.unit)} of {_amount(self.total, self.unit)} {self.unit}"
                 + (f" ({100 * self.n / self.total:.0f}%)" if self.total else "")]
        rate = self.rate(now)
        if rate is not None:
            parts.append(f"{rate * self.samples_per_unit:,.0f} samples/s" if self.samples_per_unit
                         else f"{_amount(rate, self.unit)} {self.unit}/s")
        parts += [f"{key} {value}" for key, value in self.postfix.items()]
        if self.n >= self.total:
            parts.append(f"done in {duration(now - self._started)}")
        else:
            parts.append(f"ETA {duration((self.total - self.n) / rate)}" if rate else "ETA unknown yet")
        return ", ".join(parts)

    def _write(self, now: float) -> None:
        log.info("%s", self.line(now))
        self._printed_at_n = self.n
        self._due = now + self.every_s


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
