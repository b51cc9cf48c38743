"""A DLRM trainer written against the original BagPipe API (only the import is ours).

Start the oracle and the servers, then one of these per trainer, e.g. for 2 servers and
2 trainers on this machine (world = 1 oracle + 2 servers + 2 trainers = 5):

    bagpipe oracle --processed-csv DATA --run-dir RUN --mini-batch-size 2048 --cache-size 25000 \\
        --worker-id 0 --world-size 5 --world-size-trainers 2 --master-port 29500
    bagpipe server --worker-id 3 --world-size 5 --world-size-trainers 2 --master-port 29500
    bagpipe server --worker-id 4 --world-size 5 --world-size-trainers 2 --master-port 29500
    python examples/dlrm_bagpipe.py --worker-id 1 --training-worker-id 0 --world-size 5 \\
        --world-size-trainers 2 --master-port 29500 --dist-port 29600 --emb-info-file SIZES ...
    python examples/dlrm_bagpipe.py --worker-id 2 --training-worker-id 1 ...

The script creates the trainers' own process group after ``init_cache`` (as the original does)
and wraps the dense MLPs in DDP; the cache syncs and updates the embeddings itself.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from BagPipe import init_cache
from bagpipe.models.dlrm import DLRM

OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker-id", type=int, required=True, help="rank among all processes of the job")
    p.add_argument("--training-worker-id", type=int, required=True, help="rank among the trainers")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--world-size-trainers", type=int, required=True)
    p.add_argument("--master-ip", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29500, help="the oracle's store port")
    p.add_argument("--dist-port", type=int, default=29600, help="this script's own process group")
    p.add_argument("--no-ddp", action="store_true", help="no default process group: one trainer only")
    p.add_argument("--emb-info-file", required=True, help="one table size per line")
    p.add_argument("--emb-size", type=int, default=16)
    p.add_argument("--cache-size", type=int, default=25000)
    p.add_argument("--lookahead-value", type=int, default=200)
    p.add_argument("--cleanup-batch-proportion", type=float, default=0.0)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adagrad")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0, help="the oracle's --seed (the dense initialisation)")
    p.add_argument("--arch-mlp-bot", default="13-512-256-16")
    p.add_argument("--arch-mlp-top", default="512-256-1")
    p.add_argument("--device", default="cuda:0")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s trainer[{args.training_worker_id}] %(message)s")
    ln_emb = [int(line) for line in open(args.emb_info_file).read().split()]
    optimizer = OPTIMIZERS[args.optimizer]
    cache = init_cache(lookahead_value=args.lookahead_value, emb_size=args.emb_size, ln_emb=ln_emb,
                       cache_size=args.cache_size, cleanup_batch_proportion=args.cleanup_batch_proportion,
                       emb_optim=optimizer, emb_optim_params={"lr": args.lr}, device=args.device,
                       worker_id=args.worker_id, world_size=args.world_size,
                       training_worker_id=args.training_worker_id, trainer_world_size=args.world_size_trainers,
                       master_ip=args.master_ip, master_port=args.master_port)

    torch.manual_seed(args.seed)  # every trainer starts from the same dense weights
    model = DLRM(num_tables=len(ln_emb), emb_dim=args.emb_size,
                 bottom_sizes=[int(x) for x in args.arch_mlp_bot.split("-")],
                 top_sizes=[int(x) for x in args.arch_mlp_top.split("-")])
    if not args.no_ddp:
        dist.init_process_group("gloo", init_method=f"tcp://{args.master_ip}:{args.dist_port}",
                                rank=args.training_worker_id, world_size=args.world_size_trainers,
                                timeout=timedelta(seconds=60))
        model = DistributedDataParallel(model)
    dense_optimizer = optimizer(model.parameters(), lr=args.lr)

    step = 0
    while (batch := cache.next_batch()) is not None:
        embeddings = cache.get_emb(batch["sparse_vector"])  # one [B, emb_size] tensor per table
        logits = model(batch["dense_x"], torch.stack(embeddings, dim=1))
        loss = F.binary_cross_entropy_with_logits(logits, batch["target"].view(-1))
        dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        dense_optimizer.step()
        step += 1
        if step % 50 == 0 and args.training_worker_id == 0:
            logging.info("iteration %d/%d: local loss %.4f", step, len(cache), loss.item())
    cache.close(model)
    if not args.no_ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
