"""docs/cli.md is the parser's own help: a flag added, renamed or re-explained in cli.py without `make docs-cli`
fails here."""

import argparse

from bagpipe.cli import build_parser
from bagpipe.clidoc import _subcommands, render
from helpers.paths import REPO as ROOT


def test_docs_cli_md_is_what_the_parser_says_today():
    assert (ROOT / "docs" / "cli.md").read_text() == render(), "docs/cli.md is stale: run `make docs-cli`"


def test_the_reference_lists_every_command_and_every_flag(monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")  # the page's width is its own, not the terminal's
    page = render()
    assert page == (ROOT / "docs" / "cli.md").read_text()
    for name, command in _subcommands(build_parser()).items():
        assert f"## bagpipe {name}\n" in page
        for action in command._actions:
            if action.help == argparse.SUPPRESS:  # accepted for the original's command lines, not offered
                continue
            for flag in action.option_strings:
                assert flag in page, (name, flag)
