"""FGCNN (Liu et al. 2019) trained through the original API: convolutions over the embeddings
generate new features, which with the raw ones feed an IPNN-style deep part.

Start a server and the oracle, then one trainer per worker id (here 2 trainers, world of 4)::

    bagpipe server --worker-id 3 --world-size 4
    bagpipe oracle --worker-id 0 --world-size 4 --world-size-trainers 2 --processed-csv parsed_train.txt \\
        --mini-batch-size 4096 --cache-size 25000
    python examples/fgcnn_bagpipe.py --worker-id 1 --world-size 4 --world-size-trainers 2 --conv-channels 14-16-18-20
    python examples/fgcnn_bagpipe.py --worker-id 2 --world-size 4 --world-size-trainers 2 --conv-channels 14-16-18-20

The oracle plans this model's tables (an emb_size table per feature); it learns the model and its
shape from the trainers at check-in and evaluates trainer 0's model when training ends (AUC, log-
loss).
"""

from __future__ import annotations

import torch

from example_loop import join, parse_args, sizes, train

from bagpipe.models.fgcnn import FGCNN


def add_flags(p) -> None:
    p.add_argument("--deep-mlp", default="400-400-400", help="the deep part's hidden layers (default 400-400-400)")
    p.add_argument("--conv-channels", default="14-16-18-20", help="channels per convolution (default 14-16-18-20)")
    p.add_argument("--conv-kernel", type=int, default=7, help="kernel height in fields, odd (default 7)")
    p.add_argument("--conv-pool", type=int, default=2, help="max-pooling height (default 2)")
    p.add_argument("--recombine", type=int, default=2, help="new feature maps per convolution (default 2)")


def main() -> None:
    args = parse_args(__doc__, add_flags=add_flags)
    cache = join(args, model="fgcnn", deep_mlp=args.deep_mlp, conv_channels=args.conv_channels, conv_kernel=args.conv_kernel,
                 conv_pool=args.conv_pool, recombine=args.recombine)
    schema = cache.schema
    torch.manual_seed(cache.seed)  # as the bagpipe trainers and the reference initialise it
    model = FGCNN(num_dense=schema.num_dense, num_features=len(schema.features), emb_dim=args.emb_size,
                  channels=sizes(args.conv_channels), kernel=args.conv_kernel, pool=args.conv_pool,
                  recombine=args.recombine, deep_sizes=sizes(args.deep_mlp), dropout=args.dropout)
    train(cache, model, args)


if __name__ == "__main__":
    main()
