"""Count the aten operations a piece of code dispatches: the fixed cost of a training step, whatever the device.

On a GPU each operation is at least one kernel launch and its Python around it, so a step's count is what its
host time follows; a ``_local_scalar_dense`` is a read of a tensor's value on the host (``.item()``, ``int()``,
``bool()``), a wait for the device where the tensor lives there. Counted on the CPU, it tells the GPU's story
without one (benchmarks/bench_step.py, the tests of bagpipe.nn).
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

HOST_READ = "_local_scalar_dense"


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


class StepCount:
    """The operations of one iteration of a training loop, for its summary (``ops_per_iteration``): the loop calls
    ``begin(n)`` where its ``n``-th iteration starts (before its batch is fetched) and ``end(n)`` where it ends;
    only iteration ``at`` is counted (the loops count their last warm-up iteration: steady by then, and counting
    slows it, which the timed iterations after it do not see). Only the calling thread's operations
    count: the dispatch mode is thread-local, so background readers and sums are left out. ``close()`` (also on
    an error) leaves no counter behind."""

    def __init__(self, at: int) -> None:
        self.at = at
        self._counter: OpCounter | None = None
        self.counted: OpCounter | None = None

    def begin(self, n: int) -> None:
        if n == self.at and self._counter is None and self.counted is None:
            self._counter = OpCounter()
            self._counter.__enter__()

    def end(self, n: int) -> None:
        if n == self.at:
            self.close()

    def close(self) -> None:
        if self._counter is not None:
            counter, self._counter = self._counter, None
            counter.__exit__(None, None, None)
            self.counted = counter

    def summary(self) -> dict:
        """``ops_per_iteration`` and ``host_reads_per_iteration`` (none until an iteration was counted)."""
        if self.counted is None:
            return {}
        return {"ops_per_iteration": self.counted.total, "host_reads_per_iteration": self.counted.host_reads}
