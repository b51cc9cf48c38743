
import pytest


@pytest.mark.parametrize("flags, message", [
    (["--model", "dlrmx"], "model must be one of dlrm"), (["--mode", "foo"], "mode must be one of"),
    ([], "--data: no such file or directory"), (["--lr", "-1"], "lr must be a positive")])
def test_a_refused_train_command_answers_before_torch_is_imported(tmp_path, flags, message):
    """Importing torch takes seconds on a busy machine: the settings and the data's path are checked first, so a
    mistyped one is refused at once (exit 2, the reason on stderr) with torch never loaded."""
    import subprocess
    import sys

    script = ("import sys; from bagpipe.cli import main; "
              f"code = main(['train', '--data', {str(tmp_path / 'missing')!r}, '--run-dir', "
              f"{str(tmp_path / 'run')!r}, *{flags!r}]); print(code, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "False"], (done.stdout, done.stderr[-2000:])
    assert message in done.stderr


def test_a_refused_export_answers_before_torch_is_imported(tmp_path):
    import subprocess
    import sys

    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "config.json").write_text("{}")
    for run_dir, message in ((tmp_path / "missing", "is not a bagpipe run dir"),
                             (tmp_path / "unfinished", "not a finished run")):
        script = ("import sys; from bagpipe.cli import main; "
                  f"code = main(['export', '--run-dir', {str(run_dir)!r}, '--out', {str(tmp_path / 'm.pt')!r}]); "
                  "print(code, 'torch' in sys.modules)")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert done.stdout.split() == ["2", "False"], (done.stdout, done.stderr[-2000:])
        assert message in done.stderr


def test_busy_cores_counts_what_other_processes_use_of_the_cores():
    import subprocess
    import sys

    from bagpipe.openmp import busy_cores, cpu_ticks

    samples = iter([(100, 1000), (150, 1100)])  # 50 of 100 ticks busy over the window
    cores = __import__("os").cpu_count()
    assert busy_cores(ticks=lambda: next(samples), sleep=lambda s: None) == pytest.approx(cores * 0.5)
    assert busy_cores(ticks=lambda: None, sleep=lambda s: None) is None
    if cpu_ticks() is None:
        pytest.skip("no /proc/stat here")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert busy_cores(window_s=0.5) >= 0.5  # one process spinning: about one core (the test's own sleeps)
    finally:
        spinner.kill()
        spinner.wait()
