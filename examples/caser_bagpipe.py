"""Caser (Tang & Wang 2018) trained through the original API: horizontal and vertical
convolutions over a user's last L items score the next items against sampled negatives.

Start a server and the oracle, then one trainer per worker id (here 2 trainers, world of 4)::

    bagpipe server --worker-id 3 --world-size 4
    bagpipe oracle --worker-id 0 --world-size 4 --world-size-trainers 2 --processed-csv parsed_caser.txt \\
        --mini-batch-size 512 --cache-size 25000
    python examples/caser_bagpipe.py --worker-id 1 --world-size 4 --world-size-trainers 2 --emb-size 50
    python examples/caser_bagpipe.py --worker-id 2 --world-size 4 --world-size-trainers 2 --emb-size 50

The oracle plans this model's tables (users, input items, output items and item biases; the history,
targets and negatives share the item tables); it learns the model and its shape from the trainers at
check-in and evaluates trainer 0's model when training ends (HR@10, NDCG@10 over every item).
"""

from __future__ import annotations

import torch

from example_loop import join, parse_args, train

from bagpipe.models.caser import Caser


def add_flags(p) -> None:
    p.add_argument("--vertical-filters", type=int, default=4, help="n_v (default 4)")
    p.add_argument("--horizontal-filters", type=int, default=16, help="n_h per height 1..L (default 16)")


def main() -> None:
    args = parse_args(__doc__, emb_size=50, add_flags=add_flags)
    cache = join(args, model="caser", vertical_filters=args.vertical_filters, horizontal_filters=args.horizontal_filters)
    schema = cache.schema
    torch.manual_seed(cache.seed)  # as the bagpipe trainers and the reference initialise it
    model = Caser(history=schema.features[1].width, targets=schema.features[2].width, emb_dim=args.emb_size,
                  vertical=args.vertical_filters, horizontal=args.horizontal_filters, dropout=args.dropout)
    train(cache, model, args)


if __name__ == "__main__":
    main()
