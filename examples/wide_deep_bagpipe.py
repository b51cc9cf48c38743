"""Wide & Deep (Cheng et al. 2016) trained through the original API: a linear "wide" part over
every feature and an MLP over the embeddings, summed into one logit.

Start a server and the oracle, then one trainer per worker id (here 2 trainers, world of 4)::

    bagpipe server --worker-id 3 --world-size 4
    bagpipe oracle --worker-id 0 --world-size 4 --world-size-trainers 2 --processed-csv DATA \\
        --mini-batch-size 2048 --cache-size 25000
    python examples/wide_deep_bagpipe.py --worker-id 1 --world-size 4 --world-size-trainers 2 --deep-mlp 400-400-400
    python examples/wide_deep_bagpipe.py --worker-id 2 --world-size 4 --world-size-trainers 2 --deep-mlp 400-400-400

The oracle plans this model's tables (an emb_size table and a 1-wide first-order table per feature);
it learns the model and its shape from the trainers at check-in and evaluates trainer 0's model when
training ends (AUC, log-loss).
"""

from __future__ import annotations

import torch

from example_loop import join, parse_args, sizes, train

from bagpipe.models.wide_deep import WideDeep


def add_flags(p) -> None:
    p.add_argument("--deep-mlp", default="400-400-400", help="the deep part's hidden layers (default 400-400-400)")


def main() -> None:
    args = parse_args(__doc__, add_flags=add_flags)
    cache = join(args, model="wide-deep", deep_mlp=args.deep_mlp)
    schema = cache.schema
    torch.manual_seed(cache.seed)  # as the bagpipe trainers and the reference initialise it
    model = WideDeep(num_dense=schema.num_dense, num_features=len(schema.features), emb_dim=args.emb_size,
                     deep_sizes=sizes(args.deep_mlp), dropout=args.dropout)
    train(cache, model, args)


if __name__ == "__main__":
    main()
