"""What the per-model example trainers share: the original trainers' flags, joining the job with one
of bagpipe's models (``init_cache(model=...)``), and a plain PyTorch loop: DDP on the dense part, the
cache on the embeddings.

Each ``examples/<model>_bagpipe.py`` builds its model from its class and hands it to ``train``. With
the same settings as ``bagpipe train --mode bagpipe`` the result equals it (and ``--mode reference
--slices T``) bit for bit: the model starts from the job's seed, dropout is keyed by (seed,
iteration, trainer), and DDP averages the dense gradients as the bagpipe trainers do.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bagpipe import init_cache
from bagpipe.api import TrainerCache
from bagpipe.models.layers import set_dropout_step

OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}


def parse_args(description: str, *, emb_size: int = 16, add_flags=None) -> argparse.Namespace:
    """The original trainer's flags (``trainer_main.py``'s), and the model's own from ``add_flags(parser)``."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker-id", type=int, required=True, help="rank among all processes (trainers: 1..T)")
    p.add_argument("--world-size", type=int, required=True, help="oracle + trainers + servers")
    p.add_argument("--world-size-trainers", type=int, required=True, help="trainers in the job")
    p.add_argument("--master-ip", default="127.0.0.1", help="the oracle's address (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=None, help="the oracle's store port (default $MASTER_PORT, "
                   "else 18000)")
    p.add_argument("--dist-port", type=int, default=9988, help="this script's own DDP group, on trainer 0's "
                   "--master-ip (default 9988)")
    p.add_argument("--emb-size", type=int, default=emb_size, help=f"embedding width (default {emb_size})")
    p.add_argument("--cache-size", type=int, default=25000, help="rows each trainer caches (default 25000)")
    p.add_argument("--lookahead-val", type=int, default=200, help="batches planned ahead (default 200)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adagrad", help="default adagrad")
    p.add_argument("--lr", type=float, default=0.01, help="default 0.01")
    p.add_argument("--dropout", type=float, default=0.0, help="the deep part's dropout (default 0)")
    p.add_argument("--device", default="cuda:0", help="where the cache lives (default cuda:0; the CPU without one)")
    if add_flags is not None:
        add_flags(p)
    return p.parse_args()


def join(args: argparse.Namespace, *, model: str, **options) -> TrainerCache:
    """``init_cache`` for trainer ``--worker-id`` of a job planned for ``model`` of shape ``options``."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s trainer[{args.worker_id - 1}] %(message)s")
    optimizer = OPTIMIZERS[args.optimizer]
    return init_cache(lookahead_value=args.lookahead_val, emb_size=args.emb_size, cache_size=args.cache_size,
                      emb_optim=optimizer, emb_optim_params={"lr": args.lr}, device=args.device,
                      worker_id=args.worker_id, world_size=args.world_size, training_worker_id=args.worker_id - 1,
                      trainer_world_size=args.world_size_trainers, master_ip=args.master_ip,
                      master_port=args.master_port, model=model, model_options={"dropout": args.dropout, **options})


def train(cache: TrainerCache, model: nn.Module, args: argparse.Namespace) -> None:
    """Every batch of the oracle's plan: forward, the model's loss, backward, the dense step (the cache
    steps the embeddings); trainer 0 hands its model to the oracle, which evaluates it."""
    # A bounded wait: a trainer that never joins is an error within a minute, not a hang.
    dist.init_process_group("gloo", init_method=f"tcp://{args.master_ip}:{args.dist_port}", rank=cache.index,
                            world_size=args.world_size_trainers, timeout=timedelta(seconds=60))
    ddp = DistributedDataParallel(model)
    optimizer = OPTIMIZERS[args.optimizer](ddp.parameters(), lr=args.lr)
    while (batch := cache.next_batch()) is not None:
        set_dropout_step(model, seed=cache.seed, iteration=cache.iteration, part=cache.index)
        output = ddp(batch["dense_x"], cache.get_emb(batch["sparse_vector"]))
        loss = model.loss(output, batch["target"].view(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if cache.index == 0 and (cache.iteration + 1) % 50 == 0:
            logging.info("iteration %d/%d: loss %.4f", cache.iteration + 1, len(cache), loss.item())
    cache.close(model)
    dist.destroy_process_group()


def sizes(text: str) -> tuple[int, ...]:
    """``"400-400-400"`` as (400, 400, 400)."""
    return tuple(int(size) for size in text.split("-"))
