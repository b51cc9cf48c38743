"""Progress off a terminal: a log line every few seconds with the count, the total, samples/s and an ETA."""

import logging

import pytest

from bagpipe.progress import LogProgress, duration, progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.INFO, logger="bagpipe")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "bagpipe"]


def test_a_line_first_after_the_first_iterations_then_every_interval_with_rate_and_eta(lines):
    clock = Clock()
    bar = LogProgress(total=1000, desc="train", initial=0, samples_per_unit=64, every_s=10, first_s=3, clock=clock)
    clock.now += 2.0  # start-up: not the pace
    for _ in range(16):  # 8 iterations a second
        clock.now += 0.125
        bar.update(1)
    assert lines() == ["train: 8 of 1,000 it (1%), 512 samples/s, ETA 2m04s"]  # 3 s from the start
    bar.set_postfix(loss="0.5000")
    for _ in range(200):
        clock.now += 0.125
        bar.update(1)
    said = lines()
    assert len(said) == 3  # then at 13 s and 23 s
    assert said[-1] == "train: 168 of 1,000 it (17%), 512 samples/s, loss 0.5000, ETA 1m44s", said


def test_the_launcher_keeps_lines_coming_while_the_count_stands_still_and_close_says_the_end(lines):
    clock = Clock()
    bar = LogProgress(total=50, desc="train (bagpipe)", initial=20, samples_per_unit=8, every_s=10, first_s=3,
                      clock=clock)
    for _ in range(30):  # a resumed run waiting for its roles: refreshed, nothing new
        clock.now += 1
        bar.refresh()
    assert len(lines()) == 3 and all("20 of 50 it (40%)" in line and "ETA unknown yet" in line for line in lines())
    bar.update(10)
    clock.now += 5
    bar.update(20)
    bar.close()
    assert lines()[-1].startswith("train (bagpipe): 50 of 50 it (100%), 32 samples/s, done in "), lines()[-1]


def test_on_no_terminal_the_bar_is_a_log_and_no_progress_shows_nothing(monkeypatch):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert isinstance(progress(total=5, desc="x"), LogProgress)
    with progress(total=5, desc="x") as bar:  # (as tqdm's: preprocessing holds its bar in a with block)
        bar.update(5)
    assert bar.closed
    quiet = progress(total=5, desc="x", enabled=False)
    assert not isinstance(quiet, LogProgress) and quiet.disable


def test_durations_read_as_a_person_writes_them():
    assert [duration(s) for s in (0, 12.4, 250, 3725)] == ["0s", "12s", "4m10s", "1h02m"]


def test_a_conversion_with_its_output_redirected_logs_its_progress(tmp_path, lines, monkeypatch):
    """What a newcomer's redirected `bagpipe train` on text data does first (benchmarks/newcomer.sh met it broken:
    preprocessing holds its bar in a with block): the conversion runs with LogProgress, and work this short
    (under the first line's 3 s) says nothing."""
    import sys

    from bagpipe.data.prepare import ensure_preprocessed
    from bagpipe.synth import generate

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    generate(tmp_path / "data", rows=2000, test_rows=200, seed=1, table_sizes=[50] * 26)
    converted = ensure_preprocessed(tmp_path / "data", show_progress=True)
    assert (converted / "meta.json").is_file()
    assert not [line for line in lines() if " of " in line]
