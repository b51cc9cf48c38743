"""The original system's README command lines, run as written (``python embedding_server.py`` ->
``bagpipe server`` and so on, addresses on one machine), on small data: every role exits by itself.

The store's port comes from $MASTER_PORT (the command lines name none; the original's default is
18000), so that a test never collides with another process on that port.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from bagpipe.data.binary import open_dataset
from bagpipe.data.preprocess import preprocess
from bagpipe.model_dir import ModelDir
from bagpipe.runtime.world import free_port
from bagpipe.synth import generate
from bagpipe.synth_sequences import generate_sequences
from helpers.cli_processes import CliProcess
from helpers.original import ROOT, bagpipe_line, run_job, script_line

SIZES = [40] * 26
ROWS = 20_000


@pytest.fixture(scope="module")
def criteo_arrays(tmp_path_factory) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Labels, dense values and ids of small Criteo-shaped data."""
    out = tmp_path_factory.mktemp("criteo")
    generate(out / "tsv", rows=ROWS, test_rows=10, seed=4, table_sizes=SIZES, show_progress=False)
    preprocess(out / "tsv", out / "bin", show_progress=False, holdout=0)
    split = open_dataset(out / "bin").train
    return np.asarray(split.labels), np.asarray(split.dense), np.asarray(split.ids)


def layout(tmp_path: Path) -> Path:
    """root/ holds the data, root/a/ a copy of the table sizes; commands run in root/a/b (the original's
    lines reach their files as ../ and ../../)."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    return tmp_path / "a" / "b"


def write_lines(path: Path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def finished_run(cwd: Path) -> tuple[dict, dict]:
    """The summary and config of the one run the job wrote under ``cwd``/runs (the oracle's default run dir)."""
    run_dir = next((cwd / "runs").glob("oracle-*"))
    return json.loads((run_dir / "summary.json").read_text()), json.loads((run_dir / "config.json").read_text())


def write_sizes(root: Path, sizes: list[int]) -> None:
    for folder in (root, root / "a"):
        (folder / "emb_table_info.txt").write_text("".join(f"{n}\n" for n in sizes))


def test_the_quick_start_as_written(criteo_arrays, tmp_path):
    labels, dense, ids = criteo_arrays
    cwd = layout(tmp_path)
    write_lines(tmp_path / "kaggle_criteo_weekly.txt",
                ({"label": int(l), "dense": d.tolist(), "sparse": i.tolist()} for l, d, i in zip(labels, dense, ids)))
    (tmp_path / "sizes.txt").write_text("".join(f"{n}\n" for n in SIZES))
    texts = run_job([
        script_line(ROOT / "examples" / "trainer_simple.py", "--emb-info-file", "../../sizes.txt",
                    "--dist-port", str(free_port())),
        bagpipe_line("server --worker-id 3 --world-size 4 --master-ip 127.0.0.1"),
        bagpipe_line("oracle --prefetch --lookahead-value 200 --mini-batch-size=4096 --dataset-multiprocessing "
                     "--worker-id 0 --world-size 4 --cache --master-ip 127.0.0.1 --world-size-trainers 2 "
                     "--processed-csv ../../kaggle_criteo_weekly.txt --cache-size 5000000"),
    ], cwd=cwd)
    run_dirs = list((cwd / "runs").glob("oracle-*"))
    assert len(run_dirs) == 1 and str(run_dirs[0].relative_to(cwd)) in texts[2]  # the default, printed
    summary = json.loads((run_dirs[0] / "summary.json").read_text())
    train_rows = ROWS - round(ROWS / 7)  # the last seventh is held out
    assert summary["iterations"] == train_rows // 4096 and summary["model"] == "external"
    assert summary["cache_rows"] == sum(SIZES) and summary["samples_per_s"] > 0
    assert "eval_auc" not in summary  # the trainers' model is their own
    assert "cache holds all" in texts[2] or "holds all" in texts[2]  # --cache-size 5000000 > every row
    saved = ModelDir.open(run_dirs[0] / "model")
    assert [saved.table(t).shape[1] for t in range(saved.num_tables)] == [48] * 26  # the scripts' emb_size
    assert any(name.startswith("top.") for name in saved.dense())  # trainer 0's own model


def test_dlrm_on_two_nodes_as_written(criteo_arrays, tmp_path):
    labels, dense, ids = criteo_arrays
    cwd = layout(tmp_path)
    write_lines(tmp_path / "kaggle_criteo_weekly.txt",
                ({"label": int(l), "dense": d.tolist(), "sparse": i.tolist()} for l, d, i in zip(labels, dense, ids)))
    trainer = ('trainer --arch-mlp-top "1024-512-256-1" --arch-mlp-bot "13-1024-1024-512-256-64-48" --worker-id {w} '
               "--lookahead-val 200 --world-size 4 --cache-size 5000000 --master-ip 127.0.0.1 --dist-worker-id {d} "
               "--world-size-trainers 2 --dist-master-ip 127.0.0.1 --device cuda:0 --logging-prefix "
               "lookahead_200_batch_size_4096_optimized --dist-backend gloo")
    texts = run_job([
        bagpipe_line(trainer.format(w=1, d=0)), bagpipe_line(trainer.format(w=2, d=1)),
        bagpipe_line("server --worker-id 3 --world-size 4 --master-ip 127.0.0.1"),
        bagpipe_line("oracle --prefetch --lookahead-value 200 --mini-batch-size=4096 --dataset-multiprocessing "
                     "--worker-id 0 --world-size 4 --cache --master-ip 127.0.0.1 --world-size-trainers 2 "
                     "--processed-csv ../../kaggle_criteo_weekly.txt --cache-size 5000000"),
    ], cwd=cwd)
    summary, config = finished_run(cwd)
    # the trainers' DLRM, evaluated; whether it learns is tested elsewhere (4 steps of Adam at 1e-3, DLRM's default,
    # through the original's wide MLPs end at about 0.48 here)
    assert summary["model"] == "dlrm" and 0.0 < summary["eval_auc"] < 1.0
    assert summary["eval_rows"] == round(ROWS / 7)
    assert config["model"]["arch_mlp_bot"] == "13-1024-1024-512-256-64-48" and config["model"]["emb_dim"] == 48
    assert "running on the CPU" in texts[0] or "on the CPU" in texts[0]  # --device cuda:0 without a GPU


def test_fgcnn_as_written(criteo_arrays, tmp_path):
    # half the rows: 2 of the original's batches of 4096 (FGCNN at its defaults is the costliest model to train)
    labels, dense, ids = (array[:ROWS // 2] for array in criteo_arrays)
    cwd = layout(tmp_path)
    # The original's FGCNN data: every field categorical (the 13 dense ones bucketed), no dense values.
    buckets = np.minimum(dense * 2, 19).astype(np.int64)
    fields = np.concatenate([buckets, ids], axis=1)
    sizes = [20] * 13 + SIZES
    write_lines(tmp_path / "parsed_train.txt", ({"label": int(l), "dense": [], "sparse": f.tolist()}
                                               for l, f in zip(labels, fields)))
    write_sizes(tmp_path, sizes)
    trainer = ("trainer --model fgcnn --worker-id {w} --lookahead-val 200 --world-size 4 --cache-size 8000000 "
               "--master-ip 127.0.0.1 --dist-worker-id {d} --world-size-trainers 2 --dist-master-ip 127.0.0.1 "
               '--device cuda:0 --filter-range "2-5" --emb-info-file ../emb_table_info.txt --logging-prefix '
               "lookahead_200_batch_size_4096_optimized --dist-backend gloo")
    run_job([
        bagpipe_line(trainer.format(w=1, d=0)), bagpipe_line(trainer.format(w=2, d=1)),
        bagpipe_line("server --worker-id 3 --world-size 4 --master-ip 127.0.0.1 --emb-info-file ../emb_table_info.txt"),
        bagpipe_line("oracle --prefetch --lookahead-value 200 --mini-batch-size=4096 --dataset-multiprocessing "
                     "--worker-id 0 --world-size 4 --cache --master-ip 127.0.0.1 --world-size-trainers 2 "
                     "--emb-info-file ../../emb_table_info.txt --processed-csv ../../parsed_train.txt "
                     "--cache-size 8000000"),
    ], cwd=cwd)
    summary, config = finished_run(cwd)
    assert summary["model"] == "fgcnn" and config["model"]["conv_channels"] == "14-16-18-20"
    assert summary["total_rows"] == sum(sizes) and 0.0 <= summary["eval_auc"] <= 1.0


def test_caser_as_written(tmp_path):
    cwd = layout(tmp_path)
    raw = tmp_path / "raw"
    generate_sequences(raw, users=1500, items=200, interactions=12, seed=2, show_progress=False)
    preprocess(raw, tmp_path / "samples", show_progress=False)
    ids = np.asarray(open_dataset(tmp_path / "samples").train.ids)
    full = ids[(ids[:, 1:6] >= 0).all(axis=1)]  # the original's samples have a full history
    # The original's CASER layout: targets in "label", negatives in "dense", [user, history] in "sparse".
    write_lines(tmp_path / "parsed_caser.txt", ({"label": row[6:9].tolist(), "dense": row[9:12].tolist(),
                                                 "sparse": [int(row[0]), row[1:6].tolist()]} for row in full))
    write_sizes(tmp_path, [1500, 200])
    trainer = ("trainer --model caser --worker-id {w} --lookahead-val 200 --world-size 4 --cache-size 8000000 "
               "--master-ip 127.0.0.1 --dist-worker-id {d} --world-size-trainers 2 --dist-master-ip 127.0.0.1 "
               "--device cuda:0 --emb-info-file ../../emb_table_info.txt --dist-backend gloo")
    run_job([
        bagpipe_line(trainer.format(w=1, d=0)), bagpipe_line(trainer.format(w=2, d=1)),
        bagpipe_line("server --emb-size 50 --worker-id 3 --world-size 4 --master-ip 127.0.0.1 --emb-info-file "
                     "../../emb_table_info.txt"),
        bagpipe_line("oracle --prefetch --lookahead-value 200 --mini-batch-size=512 --dataset-multiprocessing "
                     "--worker-id 0 --world-size 4 --cache --master-ip 127.0.0.1 --world-size-trainers 2 "
                     "--emb-info-file ../../emb_table_info.txt --processed-csv ../../parsed_caser.txt "
                     "--cache-size 8000000"),
    ], cwd=cwd)
    summary, config = finished_run(cwd)
    assert summary["model"] == "caser" and config["model"]["emb_dim"] == 50  # the server's --emb-size
    assert 0.0 <= summary["eval_hr10"] <= 1.0


def test_roles_that_disagree_are_refused_naming_both(criteo_arrays, tmp_path):
    labels, dense, ids = criteo_arrays
    cwd = layout(tmp_path)
    write_lines(tmp_path / "data.txt", ({"label": int(l), "dense": d.tolist(), "sparse": i.tolist()}
                                       for l, d, i in zip(labels[:5000], dense[:5000], ids[:5000])))
    env = dict(os.environ, MASTER_PORT=str(free_port()))
    oracle = CliProcess(bagpipe_line("oracle --worker-id 0 --world-size 4 --world-size-trainers 2 "
                                     "--processed-csv ../../data.txt --cache-size 900 --emb-size 16"), cwd=cwd, env=env)
    others = [CliProcess(bagpipe_line(line), cwd=cwd, env=env)
              for line in ("server --worker-id 3 --world-size 4 --emb-size 32",
                           "trainer --worker-id 1 --world-size 4", "trainer --worker-id 2 --world-size 4")]
    try:
        _, err = oracle.communicate(timeout=120)
        assert oracle.returncode == 2
        assert "the roles disagree on the embedding size" in err
        assert "the oracle (rank 0) has 16" in err and "server 0 (rank 3) has 32" in err
        for process in others:
            _, other_err = process.communicate(timeout=60)
            assert process.returncode == 2 and "the oracle refused the job" in other_err
    finally:
        for process in (oracle, *others):
            if process.poll() is None:
                process.kill()
                process.wait()
