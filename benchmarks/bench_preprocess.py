"""Preprocessing speed (issue 12): Criteo TSV, Avazu CSV and JSON lines into the binary format, the block readers
(data.fast_tsv, data.fast_jsonl) against the line parsers they stand in for, in the same run. Criteo as published
(8-digit hex or empty, short decimals) is split and read by numpy alone (fast_tsv.separate); other TSV and CSV by
pyarrow's tokenizer (fast_tsv.split_fields).

    .venv/bin/python benchmarks/bench_preprocess.py [--rows 2000000] [--line-rows 400000] [--repeats 3]
        [--sets criteo,avazu,avazu-hashed,jsonl] [--work-dir runs/bench_preprocess]
        [--out runs/bench_preprocess/result.json]

Data, made once in --work-dir and reused: Criteo TSV from `bagpipe synth` (--rows train rows and a tenth as many
test rows, the 26 criteo-kaggle tables); Avazu CSV (Kaggle's 24 columns, Zipf-distributed values) and Criteo-shaped
JSON lines (13 dense values, 26 ids), both made here. The line parsers read about 60k rows/s, so they get the first
--line-rows rows of each set (the same shape, train and test), and the block readers are timed on those too.

For each set and reader, in turn in every repeat so that machine noise hits both alike:

- parse    the reader and parser alone, in this process: blocks read as preprocess reads them and parsed; no
           hashing, no writing (Avazu with a vocabulary: its counting pass over the train split included)
- convert  `preprocess()` whole in a fresh process (what `bagpipe preprocess` and `train --data DIR` run):
           fingerprinting the sources, reading, parsing, writing; rows/s of the call, and the peak RSS of the
           process (its RSS after imports is given too)

Beside rows/s each figure has rows per CPU second (of every thread of the process that reads): what a shared
machine's noise moves least.

The line parsers are the parsers' ``parse_lines`` / ``tokens_lines``: the code that ``parse`` / ``tokens`` ran
before the block readers, kept as their reference. Every figure is a median over --repeats, with the share of CPU
time other processes took while it was measured (``foreign_cpu``, as bench_reference.py records it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from bagpipe.synth import generate, resolve_table_sizes

FOREIGN_CPU_WARN = 0.10
AVAZU_CARDINALITIES = {  # about Kaggle's train.csv's distinct values per column
    "hour": 240, "C1": 7, "banner_pos": 7, "site_id": 4_700, "site_domain": 7_700, "site_category": 26,
    "app_id": 8_500, "app_domain": 550, "app_category": 36, "device_id": 2_600_000, "device_ip": 6_700_000,
    "device_model": 8_200, "device_type": 5, "device_conn_type": 4, "C14": 2_600, "C15": 8, "C16": 9, "C17": 435,
    "C18": 4, "C19": 68, "C20": 172, "C21": 60}
JSONL_TABLE_ROWS = 100_000


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# How busy the rest of the machine was (/proc/stat); this process's children count as its own.


def cpu_snapshot() -> tuple[float, float, float] | None:
    try:
        with open("/proc/stat") as handle:
            fields = [int(x) for x in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    own = os.times()
    return (time.perf_counter(), (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"),
            own.user + own.system + own.children_user + own.children_system)


def foreign_fraction(start, end) -> float | None:
    if start is None or end is None or end[0] - start[0] <= 0.05:
        return None
    foreign = (end[1] - start[1]) - (end[2] - start[2])
    return round(max(foreign, 0.0) / ((os.cpu_count() or 1) * (end[0] - start[0])), 3)


@contextmanager
def line_parsers_only():
    """The block readers switched off: every block goes to the line parsers."""
    import bagpipe.data.fast_jsonl as fast_jsonl
    import bagpipe.data.fast_tsv as fast_tsv

    readers = [(module, name) for module, names in ((fast_tsv, ("separate", "split_fields")),
                                                     (fast_jsonl, ("one_hot_rows",))) for name in names
               if hasattr(module, name)]  # an older tree has no fast_tsv.separate
    saved = [getattr(module, name) for module, name in readers]
    for module, name in readers:
        setattr(module, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for (module, name), reader in zip(readers, saved):
            setattr(module, name, reader)


# ---------------------------------------------------------------------------------------------
# Data


def criteo_set(work: Path, rows: int) -> Path:
    out = work / f"criteo-{rows}"
    if not (out / "meta.json").is_file():
        say(f"bagpipe synth: {rows:,} + {rows // 10:,} rows into {out}")
        sizes = resolve_table_sizes(tables="criteo-kaggle", table_sizes=None)
        generate(out, rows=rows, test_rows=rows // 10, seed=0, table_sizes=sizes, show_progress=False)
    return out


def avazu_lines(rows: int, *, seed: int) -> list[str]:
    from bagpipe.data.avazu import COLUMNS

    rng = np.random.default_rng(seed)
    columns = [np.char.mod("%d", 10**18 + seed * rows + np.arange(rows)), np.char.mod("%d", rng.random(rows) < 0.17)]
    for name in COLUMNS[2:]:
        ranks = np.minimum(rng.zipf(1.3, rows), AVAZU_CARDINALITIES[name]) - 1
        if name == "hour":
            columns.append(np.char.mod("%d", 14102100 + ranks))
        elif name in ("banner_pos", "device_type", "device_conn_type") or name.startswith("C"):
            columns.append(np.char.mod("%d", ranks))
        else:  # Avazu's ids are 8 hex digits
            columns.append(np.char.mod("%08x", (ranks * 2654435761) % (1 << 32)))
    line = columns[0]
    for column in columns[1:]:
        line = np.char.add(np.char.add(line, ","), column)
    return line.tolist()


def avazu_set(work: Path, rows: int) -> Path:
    from bagpipe.data.avazu import COLUMNS

    out = work / f"avazu-{rows}"
    if not (out / "test.csv").is_file():
        say(f"Avazu CSV: {rows:,} + {rows // 10:,} rows into {out}")
        out.mkdir(parents=True, exist_ok=True)
        for split, count, seed in (("train", rows, 0), ("test", rows // 10, 1)):
            with open(out / f"{split}.csv", "w") as handle:
                handle.write(",".join(COLUMNS) + "\n")
                for start in range(0, count, 100_000):
                    handle.write("\n".join(avazu_lines(min(100_000, count - start), seed=seed * 1000 + start)) + "\n")
    return out


def jsonl_set(work: Path, rows: int) -> Path:
    out = work / f"jsonl-{rows}"
    if not (out / "test.jsonl").is_file():
        say(f"JSON lines: {rows:,} + {rows // 10:,} rows into {out}")
        out.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        for split, count in (("train", rows), ("test", rows // 10)):
            with open(out / f"{split}.jsonl", "w") as handle:
                for start in range(0, count, 100_000):
                    n = min(100_000, count - start)
                    labels = rng.integers(0, 2, n).tolist()
                    dense = rng.integers(0, 1000, (n, 13)).astype(float).tolist()
                    ids = rng.zipf(1.2, (n, 26)) % JSONL_TABLE_ROWS
                    handle.writelines(json.dumps({"label": label, "dense": d, "sparse": s}) + "\n"
                                      for label, d, s in zip(labels, dense, ids.tolist()))
        (out / "meta.json").write_text(json.dumps({"table_sizes": [JSONL_TABLE_ROWS] * 26}))
    return out


def prefix_of(source: Path, rows: int, work: Path) -> Path:
    """The first ``rows`` lines of each split (and a tenth as many of the test split), beside a copy of meta.json."""
    out = work / f"{source.name}-first-{rows}"
    if not out.is_dir():
        out.mkdir(parents=True)
        for path in sorted(source.iterdir()):
            if path.name == "meta.json":
                (out / path.name).write_bytes(path.read_bytes())
            elif path.is_file():
                keep = (rows if path.name.startswith("train") else rows // 10) + (path.suffix == ".csv")  # a header
                with open(path, "rb") as src, open(out / path.name, "wb") as dst:
                    dst.writelines(line for _, line in zip(range(keep), src))
    return out


# ---------------------------------------------------------------------------------------------
# Measurements


SETTINGS = {  # preprocess() settings of each set: Avazu with the vocabulary `train --data` gives it
    "criteo": {}, "avazu": {"vocab_min_count": 1}, "avazu-hashed": {"table_sizes": [1 << 20] * 22}, "jsonl": {}}


def parse_rate(source: Path, name: str) -> dict:
    """Rows/s of the reader and parser alone (no hashing, no writing)."""
    import bagpipe.data.preprocess as pre
    import bagpipe.data.sources as sources

    settings = SETTINGS[name]
    splits = sources.find_splits(source)
    vocab_min_count = settings.get("vocab_min_count", 0)
    sizes = None if vocab_min_count else sources.table_sizes_from(table_sizes=settings.get("table_sizes"),
                                                                  meta_file=None, input_path=source)[0]
    started, cpu, rows = time.perf_counter(), time.process_time(), 0
    # With a vocabulary, its counting pass over the train split (in _text_parser) is part of the time.
    parser, _ = pre._text_parser(sources.guess_format(splits["train"]), splits, sizes=sizes,
                                 vocab_min_count=vocab_min_count, test_from=None, on_bad_row="error",
                                 show_progress=False)
    for path in splits.values():
        for first_line, block in pre._read_chunks(path, show_progress=False, desc=""):
            rows += len(parser.parse(block, path=str(path), first_line=first_line, bad=None).labels)
    return {"rows": rows, "seconds": time.perf_counter() - started, "cpu_s": time.process_time() - cpu}


def convert_in_child(source: Path, name: str, out: Path, reader: str) -> dict:
    """``preprocess()`` in a fresh process: its rows/s and peak RSS."""
    command = [sys.executable, __file__, "--convert", str(source), str(out), name, reader]
    child = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed")
    return json.loads(child.stdout)


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: unlike ru_maxrss it starts again at exec, not at the parent's peak)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def convert_here(source: str, out: str, name: str, reader: str) -> None:
    """The child's side: import, convert, print the timing and the peak RSS."""
    from bagpipe.data.preprocess import preprocess

    rss_after_imports = peak_rss_mb()
    started, cpu = time.perf_counter(), time.process_time()
    if reader == "lines":
        with line_parsers_only():
            meta = preprocess(source, out, show_progress=False, **SETTINGS[name])
    else:
        meta = preprocess(source, out, show_progress=False, **SETTINGS[name])
    seconds = time.perf_counter() - started
    print(json.dumps({"rows": sum(meta["rows"].values()), "seconds": seconds, "cpu_s": time.process_time() - cpu,
                      "rss_after_imports_mb": round(rss_after_imports, 1), "peak_rss_mb": round(peak_rss_mb(), 1)}))


def measure(kind: str, source: Path, name: str, reader: str, work: Path) -> dict:
    start = cpu_snapshot()
    if kind == "convert":
        result = convert_in_child(source, name, work / f"out-{name}-{reader}", reader)
    elif reader == "lines":
        with line_parsers_only():
            result = parse_rate(source, name)
    else:
        result = parse_rate(source, name)
    return {**result, "rows_per_s": result["rows"] / result["seconds"],
            "rows_per_cpu_s": result["rows"] / result["cpu_s"], "foreign_cpu": foreign_fraction(start, cpu_snapshot())}


def json_decode_rates(path: Path, lines: int) -> dict:
    """Lines/s of json.loads and orjson.loads alone, over the first ``lines`` lines of ``path``."""
    import orjson

    with open(path, "rb") as handle:
        sample = [line for _, line in zip(range(lines), handle)]
    rates = {}
    for name, loads in (("json.loads", lambda line: json.loads(line.decode())), ("orjson.loads", orjson.loads)):
        started = time.perf_counter()
        for line in sample:
            loads(line)
        rates[name] = round(len(sample) / (time.perf_counter() - started))
    return rates


def medians(samples: list[dict]) -> dict:
    rates = [s["rows_per_s"] for s in samples]
    result = {"median_rows_per_s": round(statistics.median(rates)), "min_rows_per_s": round(min(rates)),
              "max_rows_per_s": round(max(rates)), "rows": samples[0]["rows"],
              "median_rows_per_cpu_s": round(statistics.median(s["rows_per_cpu_s"] for s in samples)),
              "worst_foreign_cpu": max((s["foreign_cpu"] or 0.0 for s in samples), default=None)}
    if "peak_rss_mb" in samples[0]:
        result["median_peak_rss_mb"] = statistics.median(s["peak_rss_mb"] for s in samples)
        result["median_rss_after_imports_mb"] = statistics.median(s["rss_after_imports_mb"] for s in samples)
    return result


def markdown(result: dict) -> str:
    lines = ["| set | rows | measure | reader | median rows/s | min to max | rows per CPU second | "
             "peak RSS (after imports) | foreign CPU |", "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for key, value in result["figures"].items():
        name, size, kind, reader = key.split("/")
        rss = (f"{value['median_peak_rss_mb']:.0f} MB ({value['median_rss_after_imports_mb']:.0f})"
               if "median_peak_rss_mb" in value else "")
        lines.append(f"| {name} | {value['rows']:,} | {kind} | {reader} | {value['median_rows_per_s']:,} "
                     f"| {value['min_rows_per_s']:,} to {value['max_rows_per_s']:,} "
                     f"| {value['median_rows_per_cpu_s']:,} | {rss} "
                     f"| {value['worst_foreign_cpu']} |")
    lines.append("")
    for name, ratio in result["speedups"].items():
        lines.append(f"- {name}: blocks / lines = {ratio:.1f}x")
    lines.append(f"- JSON decoding alone, lines/s: {result['json_decode']}")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--convert":
        convert_here(*sys.argv[2:6])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000, help="Criteo train rows for the block readers")
    parser.add_argument("--line-rows", type=int, default=400_000,
                        help="train rows of each set that both readers convert (the line parsers are slow)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sets", default="criteo,avazu,avazu-hashed,jsonl", help="which of the data sets to time")
    parser.add_argument("--work-dir", default="runs/bench_preprocess")
    parser.add_argument("--out", default="runs/bench_preprocess/result.json")
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    criteo = criteo_set(work, args.rows)
    sets = {  # (name, source, readers)
        f"criteo/{args.rows}": ("criteo", criteo, ("blocks",)),
        f"criteo/{args.line_rows}": ("criteo", prefix_of(criteo, args.line_rows, work), ("blocks", "lines")),
        f"avazu/{args.line_rows}": ("avazu", avazu_set(work, args.line_rows), ("blocks", "lines")),
        f"avazu-hashed/{args.line_rows}": ("avazu-hashed", avazu_set(work, args.line_rows), ("blocks", "lines")),
        f"jsonl/{args.line_rows}": ("jsonl", jsonl_set(work, args.line_rows), ("blocks", "lines")),
    }
    sets = {key: value for key, value in sets.items() if value[0] in args.sets.split(",")}
    samples: dict[str, list[dict]] = {}
    load_before = os.getloadavg()
    for repeat in range(args.repeats):
        for key, (name, source, readers) in sets.items():
            for kind in ("parse", "convert"):
                for reader in readers:
                    say(f"repeat {repeat + 1}/{args.repeats}: {key} {kind} {reader}")
                    sample = measure(kind, source, name, reader, work)
                    samples.setdefault(f"{key}/{kind}/{reader}", []).append(sample)
                    say(f"  {sample['rows_per_s']:,.0f} rows/s, foreign CPU {sample['foreign_cpu']}")
    figures = {key: medians(value) for key, value in samples.items()}
    speedups = {}
    for key, (name, _, readers) in sets.items():
        if "lines" in readers:
            for kind in ("parse", "convert"):
                speedups[f"{key} {kind}"] = (figures[f"{key}/{kind}/blocks"]["median_rows_per_s"]
                                             / figures[f"{key}/{kind}/lines"]["median_rows_per_s"])
    result = {"command": " ".join([".venv/bin/python", "benchmarks/bench_preprocess.py", *sys.argv[1:]]),
              "cpu_count": os.cpu_count(), "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "figures": figures, "speedups": speedups,
              "json_decode": json_decode_rates(jsonl_set(work, args.line_rows) / "train.jsonl", 100_000),
              "samples": samples}
    worst = max((f["worst_foreign_cpu"] or 0.0) for f in figures.values())
    if worst > FOREIGN_CPU_WARN:
        say(f"WARNING: other processes took up to {worst:.0%} of the CPU during a measurement")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
