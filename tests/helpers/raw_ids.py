"""Raw-id data whose ids keep arriving, and a reference run on it cut short and resumed: what the raw-id tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from bagpipe.data.preprocess import preprocess
from bagpipe.synth import generate


def arriving_raw_data(out: Path, *, rows: int, test_rows: int) -> Path:
    """``bagpipe synth --raw-ids`` data (26 tables: 6 of 200 ids at a time, 20 of 30; 5 periods, a fifth of each
    period's ids new), converted with --raw-ids into ``out``/data."""
    generate(out / "synth", rows=rows, test_rows=test_rows, seed=5, table_sizes=[200] * 6 + [30] * 20, raw_ids=True,
             periods=5, new_share=0.2, show_progress=False)
    preprocess(out / "synth", out / "data", raw_ids=True, show_progress=False)
    return out / "data"


def cut_and_resumed(cut, monkeypatch, *, resumed=None, at: int = 27) -> dict:
    """``cut`` (a reference run's config that checkpoints) failed at iteration ``at``, then resumed (as ``resumed``,
    if given: another config of the same run dir); the resumed run's summary."""
    from bagpipe import faults
    from bagpipe.train.reference import train_reference

    monkeypatch.setattr(faults, "_FAULTS", {("reference", f"iteration {at}"): ("fail", 0.0)})
    monkeypatch.setattr(faults, "_ROLE", "reference")
    with pytest.raises(faults.InjectedFault):
        train_reference(cut, show_progress=False)
    monkeypatch.setattr(faults, "_FAULTS", {})
    return train_reference(resumed or cut, show_progress=False, resume=True)
