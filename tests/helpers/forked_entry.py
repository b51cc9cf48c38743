"""An entry point for tests/integration/test_forkserver.py's fork server: does what its arguments say, in the
forked child."""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str]) -> int:
    command, *rest = argv
    if command == "report":  # what the child was given, as JSON on stdout; a line on stderr
        from bagpipe import faults

        import torch

        print(json.dumps({"argv": argv, "sys_argv": sys.argv[1:], "cwd": os.getcwd(), "env": os.environ.get("ONLY_HERE"),
                          "threads": torch.get_num_threads(), "faults": sorted(map(list, faults._FAULTS)),
                          "pid": os.getpid()}))
        print("to stderr", file=sys.stderr)
        return 0
    if command == "exit":
        sys.exit(int(rest[0]))
    if command == "raise":
        raise RuntimeError("raised in the child")
    if command == "sleep":
        time.sleep(float(rest[0]))
        return 0
    if command == "fds":  # the descriptors it holds, as the files they name
        names = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                names.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # (the listing's own descriptor, closed by now)
                pass
        print(json.dumps(sorted(names)))
        return 0
    raise ValueError(command)
