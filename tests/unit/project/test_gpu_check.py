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
