"""--compile: the dense model's forward, loss and backward through torch.compile, alike in every mode, so that
compiled runs equal each other bit for bit (an uncompiled run is not theirs to equal: fused kernels round
differently)."""

import pytest

from bagpipe.config import ModelConfig, TrainConfig


def test_compile_with_dropout_is_refused():
    with pytest.raises(ValueError, match="compile with dropout"):
        TrainConfig(data="-", run_dir="-", compile=True, model=ModelConfig(name="dcn", dropout=0.1))
