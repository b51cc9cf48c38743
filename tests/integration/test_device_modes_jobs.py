"""--device for the one-process modes: --mode reference keeps its model and tables on the device, --mode single its
model and cache (the full tables in host memory). Each test that takes a device runs on the CPU always and on CUDA
where this machine has it (CI has none: those are `make gpu-check`'s). --mode single against --mode reference on
each device: tests/unit/train/test_single.py."""


def test_a_trainer_asked_for_nccl_is_refused_before_it_joins_a_job():
    """`--dist-backend nccl` (the original's trainers may say it) is refused with the reason and what to use, before
    any store is reached for (nothing listens at the port given). A process: a failed role leaves at once."""
    import subprocess
    import sys

    from bagpipe.runtime.world import free_port

    done = subprocess.run([sys.executable, "-m", "bagpipe.cli", "trainer", "--worker-id", "1", "--world-size", "3",
                           "--master-ip", "127.0.0.1", "--master-port", str(free_port()), "--dist-backend", "nccl"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "NCCL needs a GPU per trainer" in done.stderr and "use --dist-backend gloo" in done.stderr
