"""The mean of a buffer over the trainers, summed in trainer order: rank 0's + rank 1's + ...

That order is what the reference's sliced step (``--mode reference --slices T``) adds, so the
two agree bit for bit. Two operands have one sum whichever comes first, so two trainers use
gloo's all-reduce as it is. With more, a ring all-reduce starts each chunk's sum at a different
rank, and the result would depend on where an element falls: there each trainer receives its
chunk of every buffer (all-to-all), adds them in rank order and shares the sum (all-gather), the
same bytes per trainer as a ring. Those two steps run on a thread of the group's own, one sum after
the other in the order they were started, so the group's collectives come in the same order on every
trainer whatever order the sums are waited for in (a lost trainer's replacement starts the sums it
joins in the order they were started, not waited for). The thread lives as long as its group: a
``TrainerGroup`` holds both, and closing it (a re-formed world's old group) ends the thread and lets the gloo
group go, whose own threads end with it.
"""

from __future__ import annotations

import math
import queue
import threading
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from bagpipe.threads import Background


class TrainerGroup:
    """The trainers' gloo ``group`` and, with three trainers or more, the thread that carries out its sums in the
    order they were started (``_Sequencer``), made and closed together. Its collectives, ``size()`` and ``rank()``
    are the group's."""

    def __init__(self, group: dist.ProcessGroup, *, timeout: float) -> None:
        self.group: dist.ProcessGroup | None = group
        self._sequencer = _Sequencer(group, timedelta(seconds=timeout)) if group.size() > 2 else None

    def __getattr__(self, name: str):  # (only for what the instance lacks: the group's own methods)
        if self.group is None:
            raise RuntimeError("the trainers' group was closed (the world re-formed around a replacement)")
        return getattr(self.group, name)

    def ordered(self) -> "_Sequencer":
        """The thread its sums over three or more trainers go through, in order."""
        if self._sequencer is None:
            raise RuntimeError(f"a group of {self.group.size()} trainers sums without an order of its own")
        return self._sequencer

    def close(self) -> None:
        """End its sums' thread once the sums submitted are done (a sum started after is refused, raised by its
        ``wait`` as on a broken group), and let the gloo group go. Its threads (two workers and a TCP loop) end when
        the last reference to it does, once the work queued on it is over: on a thread of its own, as a sum still
        waiting on a stopped peer holds them until the group's timeout. (Kept instead, every re-formation left three
        more threads in each survivor.)"""
        if self._sequencer is not None:
            self._sequencer.close()
        if self.group is not None:
            held = [self.group]
            self.group = None
            Background(held.clear, name="old trainers' group")


class Mean:
    """A started reduction of ``buffer`` (contiguous, float32); ``wait`` leaves the mean in it.

    A reduction that fails (a trainer was lost) raises from ``wait``; ``restart`` starts it again on another group
    (the trainers' group re-formed around a replacement), from what ``buffer`` holds then."""

    def __init__(self, group: TrainerGroup | None, buffer: torch.Tensor, *, timeout: float, what=None) -> None:
        self.buffer, self.what = buffer, what  # ``what``: the sum's name, for its owner (TrainerRuntime)
        self.timeout = timedelta(seconds=timeout)
        self._start(group)

    def _start(self, group: TrainerGroup | None) -> None:
        self.group = group
        self.size = 1 if group is None else group.size()
        self._work = self._failed = None
        self._ordered: _Ordered | None = None
        if self.size == 1 or self.buffer.numel() == 0:
            return
        try:
            if self.size == 2:
                self._work = group.allreduce([self.buffer])
                return
            self._ordered = group.ordered().submit(self.buffer)
        except RuntimeError as err:  # the group is broken already: raised by ``wait``
            self._failed = err

    def restart(self, group: TrainerGroup) -> None:
        self._start(group)

    def wait(self) -> torch.Tensor:
        if self._failed is not None:
            raise self._failed
        if self._work is not None:
            self._work.wait(timeout=self.timeout)
            self._work = None
        elif self._ordered is not None:
            total = self._ordered.result(self.timeout.total_seconds())
            self.buffer.view(-1).copy_(total[:self.buffer.numel()])
            self._ordered = None
        else:
            return self.buffer
        self.buffer /= self.size
        return self.buffer


class SharedSum:
    """Each of this trainer's shared rows' gradient summed among the row's users only, in trainer order, over
    ``trainers`` (the partitioned cache's exchange, planner/partitioned.py): ``grads`` ``[rows, D]``, this trainer's
    contributions to the rows it shares (sorted by key; where it is not a user, ignored), ``users`` each row's users
    as a bitmask (bit t: trainer t), ``holders`` the trainers that apply its update (its users and the trainers
    that keep it without using it; default: its users; this trainer's bit is set in every one). Each trainer sends
    every other trainer its contributions to the rows it uses and the other holds, in key order (the same rows, in
    the same order, on both sides: no indices travel), and every holder adds the users' contributions in trainer
    order, as the sliced reference adds every trainer's (a non-user's zero leaves a sum unchanged). One all-to-all;
    over three or more trainers it takes its turn in the group's sequence of ordered sums, so the group's
    collectives come in the same order on every trainer. ``wait`` gives the means.

    Every trainer of the group starts one for every iteration, even one with no shared rows (the all-to-all needs
    every rank), from the thread that starts its ``Mean``s, in the same order relative to them on every trainer."""

    def __init__(self, group: TrainerGroup, grads: torch.Tensor, users: np.ndarray,
                 holders: np.ndarray | None = None, *, trainers: int, timeout: float) -> None:
        self.grads, self.trainers = grads, trainers
        self.rank, self.size = group.rank(), group.size()
        self.timeout = timedelta(seconds=timeout)
        users = np.asarray(users, dtype=np.int64)
        holders = users if holders is None else np.asarray(holders, dtype=np.int64)
        if len(holders) and int(holders.max()) >> self.size:
            raise ValueError(f"a shared row names a holder outside the {self.size} trainers")
        if ((users & ~holders) != 0).any():
            raise ValueError("a shared row has a user that does not hold it")
        if not ((holders >> self.rank) & 1).all():
            raise ValueError(f"trainer {self.rank} does not hold every row it is given to share")
        mine = ((users >> self.rank) & 1).astype(bool)
        self.rows_of = [np.flatnonzero((users >> u) & 1) for u in range(self.size)]  # the rows u contributes to
        sent_to = [np.flatnonzero(mine & ((holders >> u) & 1).astype(bool)) if u != self.rank else np.zeros(0, int)
                   for u in range(self.size)]
        splits_in = [0 if u == self.rank else len(rows) for u, rows in enumerate(self.rows_of)]
        splits_out = [len(rows) for rows in sent_to]
        self.sent_rows = sum(splits_out)
        send = torch.cat([grads[torch.from_numpy(rows)] for rows in sent_to]) if len(grads) else grads[:0]
        self.received = torch.empty(sum(splits_in), grads.shape[1], dtype=grads.dtype)
        self._work = self._ordered = None

        def exchange() -> torch.Tensor:
            group.alltoall_base(self.received, send.contiguous(), splits_in, splits_out,
                                dist.AllToAllOptions()).wait(timeout=self.timeout)
            return self.received

        if self.size == 2:
            self._work = group.alltoall_base(self.received, send.contiguous(), splits_in, splits_out,
                                             dist.AllToAllOptions())
        elif self.size > 2:
            self._ordered = group.ordered().submit_job(exchange)

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait(timeout=self.timeout)
        elif self._ordered is not None:
            self._ordered.result(self.timeout.total_seconds())
        total = torch.empty_like(self.grads)
        summed = np.zeros(len(self.grads), dtype=bool)
        offset = 0
        for u, rows in enumerate(self.rows_of):  # trainer order
            if u == self.rank:
                part = self.grads[torch.from_numpy(rows)]
            else:
                part = self.received[offset:offset + len(rows)]
                offset += len(rows)
            later = summed[rows]
            first = torch.from_numpy(rows[~later])
            total[first] = part[torch.from_numpy(~later)]
            again = torch.from_numpy(rows[later])
            total[again] += part[torch.from_numpy(later)]
            summed[rows] = True
        if not summed.all():
            raise ValueError("a shared row has no user")
        return total.div_(self.trainers)


class _Ordered:
    """One collective job in a group's sequence: an ordered sum's padded operand (or any job), then its result (or
    the error)."""

    def __init__(self, padded: torch.Tensor | None, job=None) -> None:
        self.padded, self.job = padded, job
        self.total: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def result(self, timeout: float) -> torch.Tensor:
        if not self.done.wait(timeout):
            raise RuntimeError(f"a sum over trainers did not complete within {timeout:.0f} s")
        if self.error is not None:
            raise self.error
        return self.total


class _Sequencer:
    """A group's sums over three or more trainers, carried out one after the other in the order submitted."""

    def __init__(self, group: dist.ProcessGroup, timeout: timedelta) -> None:
        self.group, self.size, self.timeout = group, group.size(), timeout
        self._queue: queue.Queue = queue.Queue()
        self._broken: BaseException | None = None
        self._closed = False
        threading.Thread(target=self._run, name="ordered-sum", daemon=True).start()

    def submit(self, buffer: torch.Tensor) -> _Ordered:
        chunk = math.ceil(buffer.numel() / self.size)
        padded = torch.zeros(self.size * chunk)
        padded[:buffer.numel()] = buffer.view(-1)
        return self._put(_Ordered(padded))

    def submit_job(self, job) -> _Ordered:
        """Run ``job()`` (a collective of the group's) in its turn; its result is the _Ordered's."""
        return self._put(_Ordered(None, job))

    def _put(self, ordered: _Ordered) -> _Ordered:
        if self._closed:
            raise RuntimeError("a sum started on a trainers' group that was closed (the world re-formed since)")
        self._queue.put(ordered)
        return ordered

    def close(self) -> None:
        """End the thread once what was submitted is done."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)

    def _run(self) -> None:
        while (ordered := self._queue.get()) is not None:
            try:
                if self._broken is not None:  # a later sum on a group a trainer was lost from cannot complete
                    raise self._broken
                ordered.total = ordered.job() if ordered.job is not None else self._sum(ordered.padded)
            except BaseException as err:  # noqa: BLE001 - handed to the sum's waiter
                self._broken = self._broken or err
                ordered.error = err
            ordered.done.set()
        self.group = None  # closed and done: the gloo group goes with its last reference (TrainerGroup.close)

    def _sum(self, padded: torch.Tensor) -> torch.Tensor:
        received = torch.empty_like(padded)
        self.group.alltoall_base(received, padded, [], [], dist.AllToAllOptions()).wait(timeout=self.timeout)
        parts = received.view(self.size, -1)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        gathered = [torch.empty_like(total) for _ in range(self.size)]
        self.group.allgather([gathered], [total]).wait(timeout=self.timeout)
        return torch.cat(gathered)
