"""benchmarks/gpu_check.py's own logic, on the CPU: what it reads of the project's sources and of py-spy's output
(the GPU machine is lent for minutes: a check that breaks there is a lost run)."""

import importlib.util

import pytest
from helpers.paths import REPO as ROOT


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode", ["single", "bagpipe"])
def test_each_modes_training_loop_is_found_in_its_source(gpu_check, mode):
    """The markers of each loop's first and last lines exist (a renamed line would empty the profile)."""
    frame, lines = gpu_check.loop_frames(mode)
    source = (ROOT / "src" / frame.split(" (")[1].rstrip(":")).read_text().splitlines()
    assert 5 < len(lines) < 200
    assert f"def {frame.split(' ')[0]}(" in "\n".join(source[:lines.start])  # the function holds the loop


def test_samples_are_counted_by_line_within_the_loop_only(gpu_check, tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text("\n".join([
        "main (x.py:1);train_loop (bagpipe/runtime/trainer/loop.py:120);backward_slice (bagpipe/runtime/redo.py:73);"
        "backward (torch/autograd/__init__.py:395) 30",
        "main (x.py:1);train_loop (bagpipe/runtime/trainer/loop.py:103);TrainerRuntime.advance "
        "(bagpipe/runtime/trainer/runtime.py:256);Condition.wait (threading.py:331) 10",
        "main (x.py:1);train_loop (bagpipe/runtime/trainer/loop.py:50) 60",  # setup: outside the loop's lines
        "main (x.py:1);other (y.py:2) 7"]))
    found = gpu_check.loop_lines(raw, "train_loop (bagpipe/runtime/trainer/loop.py:", range(100, 200))
    assert found["samples"] == 40
    assert found["loop_lines"] == [("train_loop (bagpipe/runtime/trainer/loop.py:120)", 0.75),
                                   ("train_loop (bagpipe/runtime/trainer/loop.py:103)", 0.25)]
    assert found["project_lines"][0] == ("backward_slice (bagpipe/runtime/redo.py:73)", 0.75)
    assert found["innermost"][1] == ("Condition.wait (threading.py:331)", 0.25)


def test_cases_keep_the_base_and_the_named_and_before_runs_from_its_source(gpu_check, tmp_path, monkeypatch):
    """--cases runs only the named cases besides each step's base; --before's case is run from the source given,
    and the report's ratios name no case that did not run."""
    import argparse
    import json

    data = tmp_path / "work" / "data"
    data.mkdir(parents=True)
    (data / "meta.json").write_text(json.dumps({"table_sizes": [600, 400]}))
    ran = []

    def train_once(work, data, name, *, device, mode, cache_rows, args, trainers=1, compiled=False, src=""):
        ran.append((name, mode, cache_rows, src))
        return {"samples_per_s": {"reference-cuda": 100.0, "reference-cuda-before": 40.0}.get(name, 80.0),
                "device": device, "rows_to_device_per_trainer_iteration": None, "stall_fraction": None,
                "copies_to_device": None, "device_syncs_per_iteration": 0}

    monkeypatch.setattr(gpu_check, "train_once", train_once)
    args = argparse.Namespace(work=str(tmp_path / "work"), repeats=1, batch_size=8, dim=4, iterations=2,
                              before="old/src", cases="reference-cuda-before,single-5%-cuda")
    result = gpu_check.single_against_reference(args)
    assert [name for name, *_ in ran] == ["reference-cuda", "single-5%-cuda", "reference-cuda-before"]
    assert ran[1][2] == 1000 // 20 and ran[2][3] == "old/src" and ran[0][3] == ""
    assert result["reference_vs_before"] == 2.5 and result["single_5%_vs_reference"] == 0.8
    ran.clear()
    args.cases = "reference-cuda-before"
    assert gpu_check.single_against_reference(args)["single_5%_vs_reference"] is None
    assert [name for name, *_ in ran] == ["reference-cuda", "reference-cuda-before"]
