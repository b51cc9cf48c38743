"""DCN (Wang et al. 2017) trained through the original API: a cross network beside an MLP;
``--cross-kind matrix`` (and ``--cross-rank r``) gives DCN-v2's (low-rank) cross layers.

Start a server and the oracle, then one trainer per worker id (here 2 trainers, world of 4)::

    bagpipe server --worker-id 3 --world-size 4
    bagpipe oracle --worker-id 0 --world-size 4 --world-size-trainers 2 --processed-csv DATA \\
        --mini-batch-size 2048 --cache-size 25000
    python examples/dcn_bagpipe.py --worker-id 1 --world-size 4 --world-size-trainers 2 --cross-layers 3
    python examples/dcn_bagpipe.py --worker-id 2 --world-size 4 --world-size-trainers 2 --cross-layers 3

The oracle plans this model's tables (an emb_size table per feature); it learns the model and its
shape from the trainers at check-in and evaluates trainer 0's model when training ends (AUC, log-
loss).
"""

from __future__ import annotations

import torch

from example_loop import join, parse_args, sizes, train

from bagpipe.models.dcn import DCN


def add_flags(p) -> None:
    p.add_argument("--deep-mlp", default="400-400-400", help="the deep part's hidden layers (default 400-400-400)")
    p.add_argument("--cross-layers", type=int, default=3, help="cross layers (default 3)")
    p.add_argument("--cross-kind", choices=("vector", "matrix"), default="vector", help="DCN's vector or DCN-v2's "
                   "matrix cross (default vector)")
    p.add_argument("--cross-rank", type=int, default=0, help="matrix: 0 full, r > 0 a rank-r U V^T (default 0)")


def main() -> None:
    args = parse_args(__doc__, add_flags=add_flags)
    cache = join(args, model="dcn", deep_mlp=args.deep_mlp, cross_layers=args.cross_layers, cross_kind=args.cross_kind,
                 cross_rank=args.cross_rank)
    schema = cache.schema
    torch.manual_seed(cache.seed)  # as the bagpipe trainers and the reference initialise it
    model = DCN(num_dense=schema.num_dense, num_features=len(schema.features), emb_dim=args.emb_size,
                deep_sizes=sizes(args.deep_mlp), cross_layers=args.cross_layers, cross_kind=args.cross_kind,
                cross_rank=args.cross_rank, dropout=args.dropout)
    train(cache, model, args)


if __name__ == "__main__":
    main()
