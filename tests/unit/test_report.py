"""Per-iteration timing in the metrics, and `bagpipe report` plots from a demo run."""

from __future__ import annotations

import json
import time

import pytest

from bagpipe.cli import main
from bagpipe.report import PLOTS, load_run
from bagpipe.timing import PhaseClock

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_phase_clock_charges_each_lap_once_and_carves_waits():
    clock = PhaseClock(warmup=1)
    for iteration in range(3):
        clock.restart()
        time.sleep(0.01)
        clock.lap("forward")
        time.sleep(0.02)
        clock.lap("sync")
        clock.carve("sync", "sync_wait", 0.015)
        clock.carve("sync", "sync_wait", 10.0)  # never more than the phase held
        clock.end_iteration()
    window = clock.window()
    assert set(window) == {"forward", "sync", "sync_wait"}
    assert window["sync"] == pytest.approx(0.0, abs=1e-6)  # all of it carved out
    assert 19.0 <= window["sync_wait"] < 40.0 and 9.0 <= window["forward"] < 30.0
    assert clock.window() == {}  # a new window is empty
    steady = clock.steady_ms()  # iterations 1 and 2 only (warm-up 1)
    assert set(steady) == set(window) and 9.0 <= steady["forward"] < 30.0


@pytest.fixture(scope="module")
def demo_runs(small_binary, tmp_path_factory):
    """The demo config (--mode bagpipe) and the reference, shortened to 40 iterations."""
    root = tmp_path_factory.mktemp("demo_runs")
    runs = {}
    for mode in ("bagpipe", "reference"):
        run_dir = root / mode
        code = main(["train", "--config", "configs/demo.toml", "--data", str(small_binary), "--run-dir",
                     str(run_dir), "--mode", mode, "--iterations", "40", "--batch-size", "128", "--log-every", "10",
                     "--max-eval-rows", "2000", "--no-progress", "--cache-rows", "700"])
        assert code == 0
        runs[mode] = run_dir
    return runs


def test_metrics_carry_the_breakdown_and_cache_counters(demo_runs):
    bagpipe = load_run(demo_runs["bagpipe"])
    assert len(bagpipe.train) == 4
    for record in bagpipe.train:
        phases = record["time_ms"]
        assert {"forward", "backward", "sync", "cache", "lookup"} <= set(phases)
        assert all(ms >= 0 for ms in phases.values())
        assert 0.0 <= record["cache_hit_rate"] <= 1.0 and record["rows_fetched_per_iteration"] >= 0
        assert record["window_samples_per_s"] > 0
    summary = bagpipe.summary
    # The phases of an iteration add up to its time: steady ms/iteration ~ 1000 * batch / samples/s.
    total = sum(summary["time_breakdown_ms"].values())
    assert total == pytest.approx(1000 * 128 / summary["samples_per_s"], rel=0.25)
    assert set(summary["peak_rss_bytes"]) == {"oracle", "server0", "trainer0", "trainer1"}
    assert all(b > 10 * 2**20 for b in summary["peak_rss_bytes"].values())
    assert summary["startup_s"] > 0
    assert 10 * 2**20 < summary["oracle_peak_rss_while_feeding_bytes"] <= summary["peak_rss_bytes"]["oracle"]
    # the blocking main sum is part of what a trainer all-reduces: the early bucket (DLRM's top MLP) and the rows not
    # used next iteration go in sums of their own
    assert 0 < summary["allreduce_main_bytes_per_iteration"] < summary["allreduce_bytes_per_iteration"]
    assert 0 < summary["allreduce_main_row_bytes_per_iteration"] < summary["allreduce_main_bytes_per_iteration"]
    # the steady state's span in wall-clock time: the timed iterations back to back (what a benchmark reads a link's
    # bytes over), within the run's own life
    for mode in ("bagpipe", "reference"):
        run = load_run(demo_runs[mode]).summary
        start, end = run["timed_window"]
        timed = (40 - run["warmup_iterations"]) * 128 / run["samples_per_s"]
        assert end - start == pytest.approx(timed, rel=0.02, abs=0.02)
        assert end <= (demo_runs[mode] / "summary.json").stat().st_mtime + 1
    # the oracle while feeding: its CPU per iteration holds its producer's, which holds the planner's and reading's
    oracle = summary["oracle_ms_per_iteration"]
    assert oracle["cpu"] >= oracle["producer"] * 0.9 and oracle["planner"] > 0 and oracle["reading"] > 0
    assert oracle["producer"] >= (oracle["planner"] + oracle["reading"]) * 0.9
    assert summary["oracle_cpu_per_planner"] == pytest.approx(oracle["cpu"] / oracle["planner"], rel=0.01)
    assert summary["planned_ids_per_planner_s"] > 0 and summary["oracle_ms_per_1k_ids"] > 0
    assert set(summary["server_ms_per_1k_rows"]) == {"server0"} and summary["server_ms_per_1k_rows"]["server0"] > 0
    reference = load_run(demo_runs["reference"]).summary
    assert {"data", "forward", "backward", "optimizer"} <= set(reference["time_breakdown_ms"])
    # the operations of the last warm-up iteration (bagpipe.opcount): a trainer's are the reference step's and the
    # cache's and sums' around it (the same model: at least as many, but not many times more)
    trainer_ops = summary["ops_per_iteration"]
    assert set(trainer_ops) == {"trainer0", "trainer1"} and set(summary["host_reads_per_iteration"]) == set(trainer_ops)
    assert 50 < reference["ops_per_iteration"] <= trainer_ops["trainer0"] < 3 * reference["ops_per_iteration"]
    assert sum(reference["time_breakdown_ms"].values()) == pytest.approx(
        1000 * 128 / reference["samples_per_s"], rel=0.25)


def test_report_writes_every_plot_for_one_and_several_runs(demo_runs, tmp_path, capsys):
    assert main(["report", str(demo_runs["bagpipe"])]) == 0
    text = capsys.readouterr().out
    assert "samples/s steady state" in text and "hit rate" in text and "peak memory" in text
    for name in PLOTS:
        data = (demo_runs["bagpipe"] / "report" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
    out = tmp_path / "compare"
    assert main(["report", str(demo_runs["bagpipe"]), str(demo_runs["reference"]), "--out", str(out),
                 "--labels", "ours,reference"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("ours:") and "\n\nreference:" in text
    sizes = {name: (out / name).stat().st_size for name in PLOTS}
    assert all(size > 5000 for size in sizes.values()), sizes


def test_runs_of_one_name_get_labels_of_their_own_and_lines_that_stay_visible(demo_runs, tmp_path):
    """Identical runs (as the exactness claims make them) drawn over one another: each has its own legend entry
    and a line style of its own, so the later is seen on top of the earlier."""
    import shutil

    from bagpipe.report import _styles, load_run, report

    copies = [tmp_path / where / "run" for where in ("a", "b")]
    for copy in copies:
        shutil.copytree(demo_runs["reference"], copy)
    text, files = report(copies, out=tmp_path / "plots")
    first, second = (block.splitlines()[0].split(":")[0] for block in text.split("\n\n"))
    assert first == "run (reference)" and second == "run (reference) [b/run #2]"
    styles = _styles([load_run(copy) for copy in copies[:1]] + [load_run(copies[1], second)])
    assert len({style["linestyle"] for style in styles.values()}) == 2
    assert (tmp_path / "plots" / "loss_auc.png").stat().st_size > 5000


def test_report_refuses_what_is_not_a_run_dir(tmp_path, demo_runs):
    assert main(["report", str(tmp_path)]) == 2  # a clear error, exit status 2
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metrics.jsonl").write_text(json.dumps({"iteration": 1}) + "\n{not json\n")
    with pytest.raises(ValueError, match="metrics.jsonl:2: not JSON"):
        load_run(broken)
    assert main(["report", str(demo_runs["bagpipe"]), "--labels", "a,b"]) == 2
