"""What the oracle tells the trainers: the job, then one message per iteration.

With the replicated cache every trainer holds the same caches, one per embedding space (the plan is global), so
every trainer gets the same plan part (``SpaceStep``); only the batch slice and which evicted rows it writes back
differ. With the partitioned cache each trainer gets its own part (``PartSpaceStep``, planner/partitioned.py).
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from bagpipe.cache import BatchView
from bagpipe.config import TrainConfig, config_from_dict
from bagpipe.data.schema import Feature, Schema
from bagpipe.embeddings import EmbeddingLayout, TableConfig, id_places

PULL_MAX_STEPS = 8  # plan messages a trainer's pull asks the oracle for at most
DAMAGED_RESENDS = 5  # a fetch whose answer arrived damaged is sent again at most this many times in a row


def answer_digest(*tensors: torch.Tensor) -> int:
    """A CRC-32 of the tensors' bytes, sent with a fetch's answer in its pickled part: the trainer checks the rows
    it received against it. (In 1 of 40 looped runs of a job whose parity server's replacement was itself lost, one
    row ended the job half zeroed on its data server, its parity consistent with it: a trainer had most likely
    trained on a damaged fetch answer. An answer's tensors travel apart from its pickled part, where its versions
    and tag are, and with TensorPipe's same-machine channel they are read out of the sender's memory, which an RPC
    agent shut down for a re-formation may already have let go. Whatever the cause, training on such a row would
    silently leave the reference's path.)"""
    crc = 0
    for tensor in tensors:
        crc = zlib.crc32(np.ascontiguousarray(tensor.numpy()).view(np.uint8).reshape(-1), crc)
    return crc


@dataclass(frozen=True)
class JobInfo:
    config: TrainConfig  # the job's settings, as the oracle resolved them
    schema: dict  # the data's Schema: {"num_dense", "features": [{"name", "cardinality", "width"}]}
    tables: list[dict]  # the model's TableConfigs, in order
    iterations: int
    cache_rows: list[int]  # each space's share of a trainer's cache
    slice_size: int  # samples per trainer per iteration
    resume: str | None = None  # the checkpoint the job continues from (RUN_DIR/checkpoints/NAME), if any
    start: int = 0  # the iteration training starts with (the checkpoint's boundary when resuming)
    replace_trainers: bool = False  # a lost trainer is replaced while training goes on (see runtime/redo.py)
    replace_oracle: bool = False  # a lost oracle is replaced (the local launcher serves the store): roles wait for it
    # raw-id data (embeddings.dynamic): the tables' rows are those the oracle numbered, each made from its key,
    # which a server asks the oracle for (ORACLE.row_keys)
    raw_ids: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))  # (the config as config_to_dict writes it)

    @classmethod
    def from_json(cls, text: str) -> "JobInfo":
        values = json.loads(text)
        return cls(**{**values, "config": config_from_dict(values["config"])})

    @property
    def layout(self) -> EmbeddingLayout:
        schema = Schema(num_dense=self.schema["num_dense"],
                        features=tuple(Feature(**f) for f in self.schema["features"]))
        return EmbeddingLayout([TableConfig.from_dict(t) for t in self.tables], schema)


def schema_dict(schema: Schema) -> dict:
    return {"num_dense": schema.num_dense, "features": [dataclasses.asdict(f) for f in schema.features]}


@dataclass
class SpaceStep:
    """One embedding space's part of a plan step (every trainer gets the same, but ``write_mask``)."""

    fetch_keys: torch.Tensor  # flat keys to install before this iteration
    fetch_versions: torch.Tensor  # the write-back version each fetch must observe
    fetch_slots: torch.Tensor  # the cache slot each fetched row goes to
    evict_keys: torch.Tensor  # flat keys to evict before the fetches (after iteration - 1)
    evict_slots: torch.Tensor  # and the slots they leave
    write_mask: torch.Tensor  # bool per evicted key: this trainer writes it back
    batch_keys: torch.Tensor  # the global batch's distinct keys of the space, those synced at once first
    batch_slots: torch.Tensor  # their cache slots
    num_now: int  # batch rows used again next iteration, so synced right away (the first ones)
    positions: torch.Tensor | None  # per place of this trainer's slice's key matrix: its index in batch_keys

    @property
    def due_fetches(self) -> int:
        """Fetches of rows of this iteration's batch (every one)."""
        return len(self.fetch_keys)

    def view(self) -> BatchView:
        """The slice's rows as the cache serves them."""
        return BatchView(self.batch_keys.numpy(), self.batch_slots.numpy(), self.num_now, self.positions)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.fetch_keys, self.fetch_versions, self.fetch_slots, self.evict_keys,
                            self.evict_slots, self.write_mask, self.batch_keys, self.batch_slots,
                            self.positions) if t is not None]


@dataclass
class PartSpaceStep:
    """One embedding space's part of a partitioned plan step for one trainer (planner/partitioned.TrainerStep):
    write-backs first (read from their slots; every one at the boundary's version, ``iteration - 1``), then the
    rows let go, then the fetches; the trainer's slice's distinct rows (sorted) and, per row, its users."""

    write_keys: torch.Tensor
    write_slots: torch.Tensor
    drop_keys: torch.Tensor
    drop_slots: torch.Tensor
    fetch_keys: torch.Tensor
    fetch_versions: torch.Tensor
    fetch_slots: torch.Tensor
    fetch_late: torch.Tensor  # bool per fetch: due at the next boundary (a row joined as a keeper, used next)
    batch_keys: torch.Tensor  # the slice's distinct rows, sorted
    batch_slots: torch.Tensor
    users: torch.Tensor  # per batch row, its users at this iteration as a bitmask (bit t: trainer t)
    holders: torch.Tensor  # per batch row, the trainers that apply its update (its users and keepers)
    kept_keys: torch.Tensor  # rows this trainer keeps without using them now: it receives their update
    kept_slots: torch.Tensor
    kept_users: torch.Tensor
    kept_holders: torch.Tensor
    positions: torch.Tensor | None  # per place of the slice's key matrix: its index in batch_keys

    @property
    def due_fetches(self) -> int:
        """Fetches of rows of this iteration's slice (the late ones are rows it uses next)."""
        return len(self.fetch_keys) - int(self.fetch_late.sum())

    def view(self) -> BatchView:
        """The slice's rows as the cache serves them (no row is synced apart: ``num_now`` 0)."""
        return BatchView(self.batch_keys.numpy(), self.batch_slots.numpy(), 0, self.positions)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.write_keys, self.write_slots, self.drop_keys, self.drop_slots, self.fetch_keys,
                            self.fetch_versions, self.fetch_slots, self.fetch_late, self.batch_keys,
                            self.batch_slots, self.users,
                            self.holders, self.kept_keys, self.kept_slots, self.kept_users, self.kept_holders,
                            self.positions) if t is not None]


@dataclass
class StepMessage:
    iteration: int
    final: bool  # the flush after the last iteration: no batch, every resident row is evicted
    dense_x: torch.Tensor | None  # this trainer's slice of the global batch
    ids: torch.Tensor | None  # [slice, columns], each sparse feature's ids (PAD where empty)
    target: torch.Tensor | None
    spaces: list  # SpaceStep per space (replicated cache), or PartSpaceStep (partitioned)
    lookups: int = 0  # ids in the global batch, repeats included
    checkpoint: bool = False  # a checkpoint is taken at this boundary: trainer 0 (partitioned: each) sends its part
    # raw ids with rows retired: per space, the rows made again before this iteration (their numbers reused: flat keys,
    # new raw keys, model tables), which every trainer holding one makes again in its slot (embeddings.dynamic.remade)
    remade: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def nbytes(self) -> int:
        tensors = [t for t in (self.dense_x, self.ids, self.target) if t is not None]
        tensors += [t for space in self.spaces for t in space.tensors()]
        tensors += [t for space in self.remade or [] for t in space]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Pulled:
    """The oracle's answer to a trainer's pull."""

    messages: list[StepMessage]  # the next plan messages (none: none is ready yet, ask again)
    written_by_all: int  # every trainer's write-backs up to this version are acknowledged (what it last said)
    servers_ready: bool = True  # False: a server is still filling its tables (the wait is theirs, not the oracle's)


@dataclass
class TrainerStats:
    """Counters a trainer reports when it finishes (summed or averaged by the oracle)."""

    iterations: int = 0
    rows_fetched: int = 0
    rows_written_back: int = 0
    batch_rows: int = 0  # distinct rows of the global batches, summed over iterations
    batch_hits: int = 0  # of those, rows already resident before the iteration's fetches
    stall_s: float = 0.0  # waiting for embeddings: the three waits below together
    plan_wait_s: float = 0.0  # for the oracle's next plan message
    fetch_wait_s: float = 0.0  # for fetched rows still in flight at their iteration
    lazy_sync_wait_s: float = 0.0  # for a background gradient sync due before a row's use or eviction
    sync_s: float = 0.0  # waiting on the blocking gradient all-reduce
    loop_s: float = 0.0  # wall time from the first iteration to the end of the flush
    rows_exchanged: int = 0  # partitioned cache: shared rows' gradients sent to their other users
    bytes_sent: int = 0  # payload this trainer sent: write-backs and gradient all-reduces
    allreduce_bytes: int = 0  # of which gradient all-reduce buffers (blocking and background)
    allreduce_main_bytes: int = 0  # of which the blocking main sums (dense gradients, rows used next iteration)
    allreduce_main_row_bytes: int = 0  # of which their rows' (replicated: the rows used again next iteration)
    samples_per_s: float = float("nan")  # steady state, as the reference counts it
    extra: dict = field(default_factory=dict)


def slice_messages(iteration: int, steps, views, batch, num_trainers: int, *, checkpoint: bool = False
                   ) -> list[StepMessage]:
    """Each trainer's message of one plan step (each space's ``PlanStep`` and ``BatchView``): the step, the same for
    every trainer but for which evicted rows it writes back, and its slice of the global ``batch`` (None: the final
    flush), with each of the slice's ids' place among the batch's rows, cut from the views' places of the whole
    batch (``batch_view(step, keys)``: where the planner's sort put each id)."""
    size = 0 if batch is None else len(batch) // num_trainers

    def spaces_of(trainer: int, part) -> list[SpaceStep]:
        return [SpaceStep(fetch_keys=torch.from_numpy(step.fetch_keys),
                          fetch_versions=torch.from_numpy(step.fetch_versions),
                          fetch_slots=torch.from_numpy(step.fetch_slots),
                          evict_keys=torch.from_numpy(step.evict_keys),
                          evict_slots=torch.from_numpy(step.evict_slots),
                          write_mask=torch.from_numpy(step.evict_writers == trainer),
                          batch_keys=torch.from_numpy(view.keys), batch_slots=torch.from_numpy(view.slots),
                          num_now=view.num_now, positions=None if part is None else torch.from_numpy(
                              view.positions[trainer * size:(trainer + 1) * size]))  # each id's row in batch_keys
                for step, view in zip(steps, views)]
    return _messages(iteration, steps, batch, num_trainers, spaces_of, checkpoint=checkpoint)


def part_messages(iteration: int, steps, batch, keys, *, checkpoint: bool = False) -> list[StepMessage]:
    """Each trainer's message of one partitioned plan step (each space's ``PartitionedStep``, planned with
    ``inverse=True``): its part of the step and its slice of the global ``batch`` (None: the final flush), with each
    of the slice's ids' place among its distinct rows, where the planner's sort put it (``keys``: per trainer, each
    space's key matrix of its slice, the ids whose valid ones the planner was given)."""
    def spaces_of(trainer: int, part) -> list[PartSpaceStep]:
        slice_keys = None if part is None else keys[trainer]
        spaces = []
        for s, step in enumerate(steps):
            mine = step.trainers[trainer]
            users = np.full(len(mine.batch_keys), 1 << trainer, dtype=np.int64)
            holders = users.copy()
            if len(mine.shared_keys):
                shared = np.searchsorted(mine.batch_keys, mine.shared_keys)
                users[shared], holders[shared] = mine.shared_users, mine.shared_holders
            spaces.append(PartSpaceStep(
                write_keys=torch.from_numpy(mine.write_keys), write_slots=torch.from_numpy(mine.write_slots),
                drop_keys=torch.from_numpy(mine.drop_keys), drop_slots=torch.from_numpy(mine.drop_slots),
                fetch_keys=torch.from_numpy(mine.fetch_keys), fetch_versions=torch.from_numpy(mine.fetch_versions),
                fetch_slots=torch.from_numpy(mine.fetch_slots), fetch_late=torch.from_numpy(mine.fetch_late),
                batch_keys=torch.from_numpy(mine.batch_keys),
                batch_slots=torch.from_numpy(mine.batch_slots), users=torch.from_numpy(users),
                holders=torch.from_numpy(holders), kept_keys=torch.from_numpy(mine.kept_keys),
                kept_slots=torch.from_numpy(mine.kept_slots), kept_users=torch.from_numpy(mine.kept_users),
                kept_holders=torch.from_numpy(mine.kept_holders),
                positions=None if slice_keys is None else torch.from_numpy(
                    id_places(slice_keys[s], mine.batch_inverse, empty=len(mine.batch_keys)))))
        return spaces
    return _messages(iteration, steps, batch, len(steps[0].trainers), spaces_of, checkpoint=checkpoint)


def _messages(iteration: int, steps, batch, num_trainers: int, spaces_of, *, checkpoint: bool) -> list[StepMessage]:
    """Each trainer's message: its slice of ``batch`` (None: the final flush) and ``spaces_of(trainer, its
    slice)``."""
    parts = [None] * num_trainers if batch is None else batch.slices(num_trainers)
    messages = []
    for trainer, part in enumerate(parts):
        messages.append(StepMessage(iteration=iteration, final=batch is None,
                                    dense_x=None if part is None else part.dense_x,
                                    ids=None if part is None else part.ids,
                                    target=None if part is None else part.target,
                                    spaces=spaces_of(trainer, part),
                                    lookups=sum(step.lookups for step in steps), checkpoint=checkpoint))
    return messages
