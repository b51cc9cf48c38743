"""A small bagpipe job and its reference: the configurations the job tests share, the reference trained once per
configuration and session, and the comparisons of what two runs exported."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from bagpipe.config import RUN_MODES, SECTION_OF, SECTIONS, ModelConfig, TrainConfig
from bagpipe.rundir import export
from bagpipe.train.reference import train_reference
from helpers.cli_processes import CliProcess

ITERATIONS, BATCH, CACHE = 150, 128, 700  # the 861-row data: ~85 rows evicted and re-fetched per iteration


MODEL = ModelConfig(emb_dim=8, arch_mlp_bot="13-16-8", arch_mlp_top="16-1")


def job_config(data, run_dir, **overrides) -> TrainConfig:
    values = dict(data=str(data), run_dir=str(run_dir), mode="bagpipe", iterations=ITERATIONS, batch_size=BATCH,
                  optimizer="adagrad", lr=0.05, seed=5, trainers=2, servers=2, cache_rows=CACHE, lookahead=20,
                  timeout=30.0, warmup_iterations=2, log_every=10, max_eval_rows=2000, model=MODEL)
    values.update(overrides)
    return TrainConfig(**values)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check)")


# What the reference run does not depend on: the settings --mode reference does not read (config.SECTIONS), but the
# trainers (the reference's --slices), and where it writes and checkpoints. Two configurations that differ only in
# these have one reference.
_NOT_IN_THE_REFERENCE = ("run_dir", "mode", *SECTIONS["checkpoint"],
                         *(name for name in SECTION_OF if not RUN_MODES["reference"].reads(name) and name != "trainers"))


_REFERENCES: dict[str, tuple[Path, dict]] = {}  # a configuration's reference, trained once per test session


def reference_of(config: TrainConfig, run_dir) -> dict:
    """The reference's export for ``config``, its gradients computed as ``config.trainers`` trainers do,
    on one thread, as each role runs (`bagpipe train --slices` does the same). Trained once per session for
    each configuration: a later test asking for the same one gets a copy of its run dir in ``run_dir``."""
    trained_as = {name: value for name, value in dataclasses.asdict(config).items() if name not in _NOT_IN_THE_REFERENCE}
    key = json.dumps(trained_as, sort_keys=True)
    if key in _REFERENCES:
        trained, exported = _REFERENCES[key]
        shutil.copytree(trained, run_dir)
        return exported
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_reference(dataclasses.replace(config, mode="reference", run_dir=str(run_dir), slices=config.trainers),
                        show_progress=False)
    finally:
        torch.set_num_threads(threads)
    exported = export(run_dir, Path(run_dir) / "export.pt")
    _REFERENCES[key] = (Path(run_dir), exported)
    return exported


def assert_same_parameters(ours: dict, reference: dict, *, rel: float = 0.0) -> None:
    """Every table and dense tensor bit for bit equal to the reference's, or (``rel`` > 0) within ``rel``
    of it, norm-wise."""
    assert ours["dense"].keys() == reference["dense"].keys()
    pairs = [(f"table {t}", got, want) for t, (got, want) in
             enumerate(zip(ours["embeddings"], reference["embeddings"], strict=True))]
    pairs += [(name, ours["dense"][name], want) for name, want in reference["dense"].items()]
    differing = []  # every tensor that differs, not only the first: where a divergence shows is a clue to its cause
    for name, got, want in pairs:
        assert got.shape == want.shape, name
        if rel == 0.0:
            differ = int((got != want).sum())
            if differ:
                differing.append(f"{name}: {differ} of {want.numel()} elements differ from the reference")
        else:
            error = ((got - want).norm() / want.norm()).item()
            assert error <= rel, f"{name}: relative error {error:.2e} exceeds {rel:.0e}"
    assert not differing, f"{len(differing)} of {len(pairs)} tensors differ:\n" + "\n".join(differing)


def bagpipe_cli(*args: str, **kwargs) -> CliProcess:
    return CliProcess(list(args), **kwargs)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "zombie" in status.read_text())


def small_config(data, run_dir, **overrides):
    values = dict(data=str(data), run_dir=str(run_dir), batch_size=256, iterations=300, optimizer="adagrad",
                  lr=0.05, seed=0, warmup_iterations=2, log_every=50,
                  model=ModelConfig(emb_dim=8, arch_mlp_bot="13-32-8", arch_mlp_top="32-1"))
    values.update(overrides)
    return TrainConfig(**values)


def same_export(a: dict, b: dict) -> None:
    assert a["dense"].keys() == b["dense"].keys()
    for name in a["dense"]:
        assert torch.equal(a["dense"][name], b["dense"][name]), name
    for t, (x, y) in enumerate(zip(a["embeddings"], b["embeddings"])):
        assert torch.equal(x, y), f"table {t}"


def exports_equal(a: dict, b: dict) -> bool:
    return (a["dense"].keys() == b["dense"].keys() and all(torch.equal(a["dense"][k], b["dense"][k]) for k in a["dense"])
            and all(torch.equal(x, y) for x, y in zip(a["embeddings"], b["embeddings"], strict=True)))
