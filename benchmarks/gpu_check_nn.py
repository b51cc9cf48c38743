"""A first look at bagpipe.nn on a GPU (its CUDA path had never run): does CachedEmbeddingBag(device="cuda") train
as nn.EmbeddingBag(sparse=True) + RowWise does on the same GPU, and how fast, against the table whole on the GPU.

    python benchmarks/gpu_check_nn.py [--out FILE.json] [--rows N --dim D --cache-fraction F --batches B]

Every case runs in a try block and is reported as it ended (equal, differing by so much, or the error and
where it was raised): finding what breaks is the point. Exits 1 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import torch
from torch import nn

from bagpipe.nn import CachedEmbeddingBag, Lookahead
from bagpipe.optim import RowWise, make_row_optimizer
from bagpipe.synth import zipf_bags

NUM_ROWS, DIM = 400, 6


def loss_of(embeddings: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((embeddings - target) ** 2).sum()


def exactness(optimizer: str, policy: str, device: str) -> dict:
    """40 batches with evictions every iteration: the cached module against the reference on ``device``."""
    data = zipf_bags(40, num_rows=NUM_ROWS, dim=DIM)
    weight = torch.randn(NUM_ROWS, DIM, generator=torch.Generator().manual_seed(0))
    reference = nn.EmbeddingBag(NUM_ROWS, DIM, mode="sum", sparse=True, _weight=weight.clone().to(device))
    reference_optimizer = RowWise(reference.parameters(), make_row_optimizer(optimizer, lr=0.05))
    for ids, offsets, target in data:
        reference_optimizer.zero_grad()
        loss_of(reference(ids.to(device), offsets.to(device)), target.to(device)).backward()
        reference_optimizer.step()
    cached = CachedEmbeddingBag(NUM_ROWS, DIM, cache_rows=60, mode="sum", optimizer=optimizer, lr=0.05,
                                policy="lru" if policy.startswith("lookahead") else policy, _weight=weight.clone(),
                                device=device)
    loop = (Lookahead(data, cached, lookahead=8, prefetch=policy == "lookahead-prefetch")
            if policy.startswith("lookahead") else data)
    for ids, offsets, target in loop:
        loss_of(cached(ids.to(device), offsets.to(device)), target.to(device)).backward()
    if device != "cpu":
        torch.cuda.synchronize()
    want, got = reference.weight.detach().cpu(), cached.weight.detach().cpu()
    return {"equal": bool(torch.equal(want, got)), "max_abs_diff": float((want - got).abs().max()),
            "rows_fetched": int(cached.rows.stats["rows_fetched"]),
            "rows_written_back": int(cached.rows.stats["rows_written_back"])}


def throughput(*, rows: int, dim: int, cache_fraction: float, num_batches: int, bags: int) -> dict:
    """Batches per second: the table whole on the GPU (nn.EmbeddingBag + RowWise, Adagrad) against the cached
    module with the table in host memory, LRU and lookahead; medians of 3 alternated repeats."""
    data = zipf_bags(num_batches, num_rows=rows, dim=dim, bags=bags, ids_per_bag=26, skew=1.2, seed=1)
    weight = torch.randn(rows, dim, generator=torch.Generator().manual_seed(0))
    cache_rows = max(int(rows * cache_fraction), 26 * bags)
    timings: dict[str, list[float]] = {"whole on the GPU": [], "cached lru": [], "cached lookahead": []}

    def run(name: str) -> None:
        if name == "whole on the GPU":
            module = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, _weight=weight.clone().cuda())
            stepper = RowWise(module.parameters(), make_row_optimizer("adagrad", lr=0.05))
            loop = data
        else:
            module = CachedEmbeddingBag(rows, dim, cache_rows=cache_rows, mode="sum", optimizer="adagrad", lr=0.05,
                                        _weight=weight.clone(), device="cuda")
            stepper = None
            loop = Lookahead(data, module, lookahead=16) if name.endswith("lookahead") else data
        torch.cuda.synchronize()
        started = time.perf_counter()
        for ids, offsets, target in loop:
            if stepper is not None:
                stepper.zero_grad()
            loss_of(module(ids.cuda(non_blocking=True), offsets.cuda(non_blocking=True)),
                    target.cuda(non_blocking=True)).backward()
            if stepper is not None:
                stepper.step()
        torch.cuda.synchronize()
        timings[name].append(num_batches / (time.perf_counter() - started))

    for _ in range(3):
        for name in timings:
            run(name)
    medians = {name: statistics.median(values) for name, values in timings.items()}
    base = medians["whole on the GPU"]
    return {"rows": rows, "dim": dim, "cache_rows": cache_rows, "batches": num_batches, "bags_per_batch": bags,
            "batches_per_s": medians, "vs_whole_on_the_gpu": {name: value / base for name, value in medians.items()},
            "repeats": timings}


def attempt(function, *args, **kwargs) -> dict:
    try:
        return {"ok": True, **function(*args, **kwargs)}
    except Exception as err:  # noqa: BLE001 - what breaks is the finding
        return {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--cache-fraction", type=float, default=0.05)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--bags", type=int, default=2048, help="bags (samples) per batch, 26 ids each")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: nothing to check", file=sys.stderr)
        return 1
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "exactness": {}}
    for optimizer in ("sgd", "adagrad", "adam"):
        for policy in ("lru", "lfu", "lookahead", "lookahead-prefetch"):
            case = attempt(exactness, optimizer, policy, "cuda")
            result["exactness"][f"{optimizer}/{policy}"] = case
            print(f"{optimizer:8s} {policy:20s} {json.dumps({k: v for k, v in case.items() if k != 'traceback'})}",
                  flush=True)
    result["throughput"] = attempt(throughput, rows=args.rows, dim=args.dim, cache_fraction=args.cache_fraction,
                                   num_batches=args.batches, bags=args.bags)
    print(json.dumps({k: v for k, v in result["throughput"].items() if k not in ("traceback", "repeats")}), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
