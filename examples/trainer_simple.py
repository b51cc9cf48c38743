"""The original system's quick-start trainer, written for bagpipe: its own small model, DDP on its
MLPs, the embeddings from the cache. Two trainers (worker ids 1 and 2 of a world of 4); start the
server and the oracle as the original README does:

    python examples/trainer_simple.py            # both trainers
    bagpipe server --worker-id 3 --world-size 4 --master-ip 127.0.0.1
    bagpipe oracle --prefetch --lookahead-value 200 --mini-batch-size=4096 --dataset-multiprocessing \\
        --worker-id 0 --world-size 4 --cache --master-ip 127.0.0.1 --world-size-trainers 2 \\
        --processed-csv kaggle_criteo_weekly.txt --cache-size 5000000

The table sizes are Criteo Kaggle's unless ``--emb-info-file`` names others (one per line); the
job's store is on $MASTER_PORT (18000, as the original sets it), the trainers' own DDP group on
``--dist-port`` (9988). The embedding optimizer (SGD, lr 0.01) and width (48) are the original's,
and the oracle agrees them with the other roles at check-in. The original stops after 100
iterations (and kills every process); this trains the oracle's whole plan (its --iterations, by
default one pass over the data) and every role then exits by itself.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel

from BagPipe import init_cache

CRITEO_KAGGLE = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
EMB_SIZE = 48


class SimpleModel(nn.Module):
    """A bottom MLP for the dense features, the embeddings beside it, a top MLP: a probability."""

    def __init__(self, num_tables: int, num_dense: int = 13) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(num_dense, 64), nn.Linear(64, EMB_SIZE), nn.ReLU())
        self.top = nn.Sequential(nn.Linear((num_tables + 1) * EMB_SIZE, 256), nn.Linear(256, 1), nn.Sigmoid())

    def forward(self, dense_x: torch.Tensor, embeddings: list[torch.Tensor]) -> torch.Tensor:
        return self.top(torch.cat([self.bottom(dense_x), *embeddings], dim=1))


def train(rank: int, trainer: int, world_size: int, trainers: int, ip: str, ln_emb: list[int], dist_port: int) -> None:
    os.environ["MASTER_ADDR"] = ip
    os.environ.setdefault("MASTER_PORT", "18000")
    cache = init_cache(emb_size=EMB_SIZE, ln_emb=ln_emb, cache_size=5000000, device="cuda:0",
                       cleanup_batch_proportion=0.25, worker_id=rank, world_size=world_size,
                       training_worker_id=trainer, trainer_world_size=trainers,
                       emb_optim=optim.SGD, emb_optim_params={"lr": 0.01})
    torch.manual_seed(0)  # the same dense weights on every trainer
    model = SimpleModel(len(ln_emb))
    dist.init_process_group("gloo", init_method=f"tcp://{ip}:{dist_port}", world_size=trainers, rank=trainer,
                            timeout=timedelta(seconds=60))
    model.top, model.bottom = DistributedDataParallel(model.top), DistributedDataParallel(model.bottom)
    optimizer = optim.SGD([{"params": model.top.parameters(), "lr": 0.01},
                           {"params": model.bottom.parameters(), "lr": 0.01}])
    loss_fn = nn.BCELoss()
    while (batch := cache.next_batch()) is not None:  # the oracle's plan: --iterations, or one pass
        loss = loss_fn(model(batch["dense_x"], cache.get_emb(batch["sparse_vector"])), batch["target"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    cache.close(model)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--emb-info-file", default=None, help="one table size per line (default: Criteo Kaggle's)")
    p.add_argument("--dist-port", type=int, default=9988, help="the trainers' DDP group (default 9988)")
    args = p.parse_args()
    ln_emb = [int(n) for n in open(args.emb_info_file).read().split()] if args.emb_info_file else CRITEO_KAGGLE
    world_size, trainers = 4, 2
    mp.set_start_method("spawn")
    processes = [mp.Process(target=train, args=(trainer + 1, trainer, world_size, trainers, "127.0.0.1", ln_emb,
                                               args.dist_port)) for trainer in range(trainers)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    raise SystemExit(max(process.exitcode for process in processes))


if __name__ == "__main__":
    main()
