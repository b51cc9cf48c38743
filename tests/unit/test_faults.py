"""Fault injection's points (bagpipe/faults.py): declared once, every one called somewhere, and a fault at a point
that does not exist (a typo) refused instead of never firing."""

from __future__ import annotations

import ast

import pytest

from bagpipe.faults import POINTS, _parse, point_form
from helpers.paths import SRC
from helpers.source_tree import modules


def _called_points() -> dict[str, list[str]]:
    """Every point an ``inject_fault`` call in src/ names, in POINTS' form (an f-string's fields as N), with where."""
    called: dict[str, list[str]] = {}
    for module in modules(SRC):
        path = module.where
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "inject_fault":
                (arg,) = node.args
                if isinstance(arg, ast.Constant):
                    form = point_form(arg.value)
                else:
                    assert isinstance(arg, ast.JoinedStr), f"{path}:{node.lineno}: a point must be a literal"
                    form = "".join(v.value if isinstance(v, ast.Constant) else "N" for v in arg.values)
                called.setdefault(form, []).append(f"{path}:{node.lineno}")
    return called


def test_every_point_called_is_declared_and_every_declared_point_is_called():
    called = _called_points()
    assert sorted(set(called) - set(POINTS)) == [], "called but not declared in faults.POINTS"
    assert sorted(set(POINTS) - set(called)) == [], "declared in faults.POINTS but never called"
    assert len(POINTS) == len(set(POINTS))


def test_a_fault_at_a_point_that_does_not_exist_is_refused_naming_the_points():
    with pytest.raises(ValueError, match=r"no fault point 'iteraton 40' .* the points are iteration N, "):
        _parse("trainer1@iteraton 40:kill", 0)
    with pytest.raises(ValueError, match="no fault point 'checkpoint 20'"):  # "checkpoint N written" is one
        _parse("server1@checkpoint 20:kill", 0)
    assert _parse("server1@checkpoint 20 written:kill", 0) == {("server1", "checkpoint 20 written"): ("kill", 0.0)}
