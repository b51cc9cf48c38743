"""The mean of a buffer over the trainers, summed in trainer order: rank 0's + rank 1's + ...

That order is what the reference's sliced step (``--mode reference --slices T``) adds, so the
two agree bit for bit. Two operands have one sum whichever comes first, so two trainers use
gloo's all-reduce as it is. With more, a ring all-reduce starts each chunk's sum at a different
rank, and the result would depend on where an element falls: there each trainer receives its
chunk of every buffer (all-to-all), adds them in rank order and shares the sum (all-gather), the
same bytes per trainer as a ring.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist


class Mean:
    """A started reduction of ``buffer`` (contiguous, float32); ``wait`` leaves the mean in it.

    A reduction that fails (a trainer was lost) raises from ``wait``; ``restart`` starts it again on another group
    (the trainers' group re-formed around a replacement), from what ``buffer`` holds then."""

    def __init__(self, group: dist.ProcessGroup | None, buffer: torch.Tensor, *, timeout: float, what=None) -> None:
        self.buffer, self.what = buffer, what  # ``what``: the sum's name, for its owner (TrainerRuntime)
        self.timeout = timedelta(seconds=timeout)
        self._start(group)

    def _start(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.size = 1 if group is None else group.size()
        self._work = self._received = self._failed = None
        if self.size == 1 or self.buffer.numel() == 0:
            return
        try:
            if self.size == 2:
                self._work = group.allreduce([self.buffer])
                return
            chunk = math.ceil(self.buffer.numel() / self.size)
            padded = torch.zeros(self.size * chunk)
            padded[:self.buffer.numel()] = self.buffer.view(-1)
            self._received = torch.empty_like(padded)
            self._work = group.alltoall_base(self._received, padded, [], [], dist.AllToAllOptions())
        except RuntimeError as err:  # the group is broken already: raised by ``wait``
            self._failed = err

    def restart(self, group: dist.ProcessGroup) -> None:
        self._start(group)

    def wait(self) -> torch.Tensor:
        if self._failed is not None:
            raise self._failed
        if self._work is None:
            return self.buffer
        self._work.wait(timeout=self.timeout)
        self._work = None
        if self._received is not None:
            parts = self._received.view(self.size, -1)
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            gathered = [torch.empty_like(total) for _ in range(self.size)]
            self.group.allgather([gathered], [total]).wait(timeout=self.timeout)
            self.buffer.view(-1).copy_(torch.cat(gathered)[:self.buffer.numel()])
            self._received = None
        self.buffer /= self.size
        return self.buffer
