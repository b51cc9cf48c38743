"""Numbering batches in a process of its own, ahead of the planner's decisions.

Planning splits in two halves that share nothing but the batches (planner/plan.py): the stream's (each batch
sorted, deduplicated and its rows numbered in a hash table: ``number_batches``) and the decisions (next uses,
residency, evictions: ``plan_numbered``). On large tables each half is about half the work, and both are many numpy
calls on arrays of tens of thousands of entries, which a thread cannot overlap (the GIL). ``numbered_ahead`` runs
the first half in a child process: the batches go to it through a pipe, and their numbered forms come back, read
by a thread into a queue so that the child keeps working while the decisions run. The plan is the same bit for bit:
the child runs the same code on the same batches in the same order.

The child is a fresh interpreter (``python -m bagpipe.planner.ahead``: not forked, since the caller may hold threads
and torch, and not multiprocessing's spawn, which would import the caller's main script again) that imports numpy
and this package only, and talks over two pipes of its own; it ends with the batches, on an error (raised here with
its text), or when the consumer stops early (the generator is closed: the child is terminated and waited for, never
left behind).
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from bagpipe.heap import kept_heap
from bagpipe.timing import peak_rss_bytes
from bagpipe.planner.plan import (_NEXT_USE_BLOCK, Numbered, PlannerConfig, PlanStep, number_batches, per_space,
                                  plan_numbered)

DEPTH = 2 * _NEXT_USE_BLOCK  # numbered batches held ahead of the decisions (they take a block's worth at once)
_END = None


class NumberingLost(RuntimeError):
    """The numbering process was killed (a signal, not an error of its own): its caller lost a part of itself."""


class _Failure(tuple):
    """An error in the child or in the batches: (kind, text), raised by the consumer."""


class _Finished(tuple):
    """The child's last message: (its peak RSS in bytes,)."""


def numbered_ahead(batches: Iterable[np.ndarray], *, num_rows: int, depth: int = DEPTH,
                   report: dict | None = None, inverse: bool = False) -> Iterator[Numbered]:
    """``number_batches(batches, num_rows=num_rows, inverse=inverse)``, computed in a child process up to ``depth``
    batches ahead of the consumer. Start-up (spawning the child) takes a few tenths of a second: worth it for long
    plans of large tables, not for a handful of batches. ``report``, if given, gets the child's ``peak_rss_bytes`` at
    the end (its own: a forked child's usage counts the parent's pages until it runs its own program)."""
    batches_out, batches_in = os.pipe()  # (reading end, writing end)
    numbered_out, numbered_in = os.pipe()
    imported_from = str(Path(__file__).resolve().parents[2])  # the directory bagpipe is imported from, here and there
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [imported_from,
                                                                          os.environ.get("PYTHONPATH")])))
    child = subprocess.Popen([sys.executable, "-m", "bagpipe.planner.ahead", str(batches_out), str(numbered_in),
                              str(num_rows), str(int(inverse))], pass_fds=(batches_out, numbered_in), env=environment,
                             stdin=subprocess.DEVNULL)
    os.close(batches_out)
    os.close(numbered_in)
    for end in (batches_in, numbered_out):
        _widen(end)
    batches_in, numbered_out = Connection(batches_in, readable=False), Connection(numbered_out, writable=False)
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stopping = threading.Event()

    def feed() -> None:  # the batches to the child, as the pipe takes them
        source = iter(batches)
        while not stopping.is_set():
            try:
                batch = next(source, _END)
            except BaseException as err:  # noqa: BLE001 - the batches' own error, raised by the consumer
                ready.put(_Failure((type(err).__name__, str(err))))
                stopping.set()
                return
            try:
                batches_in.send(_END if batch is _END else _narrow(np.asarray(batch).ravel(), num_rows))
            except OSError:  # (BrokenPipeError among them)
                return  # the child ended (its error, or stopped by the consumer): the reader says why
            if batch is _END:
                return

    def read() -> None:  # the child's answers into ``ready``, so that it keeps working ahead
        try:
            while not stopping.is_set():
                item = numbered_out.recv()
                if isinstance(item, _Finished):
                    if report is not None:
                        report["peak_rss_bytes"] = item[0]
                    item = _END
                ready.put(item if item is _END or isinstance(item, _Failure) else _widened(*item))
                if item is _END or isinstance(item, _Failure):
                    return
        except (EOFError, OSError):
            if not stopping.is_set():
                code = child.wait()
                ready.put(_Failure(("NumberingLost" if code < 0 else "RuntimeError",
                                    f"the numbering process ended unexpectedly (exit code {code})")))
        except BaseException as err:  # noqa: BLE001 - an answer that did not unpickle: raised by the consumer
            ready.put(_Failure(("RuntimeError", f"the numbering process's answer could not be read: {err!r}")))

    threads = [threading.Thread(target=feed, name="numbering-feed", daemon=True),
               threading.Thread(target=read, name="numbering-read", daemon=True)]
    for thread in threads:
        thread.start()
    try:
        while True:
            item = ready.get()
            if item is _END:
                break
            if isinstance(item, _Failure):
                kind, text = item
                raise {"ValueError": ValueError, "NumberingLost": NumberingLost}.get(kind, RuntimeError)(text)
            yield item
    finally:
        stopping.set()
        if child.poll() is None:
            child.terminate()
        child.wait()
        for end in (batches_in, numbered_out):
            end.close()
        while True:  # (a reader blocked on a full queue gets its put, sees ``stopping`` and ends)
            try:
                ready.get_nowait()
            except queue.Empty:
                break


def plan_spaces_ahead(batches: Iterable[list[np.ndarray]], configs: list[PlannerConfig], *, inverse: bool = False
                      ) -> Iterator[tuple[PlanStep, ...]]:
    """``plan_spaces`` with each embedding space's batches numbered in a process of its own (``numbered_ahead``;
    their batches are then read on its feeding threads, one at a time) and the decisions here: the same plan."""
    numbered = [numbered_ahead(stream, num_rows=config.num_rows, inverse=inverse)
                for stream, config in zip(per_space(batches, len(configs)), configs)]
    try:
        yield from zip(*(plan_numbered(items, config) for items, config in zip(numbered, configs)))
    finally:
        for items in numbered:  # (each child stopped and waited for, whether the plan ended or was left)
            items.close()


_PIPE_BYTES = 1 << 20  # a batch or its numbered form in one read or write where the system allows (Linux: F_SETPIPE_SZ)


def _widen(fd: int) -> None:
    """Make a pipe hold ``_PIPE_BYTES`` where the system allows: the thread reading or writing it then takes the
    GIL once a message, not once every 64 KiB (each time waiting out the decisions' thread)."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE_BYTES)
    except (ImportError, OSError):
        pass  # (the default size works: only slower)


def _narrow(values: np.ndarray, bound: int) -> np.ndarray:
    """Non-negative ``values`` below ``bound``, as int32 where that holds them (half the bytes through a pipe)."""
    return values.astype(np.int32) if bound <= np.iinfo(np.int32).max else values.astype(np.int64, copy=False)


def _widened(keys: np.ndarray, numbers: np.ndarray, lookups: int, count: int,
             inverse: np.ndarray | None = None) -> Numbered:
    return Numbered(keys.astype(np.int64, copy=False), numbers.astype(np.int64, copy=False), lookups, count, inverse)


def _number(batches, numbered, num_rows: int, inverse: bool = False) -> None:
    """The child: numbers the batches it receives until the end marker, sending each back (arrays as they are)."""
    def received() -> Iterator[np.ndarray]:
        while (batch := batches.recv()) is not _END:
            yield batch

    try:
        with kept_heap():  # (its numpy temporaries and the hash table's rebuilds: reused, not faulted in again)
            for item in number_batches(received(), num_rows=num_rows, inverse=inverse):
                numbered.send((_narrow(item.keys, num_rows), _narrow(item.numbers, item.count), item.lookups,
                               item.count) + ((item.inverse,) if inverse else ()))  # (an inverse is int32)
        numbered.send(_Finished((peak_rss_bytes(),)))
    except (BrokenPipeError, EOFError):
        return  # the consumer stopped
    except Exception as err:  # noqa: BLE001 - sent to the consumer, which raises it
        numbered.send(_Failure((type(err).__name__, str(err))))


if __name__ == "__main__":  # the child: python -m bagpipe.planner.ahead BATCHES_FD NUMBERED_FD NUM_ROWS [INVERSE]
    from bagpipe.planner import ahead  # (this module by its name, so that what it sends unpickles as its own)

    ahead._number(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False),
                  int(sys.argv[3]), inverse=len(sys.argv) > 4 and sys.argv[4] == "1")
