"""The per-model example trainers (``examples/<model>_bagpipe.py``: the original API with one of our
models, DDP on the dense part) against separately started roles: each ends bit for bit where
``--mode reference --slices 2`` does, and the oracle evaluates trainer 0's model."""


import shlex

import pytest

from bagpipe.api import _model_settings
from bagpipe.cli import QUICK_START, build_parser
from helpers.paths import REPO as ROOT


def test_init_cache_refuses_a_model_it_does_not_know_before_joining():
    with pytest.raises(ValueError, match="the models are dlrm, wide-deep"):
        _model_settings("xgboost", {}, emb_dim=16)
    with pytest.raises(ValueError, match="unknown setting.*deep_layers"):
        _model_settings("deepfm", {"deep_layers": "400"}, emb_dim=16)
    with pytest.raises(ValueError, match="dropout must be in"):
        _model_settings("deepfm", {"dropout": 1.5}, emb_dim=16)
    with pytest.raises(ValueError, match="name it with model="):
        _model_settings(None, {"dropout": 0.1}, emb_dim=16)
    assert _model_settings("dlrm", {"arch_mlp_bot": "13-8-4"}, emb_dim=4) == {
        "model.name": "dlrm", "model.arch_mlp_bot": "13-8-4"}
    assert _model_settings(None, {}, emb_dim=4) == {"model.name": "external"}


def test_the_readme_opens_with_the_help_quick_start_and_its_commands_parse():
    first_block = (ROOT / "README.md").read_text().split("```\n", 2)[1]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == [line.strip() for line in QUICK_START.splitlines()[1:]]
    for command in commands:
        build_parser().parse_args(shlex.split(command)[1:])


def test_the_readme_is_short_and_every_relative_link_of_the_docs_resolves():
    """A newcomer reads the README first: at most 200 lines, install and quick start before the rest; the topic
    pages it sends them to (and theirs to each other) exist."""
    import re

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert readme.index("## Install") < readme.index("## Quick start") < readme.index("## Which `--mode` when")
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"
