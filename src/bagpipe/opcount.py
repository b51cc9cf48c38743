"""Count the aten operations a piece of code dispatches: the fixed cost of a training step, whatever the device.

On a GPU each operation is at least one kernel launch and its Python around it, so a step's count is what its
host time follows; a ``_local_scalar_dense`` is a read of a tensor's value on the host (``.item()``, ``int()``,
``bool()``), a wait for the device where the tensor lives there. Counted on the CPU, it tells the GPU's story
without one (benchmarks/bench_step.py, the tests of bagpipe.nn). On a CUDA device a counted iteration also
counts the host's waits for the device, wherever they come from (``SyncWatch``: torch's sync debug mode, each
wait a warning at the Python line that caused it): what a step that never waits on the host must bring to zero.
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READ = "_local_scalar_dense"
SYNC_WARNING = "synchronizing CUDA operation"  # what torch's sync debug mode says of each wait (torch/csrc)


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as ops: ...``: ``ops.counts`` maps each aten operation's name to how often the block
    dispatched it (top-level operations only: those an operation runs inside its kernel are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def host_reads(self) -> int:
        return self.counts[HOST_READ]


class SyncWatch:
    """``with SyncWatch() as syncs: ...``: ``syncs.sites`` counts the host's waits for a CUDA device in the block
    (``.item()``, ``.cpu()``, a blocking copy, ``nonzero``...) by the source line that asked for each, through
    ``torch.cuda.set_sync_debug_mode("warn")``. Waits on other threads are counted too (the mode and the
    warnings are the process's), at their own lines. ``enabled=False`` (no CUDA device in use): counts nothing."""

    def __init__(self, *, enabled: bool, debug_mode: tuple | None = None) -> None:
        self.enabled = enabled
        self.sites: Counter[str] = Counter()
        # (get, set) of the sync debug mode: torch.cuda's, or a test's stand-in
        self._get_mode, self._set_mode = debug_mode or (torch.cuda.get_sync_debug_mode,
                                                        torch.cuda.set_sync_debug_mode)
        self._caught = None

    def __enter__(self) -> "SyncWatch":
        if self.enabled:
            self._caught = warnings.catch_warnings(record=True)
            self._records = self._caught.__enter__()
            warnings.simplefilter("always")
            self._previous = self._get_mode()
            self._set_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self._caught is None:
            return
        self._set_mode(self._previous)
        caught, self._caught = self._caught, None
        caught.__exit__(*exc)
        for record in self._records:
            if SYNC_WARNING in str(record.message):
                self.sites[f"{record.filename}:{record.lineno}"] += 1
            else:  # (not ours to swallow)
                warnings.warn_explicit(record.message, record.category, record.filename, record.lineno)

    @property
    def total(self) -> int:
        return sum(self.sites.values())


class StepCount:
    """The operations of one iteration of a training loop, for its summary (``ops_per_iteration``): the loop calls
    ``begin(n)`` where its ``n``-th iteration starts (before its batch is fetched) and ``end(n)`` where it ends;
    only iteration ``at`` is counted (the loops count their last warm-up iteration: steady by then, and counting
    slows it, which the timed iterations after it do not see). Only the calling thread's operations
    count: the dispatch mode is thread-local, so background readers and sums are left out. ``close()`` (also on
    an error) leaves no counter behind."""

    def __init__(self, at: int, *, device: torch.device | str = "cpu", ops: bool = True,
                 debug_mode: tuple | None = None) -> None:
        self.at = at
        # ``ops=False``: the operations are not counted (--compile: under a dispatch mode a compiled graph runs
        # otherwise, and rounds otherwise, than it does in every other iteration); the waits still are
        self.ops = ops
        self._counter: OpCounter | None = None
        self.counted: OpCounter | None = None
        # on a CUDA device, the host's waits for it in the same iteration
        self.syncs = SyncWatch(enabled=torch.device(device).type == "cuda", debug_mode=debug_mode)

    def begin(self, n: int) -> None:
        if n == self.at and self._counter is None and self.counted is None:
            self.syncs.__enter__()
            self._counter = OpCounter()
            if self.ops:
                self._counter.__enter__()

    def end(self, n: int) -> None:
        if n == self.at:
            self.close()

    def close(self) -> None:
        if self._counter is not None:
            counter, self._counter = self._counter, None
            if self.ops:
                counter.__exit__(None, None, None)
            self.syncs.__exit__(None, None, None)
            self.counted = counter

    def summary(self) -> dict:
        """``ops_per_iteration`` and ``host_reads_per_iteration`` (none until an iteration was counted); on a CUDA
        device ``device_syncs_per_iteration`` and where they were asked for (``device_sync_sites``, most first)."""
        if self.counted is None:
            return {}
        figures = ({"ops_per_iteration": self.counted.total, "host_reads_per_iteration": self.counted.host_reads}
                   if self.ops else {})
        if self.syncs.enabled:
            figures["device_syncs_per_iteration"] = self.syncs.total
            figures["device_sync_sites"] = dict(self.syncs.sites.most_common(20))
        return figures
