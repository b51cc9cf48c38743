"""The CTR models: shapes and gradients, learning the planted data, and exactness in every mode."""


import pytest

from bagpipe.rundir import export
from bagpipe.runtime.launch import launch_local
from helpers.jobs import assert_same_parameters, job_config, reference_of
from helpers.small_models import SMALL


# One optimizer per model through the whole distributed system (the cached test above covers every
# optimizer); wide-deep with dropout, whose masks must be drawn alike by trainer t and slice t.
@pytest.mark.parametrize("name, optimizer, dropout", [("wide-deep", "sgd", 0.3), ("deepfm", "adam", 0.0),
                                                      ("dcn-v2", "adagrad", 0.0), ("fgcnn", "adagrad", 0.0)])
def test_bagpipe_mode_equals_the_sliced_reference_for_every_model(small_binary, tmp_path, name, optimizer, dropout):
    from dataclasses import replace

    config = job_config(small_binary, tmp_path / "bagpipe", iterations=60, optimizer=optimizer,
                        model=replace(SMALL[name], dropout=dropout), cache_rows=1400)
    summary = launch_local(config, show_progress=False)
    assert summary["rows_written_back"] > 0 and summary["model"] == SMALL[name].name
    assert_same_parameters(export(config.run_dir, tmp_path / "ours.pt"), reference_of(config, tmp_path / "reference"))
