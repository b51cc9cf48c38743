"""--device for the one-process modes: --mode reference keeps its model and tables on the device, --mode single its
model and cache (the full tables in host memory). Each test that takes a device runs on the CPU always and on CUDA
where this machine has it (CI has none: those are `make gpu-check`'s). --mode single against --mode reference on
each device: tests/unit/train/test_single.py."""

import logging

import pytest
import torch

from bagpipe.config import TrainConfig
from bagpipe.data.batches import Batch
from bagpipe.train.reference import train_reference
from bagpipe.rundir import export
from helpers.jobs import assert_same_parameters, small_config

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check)")

# a float32 sum on a GPU adds in another order than on the CPU: over a run the two agree to rounding, not bits
CROSS_DEVICE_REL = 1e-4


@pytest.mark.parametrize("value", ["gpu", "cuda:", "cuda:x", "CUDA", "cpu:0", "", "Auto"])
def test_a_device_that_is_not_cpu_auto_cuda_or_cuda_n_is_refused(small_binary, tmp_path, value):
    with pytest.raises(ValueError, match="device must be cpu, auto, cuda or cuda:N"):
        small_config(small_binary, tmp_path, device=value)


def test_a_batch_for_a_device_moves_its_features_and_targets_and_keeps_its_ids_on_the_host():
    batch = Batch(dense_x=torch.ones(4, 3), ids=torch.zeros(4, 2, dtype=torch.int64), target=torch.zeros(4))
    assert batch.to("cpu") is batch
    moved = batch.to("meta")  # (a device every build has: no data, only where tensors live)
    assert moved.dense_x.device.type == moved.target.device.type == "meta" and moved.ids is batch.ids


def test_a_gpu_asked_for_on_a_machine_without_one_is_refused_and_auto_trains_on_the_cpu(small_binary, tmp_path,
                                                                                        caplog, monkeypatch):
    """(Issue 46's W4: --device cuda used to train on the CPU with a warning, config.json saying cuda.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda:0: CUDA is not available here"):
        train_reference(small_config(small_binary, tmp_path / "refused", device="cuda:0", iterations=5),
                        show_progress=False)
    assert not (tmp_path / "refused").exists()
    summary = train_reference(small_config(small_binary, tmp_path / "run", device="auto", iterations=5),
                              show_progress=False)
    assert summary["device"] == "cpu"


@CUDA
@pytest.mark.parametrize("name", ["dlrm", "caser"])
def test_the_reference_on_a_gpu_equals_it_on_the_cpu_to_rounding(small_binary, sequence_data, tmp_path, name):
    from bagpipe.config import ModelConfig

    data = small_binary if name == "dlrm" else sequence_data
    runs = {}
    for device in ("cpu", "cuda"):
        model = ModelConfig(emb_dim=8, arch_mlp_bot="13-32-8", arch_mlp_top="32-1") if name == "dlrm" else \
            ModelConfig(name="caser", emb_dim=8, dropout=0.5)
        config = TrainConfig(data=str(data), run_dir=str(tmp_path / device), device=device, iterations=30,
                             batch_size=64, optimizer="adam", lr=1e-3, model=model, eval_every=15)
        summary = train_reference(config, show_progress=False)
        runs[device] = (summary, export(tmp_path / device, tmp_path / f"{device}.pt"))
    assert_same_parameters(runs["cuda"][1], runs["cpu"][1], rel=CROSS_DEVICE_REL)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_a_run_on_a_device_resumes_from_its_checkpoint_as_if_never_stopped(small_binary, tmp_path, device):
    """A run stopped after its checkpoint at 20 (its summary removed: as if killed before its end) resumes to 40
    and ends where an unbroken run does, bit for bit on the same device."""
    common = dict(device=device, iterations=40, batch_size=64, optimizer="adam", checkpoint_every=20)
    whole = train_reference(small_config(small_binary, tmp_path / "whole", **common), show_progress=False)
    # a checkpoint is written at 20 only by a run that goes on past it (its end writes the model instead)
    train_reference(small_config(small_binary, tmp_path / "part", **{**common, "iterations": 30}), show_progress=False)
    (tmp_path / "part" / "summary.json").unlink()
    resumed = train_reference(small_config(small_binary, tmp_path / "part", **common), show_progress=False,
                              resume=True)
    assert resumed["resumed_at"] == 20
    assert resumed["eval_auc"] == whole["eval_auc"]
    assert_same_parameters(export(tmp_path / "part", tmp_path / "part.pt"),
                           export(tmp_path / "whole", tmp_path / "whole.pt"))
