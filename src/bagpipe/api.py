"""The original system's trainer API: ``init_cache``, ``next_batch`` and ``get_emb``.

A user's trainer script written for the original runs with only its import changed::

    from bagpipe import init_cache          # or: from BagPipe import init_cache
    cache = init_cache(emb_size=16, ln_emb=table_sizes, cache_size=25000, emb_optim=torch.optim.Adagrad,
                       emb_optim_params={"lr": 0.01}, worker_id=rank, world_size=world,
                       training_worker_id=trainer_rank, trainer_world_size=trainers)
    dist.init_process_group(...)            # optional: the script's own group, e.g. for DDP
    while (batch := cache.next_batch()) is not None:
        embs = cache.get_emb(batch["sparse_vector"])   # one [B, emb_size] tensor per table
        loss = ...; loss.backward(); dense_optimizer.step()
    cache.close(model)

The oracle (``bagpipe oracle``) owns the data and the plan; ``init_cache`` checks that the
script's settings agree with it. The cache syncs embedding gradients over its own gloo group, so
it works whether or not the script creates a default process group, before or after this call.
``next_batch`` first applies the previous iteration's embedding update (after the script's
``backward``), then returns the next batch: the embedding optimizer runs inside the cache.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from bagpipe import models
from bagpipe.config import ModelConfig
from bagpipe.models import EXTERNAL, MODEL_NAMES, complete_model
from bagpipe.data.schema import Schema
from bagpipe.device import resolve_device
from bagpipe.embeddings import Embeddings, Lookup
from bagpipe.optim import BY_TORCH_CLASS
from bagpipe.train.reference import Timer
from bagpipe.runtime import transport
from bagpipe.runtime.trainer.handlers import TrainerHandlers
from bagpipe.runtime.trainer.main import join_as_trainer
from bagpipe.runtime.trainer.runtime import TrainerRuntime
from bagpipe.runtime.world import LOOPBACK, DEFAULT_PORT, World

log = logging.getLogger(__name__)



class TrainerCache:
    """What ``init_cache`` returns: one trainer's view of the job."""

    def __init__(self, runtime: TrainerRuntime) -> None:
        self.runtime = runtime
        self.num_iterations = runtime.job.iterations
        self._lookups: list[Lookup] | None = None
        self._closed = False
        # Steady-state samples/s as the bagpipe trainer counts it: the time from one next_batch() to the next.
        warmup = runtime.job.config.warmup_iterations
        self._timer = Timer(warmup=min(warmup, max(self.num_iterations - 1, 0)))
        self._tick: float | None = None

    def __len__(self) -> int:
        return self.num_iterations

    @property
    def model_config(self) -> ModelConfig:
        """The job's model as every role agreed on it (``init_cache(model=...)``; ``external``: the script's own)."""
        return self.runtime.job.config.model

    @property
    def schema(self) -> Schema:
        """The data's features: ``num_dense`` and one ``Feature`` (name, rows, width) per sparse feature."""
        return self.runtime.layout.schema

    @property
    def seed(self) -> int:
        """The job's seed: a model built after ``torch.manual_seed(cache.seed)`` starts as the bagpipe trainers'."""
        return self.runtime.job.config.seed

    @property
    def iteration(self) -> int:
        """The iteration of the batch ``next_batch`` returned last (e.g. to key ``set_dropout_step``)."""
        if self.runtime.step is None:
            raise RuntimeError("no batch yet: call next_batch() first")
        return self.runtime.step.iteration

    @property
    def index(self) -> int:
        """This trainer's rank among the trainers."""
        return self.runtime.index

    def build_model(self) -> torch.nn.Module:
        """The job's model (one of bagpipe's, named by ``init_cache(model=...)``), initialised from the job's
        seed as the bagpipe trainers and the reference initialise it."""
        config = self.model_config
        if not config.card.built:
            raise ValueError("init_cache was given no model: the script's model is its own (init_cache(model=NAME) "
                             f"names one of bagpipe's: {', '.join(MODEL_NAMES)})")
        return models.build_model(config, self.schema, seed=self.seed)

    def next_batch(self) -> dict | None:
        """The next slice of the global batch; None when the data is done (rows flushed to servers).

        ``dense_x`` float [B, num_dense], ``sparse_vector`` one id tensor per sparse feature ([B], or
        [B, W] for a multi-valued one, -1 where empty), ``target`` float [B, 1].
        """
        self._finish_iteration()
        now = time.perf_counter()
        if self._tick is not None:  # the iteration the script just finished
            done = self.runtime.stats.iterations - 1
            self._timer.record(done, self.runtime.job.config.batch_size, now - self._tick)
            if done == 0:
                self.runtime.stats.extra["first_iteration_at"] = time.time()
        self._tick = now
        message = self.runtime.advance()
        if message is None:
            return None
        schema = self.runtime.layout.schema
        features = []
        for f in range(len(schema.features)):
            start, stop = schema.columns(f)
            features.append(message.ids[:, start] if stop - start == 1 else message.ids[:, start:stop])
        return {"dense_x": message.dense_x, "sparse_vector": features, "target": message.target.view(-1, 1)}

    def get_emb(self, ls_i) -> Embeddings:
        """One tensor per table for the ids of ``next_batch()["sparse_vector"]``: [B, emb_size] (or
        [B, W, emb_size] for a multi-valued feature, zeros where empty). A list, and the ``Embeddings``
        a bagpipe model takes (with ``init_cache(model=...)``, one entry per lookup of that model's
        tables, e.g. DeepFM's factors and then its first-order weights)."""
        if self._lookups is not None:
            raise RuntimeError("get_emb was already called for this batch: call it once per next_batch()")
        ids = torch.cat([torch.as_tensor(t, dtype=torch.int64).reshape(len(t), -1) for t in ls_i], dim=1)
        if not torch.equal(ids, self.runtime.step.ids):
            raise ValueError("get_emb must be given the ids of the current batch (next_batch()['sparse_vector'])")
        embeddings, self._lookups = self.runtime.lookup()
        return embeddings

    def _finish_iteration(self) -> None:
        if self._lookups is None:
            if self.runtime.step is not None and not self.runtime.step.final:
                raise RuntimeError("next_batch() called before get_emb() for the previous batch")
            return
        if all(lookup.rows.grad is None for lookup in self._lookups):
            raise RuntimeError("backward() did not reach the embeddings of the previous batch; "
                               "call loss.backward() before next_batch()")
        self.runtime.sync(self._lookups)
        self._lookups = None

    def close(self, model: torch.nn.Module | None = None) -> None:
        """Finish (flushing every row to the servers if the data is not done) and leave the job.

        Trainer 0 may hand over its ``model`` (a DDP wrapper is unwrapped) so the oracle can
        evaluate it and write it to the run dir's model/.
        """
        if self._closed:
            return
        if self.runtime.step is None or not self.runtime.step.final:
            raise RuntimeError(f"close() before next_batch() returned None: the oracle's plan covers "
                               f"{self.num_iterations} iterations, and every one must run")
        module = getattr(model, "module", model)
        state = module.state_dict() if module is not None and self.runtime.index == 0 else None
        self.runtime.stats.samples_per_s = self._timer.samples_per_s
        self.runtime.stats.extra["timed_window"] = self._timer.window
        self.runtime.close(dense_state=state)
        self._closed = True

    exit_worker = close  # the original's name


def init_cache(lookahead_value: int = 200, emb_size: int = 1, ln_emb=(), cache_size: int = 25000,
               cleanup_batch_proportion: float = 0.25, emb_optim=None, emb_optim_params=None,
               device: str = "cuda:0", worker_id: int = 0, world_size: int | None = None,
               training_worker_id: int = 0, trainer_world_size: int | None = None, *,
               master_ip: str | None = None, master_port: int | None = None, timeout: float = 60.0,
               prefetch_depth: int | None = None, model: str | None = None,
               model_options: dict | None = None) -> TrainerCache:
    """Join the job as a trainer and return its cache (see the module docstring).

    Beyond the original's arguments: ``model`` names one of bagpipe's models (``bagpipe.models.MODEL_NAMES``)
    whose tables the job plans (default: none, the script's own model, one ``emb_size`` table per sparse
    feature), with ``model_options`` its shape settings (its card's settings, e.g. ``{"deep_mlp":
    "400-400-400"}``); every role must agree on them, and
    the oracle evaluates trainer 0's model at the end. ``cache.build_model()`` builds it.
    """
    if world_size is None or trainer_world_size is None:
        raise ValueError("init_cache needs world_size (all processes) and trainer_world_size (trainers)")
    world = World(rank=worker_id, world_size=world_size, num_trainers=trainer_world_size,
                  master_addr=master_ip or os.environ.get("MASTER_ADDR", LOOPBACK),
                  master_port=int(master_port or os.environ.get("MASTER_PORT", DEFAULT_PORT)), timeout=timeout)
    role, index = world.role
    if role != "trainer" or index != training_worker_id:
        raise ValueError(f"worker_id {worker_id} is the {role} {index} of this world (0: oracle, 1..{world.num_trainers}"
                         f": trainers, then servers), but training_worker_id is {training_worker_id}")
    device = resolve_device(device, fallback=True)  # (the original's scripts say cuda:0 on CPU-only machines too)
    given = {"kind": "script", "emb_dim": int(emb_size), "cache_rows": int(cache_size)}
    if len(ln_emb):
        given["table_sizes"] = [int(n) for n in ln_emb]
    if emb_optim is not None:
        if emb_optim not in BY_TORCH_CLASS:
            raise ValueError(f"emb_optim {emb_optim!r} is not supported: torch.optim."
                             + ", ".join(cls.__name__ for cls in BY_TORCH_CLASS))
        given["optimizer"] = BY_TORCH_CLASS[emb_optim]
    if (emb_optim_params or {}).get("lr") is not None:
        given["lr"] = float(emb_optim_params["lr"])
    given.update(_model_settings(model, model_options or {}, emb_dim=int(emb_size)))
    # Inside the user's process a lost peer fails the cache's next step; it does not end the process.
    world, store, liveness, job = join_as_trainer(world, given=given, on_lost=lambda lost: log.error("%s", lost.message))
    config = job.config
    if lookahead_value != config.lookahead or cleanup_batch_proportion != config.cleanup_fraction:
        log.info("the oracle plans with lookahead %d and cleanup %.2f (init_cache asked %d and %.2f)",
                 config.lookahead, config.cleanup_fraction, lookahead_value, cleanup_batch_proportion)
    runtime = TrainerRuntime(world, store, job=job, liveness=liveness, device=device, prefetch_depth=prefetch_depth)
    transport.serve("trainer", TrainerHandlers(runtime))
    liveness.on_lost = runtime.fail
    return TrainerCache(runtime)


def _model_settings(model: str | None, options: dict, *, emb_dim: int) -> dict:
    """``init_cache``'s model as the settings the roles agree on (``model.NAME`` keys, as runtime.agree)."""
    if model is not None and model not in MODEL_NAMES:
        raise ValueError(f"init_cache(model={model!r}): the models are {', '.join(MODEL_NAMES)} (or None: the "
                         f"script's own)")
    if options and model is None:
        raise ValueError("init_cache(model_options=...) shapes one of bagpipe's models: name it with model=")
    fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"name", "emb_dim"}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"init_cache(model_options=...): unknown setting(s) {', '.join(unknown)}; the settings are "
                         f"{', '.join(sorted(fields))}")
    # Each value's type and range, here rather than at check-in.
    ModelConfig(**complete_model({"name": model or EXTERNAL, "emb_dim": emb_dim, **options}))
    return {"model.name": model or EXTERNAL, **{f"model.{name}": value for name, value in options.items()}}
