"""--compile: the dense model's forward, loss and backward through torch.compile, alike in every mode, so that
compiled runs equal each other bit for bit (an uncompiled run is not theirs to equal: fused kernels round
differently)."""

import pytest
import torch

from bagpipe.rundir import export
from bagpipe.train.reference import train_reference
from helpers.jobs import assert_same_parameters, exports_equal, job_config, reference_of, small_config


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make gpu-check)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_single_mode_compiled_equals_the_compiled_reference_bit_for_bit(small_binary, tmp_path, device):
    from torch._dynamo.utils import counters

    runs = {}
    counters.clear()
    for name, mode, compiled in (("eager", "reference", False), ("reference", "reference", True),
                                 ("single", "single", True)):
        config = small_config(small_binary, tmp_path / name, mode=mode, iterations=30, batch_size=64,
                              optimizer="adam", cache_rows=600, lookahead=16, slices=2, compile=compiled,
                              device=device)
        summary = train_reference(config, show_progress=False)
        # the compiled runs' loss went through a graph dynamo made (once: the second model, of the same structure,
        # is an input of the same graph), the eager run's through none
        assert counters["frames"]["ok"] == (0 if name == "eager" else 1), dict(counters)
        runs[name] = (summary, export(tmp_path / name, tmp_path / f"{name}.pt"))
    assert exports_equal(runs["reference"][1], runs["single"][1])
    assert runs["single"][0]["final_train_loss"] == runs["reference"][0]["final_train_loss"]
    assert not exports_equal(runs["reference"][1], runs["eager"][1])  # (compiled: other kernels, other roundings)
    # a dispatch mode changes what a compiled graph runs: a compiled run counts no operations (it would not equal)
    assert "ops_per_iteration" not in runs["single"][0] and runs["eager"][0]["ops_per_iteration"] > 0


def test_bagpipe_trainers_compiled_equal_the_compiled_reference_bit_for_bit(small_binary, tmp_path):
    """Each trainer compiles its own graph of its slice (in its own process); the same graph as the sliced
    reference's, so the same values."""
    from bagpipe.runtime.launch import launch_local

    config = job_config(small_binary, tmp_path / "bagpipe", optimizer="adam", iterations=40, compile=True)
    summary = launch_local(config, show_progress=False)
    assert summary["iterations"] == 40 and "ops_per_iteration" not in summary
    ours = export(config.run_dir, tmp_path / "ours.pt")
    assert_same_parameters(ours, reference_of(config, tmp_path / "reference"))
