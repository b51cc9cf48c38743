"""docs/cli.md, the command-line reference, written from the parser itself: every command and flag as ``--help``
gives it, at a fixed width, so that the page is the same on every machine and a test can say when it is stale.

    python -m bagpipe.clidoc docs/cli.md        (make docs-cli)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

WIDTH = 110  # the help's columns here, whatever the terminal's (argparse reads $COLUMNS otherwise)

HEADER = """\
# The `bagpipe` command

Every command and flag, as `bagpipe COMMAND --help` prints them. This page is generated from the parser
(`make docs-cli`; tests/unit/project/test_clidoc.py fails when it is stale): change the help in src/bagpipe/cli.py,
not here.
The README's quick start shows the commands at work; settings can also come from a TOML file (`--config`), whose
keys are the flags' names with `_` for `-`.
"""


def _fixed_width(parser: argparse.ArgumentParser) -> None:
    kind = parser.formatter_class
    parser.formatter_class = lambda prog: kind(prog, width=WIDTH)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def render() -> str:
    from bagpipe.cli import build_parser

    parser = build_parser()
    commands = _subcommands(parser)
    sections = [HEADER, "Commands: " + ", ".join(f"[`{name}`](#bagpipe-{name})" for name in commands) + ".\n"]
    _fixed_width(parser)
    sections.append(f"## bagpipe\n\n```\n{parser.format_help().rstrip()}\n```\n")
    for name, command in commands.items():
        _fixed_width(command)
        sections.append(f"## bagpipe {name}\n\n```\n{command.format_help().rstrip()}\n```\n")
    return "\n".join(sections)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m bagpipe.clidoc OUT.md", file=sys.stderr)
        return 2
    Path(argv[0]).write_text(render())
    print(f"wrote {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
