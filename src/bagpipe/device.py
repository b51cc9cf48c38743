"""The device a run asks for (``resolve_device``), and reused host staging buffers for copies to it
(``HostStaging``). Knows nothing of processes: the roles' ``main()`` and ``bagpipe.nn`` use it."""

from __future__ import annotations

import itertools
import logging

import torch

from bagpipe.config import DEVICE_SPEC

log = logging.getLogger(__name__)


def resolve_device(spec: str | torch.device | None, *, fallback: bool = False) -> torch.device:
    """``None`` or "cpu": the CPU; "auto": the first GPU where CUDA is available, else the CPU; "cuda" or
    "cuda:N": that GPU. A GPU asked for where CUDA is not available is a ValueError naming ``--device auto``, as
    PyTorch refuses it, unless ``fallback``: the original system's trainer commands and ``init_cache``, whose
    command lines say ``--device cuda:0`` and must run on CPU-only machines too, train on the CPU with a warning.
    A GPU index this machine lacks, or any other spec, is a ValueError."""
    if spec is None or str(spec) == "cpu":
        return torch.device("cpu")
    if str(spec) == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    match = DEVICE_SPEC.fullmatch(str(spec))
    if match is None:
        raise ValueError(f"unknown device {str(spec)!r}: expected 'cpu', 'auto', 'cuda' or 'cuda:N' (N a GPU index)")
    if not torch.cuda.is_available():
        if not fallback:
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise ValueError(f"--device {spec}: CUDA is not available here ({why}); --device auto trains on a GPU "
                             f"where there is one and on the CPU elsewhere, --device cpu on the CPU")
        log.warning("device %s requested but CUDA is not available: running on the CPU", spec)
        return torch.device("cpu")
    if match.group(1) is None:
        return torch.device("cuda")
    index, count = int(match.group(1)), torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"device {spec} requested but this machine has {count} CUDA device(s) "
                         f"(cuda:0 to cuda:{count - 1})")
    return torch.device("cuda", index)


class HostStaging:
    """Host buffers, reused from batch to batch, through which CPU tensors are copied to ``device``.

    Why: pinning a fresh tensor per batch (``rows.pin_memory()``) asks the host allocator for page-locked
    memory every time (cudaHostAlloc, slow and serialising, whenever its cache lacks a block of that size) and
    adds a copy into it; issue 28 asks for reused pinned buffers ordered by events instead. Here each of
    ``slots`` ring slots holds one flat buffer per dtype (pinned when ``pin``, by default on a CUDA device),
    grown geometrically and only when an input does not fit, so the number of allocations is bounded by
    slots x dtypes x growth steps (``stats()`` counts them). ``to_device`` records an event after each slot's
    asynchronous copy and waits for it before that slot is filled again, so a buffer is never overwritten
    while a copy still reads it; with two slots, staging batch i+1 overlaps batch i's copy.

    One thread stages (not thread-safe). On a CPU device ``to_device`` returns its inputs: nothing to overlap.
    """

    def __init__(self, device: torch.device | str, *, pin: bool | None = None, slots: int = 2) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda" if pin is None else pin
        self.num_slots = slots
        self._buffers: list[dict[torch.dtype, torch.Tensor]] = [{} for _ in range(slots)]
        self._events: list = [None] * slots  # per slot, the event recorded after its last copy (CUDA only)
        self._next_slot = 0
        self.allocations = 0
        self.bytes_allocated = 0
        self.staged_bytes = 0

    def stage(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Copies of the CPU ``tensors`` in the next slot's buffers: views of their shapes, valid until
        the slot comes round again (``slots`` calls later)."""
        return self._stage(tensors)[1]

    def to_device(self, *tensors: torch.Tensor, stream: torch.cuda.Stream | None = None) -> list[torch.Tensor]:
        """The CPU ``tensors`` on the device: staged, then copied asynchronously on ``stream`` (default: the
        current one). On a side stream the caller makes its own stream wait for it before using the results."""
        if self.device.type == "cpu":
            return list(tensors)
        if self.device.type != "cuda":  # no streams or events to order by: a plain, synchronous copy
            return [tensor.to(self.device) for tensor in tensors]
        slot, views = self._stage(tensors)
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            copies = [view.to(self.device, non_blocking=True) for view in views]
        if self._events[slot] is None:
            self._events[slot] = torch.cuda.Event()
        self._events[slot].record(stream)
        return copies

    def stats(self) -> dict:
        return {"allocations": self.allocations, "bytes_allocated": self.bytes_allocated,
                "staged_bytes": self.staged_bytes}

    def _stage(self, tensors: tuple[torch.Tensor, ...]) -> tuple[int, list[torch.Tensor]]:
        for tensor in tensors:
            if tensor.device.type != "cpu":
                raise ValueError(f"HostStaging stages CPU tensors, got one on {tensor.device}")
        slot = self._next_slot
        self._next_slot = (slot + 1) % self.num_slots
        if self._events[slot] is not None:
            self._events[slot].synchronize()  # the copy that last read this slot's buffers has finished
        needed: dict[torch.dtype, int] = {}
        for tensor in tensors:
            needed[tensor.dtype] = needed.get(tensor.dtype, 0) + tensor.numel()
        buffers = self._buffers[slot]
        for dtype, numel in needed.items():
            if numel and (dtype not in buffers or buffers[dtype].numel() < numel):
                buffers[dtype] = self._allocate(dtype, max(numel, int(1.5 * buffers[dtype].numel()))
                                                if dtype in buffers else numel)
        views, offsets = [], dict.fromkeys(needed, 0)
        for tensor in tensors:
            if not tensor.numel():
                views.append(tensor.new_empty(tensor.shape))  # nothing to copy, and maybe no buffer
                continue
            start = offsets[tensor.dtype]
            offsets[tensor.dtype] = start + tensor.numel()
            view = buffers[tensor.dtype][start:start + tensor.numel()].view(tensor.shape)
            views.append(view.copy_(tensor))
            self.staged_bytes += tensor.numel() * tensor.element_size()
        return slot, views

    def _allocate(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buffer = torch.empty(numel, dtype=dtype, pin_memory=self.pin)
        self.allocations += 1
        self.bytes_allocated += buffer.numel() * buffer.element_size()
        return buffer


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters (or buffers) are: the device its inputs go to (the CPU for a model with
    neither, e.g. a fixed scorer in a test)."""
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    return tensor.device if tensor is not None else torch.device("cpu")
