"""Next-item sequences: interaction logs in MovieLens's formats, samples, the planted generator, and
Caser learning and training exactly in every mode."""


import json
from dataclasses import replace


from bagpipe.data.batches import fresh_negatives
from bagpipe.data.binary import open_dataset
from bagpipe.data.prepare import ensure_preprocessed
from bagpipe.rundir import export
from bagpipe.runtime.launch import launch_local
from bagpipe.synth_sequences import generate_sequences
from helpers.jobs import assert_same_parameters, job_config, reference_of
from helpers.small_models import CASER


def test_bagpipe_caser_equals_the_sliced_reference(tmp_path):
    # Small data, so that the run makes nearly three shuffled passes: the later ones with fresh negatives, drawn
    # by the oracle for the trainers and by the reference for itself.
    generate_sequences(tmp_path / "raw", users=300, items=60, interactions=12, seed=2, show_progress=False)
    data = ensure_preprocessed(tmp_path / "raw", show_progress=False)  # 2,400 training samples: 9 batches a pass
    config = job_config(data, tmp_path / "bagpipe", iterations=24, batch_size=256, optimizer="adam", lr=0.005,
                        cache_rows=480, shuffle=True, model=replace(CASER, dropout=0.3))  # every row: a batch reads them
    assert fresh_negatives(config, open_dataset(data).train) is not None
    summary = launch_local(config, show_progress=False)
    assert summary["model"] == "caser" and "eval_hr10" in summary and summary["rows_fetched"] > 0
    assert_same_parameters(export(config.run_dir, tmp_path / "ours.pt"), reference_of(config, tmp_path / "reference"))
    reference = json.loads((tmp_path / "reference" / "summary.json").read_text())
    for metric in ("eval_hr10", "valid_hr10", "valid_ndcg10", "valid_cooccurrence_hr10"):  # both splits evaluated
        assert reference[metric] == summary[metric], metric
