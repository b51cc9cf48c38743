"""Settings the roles of a job are given separately, agreed at check-in.

The original system gives some settings to only some roles: the embedding width to the trainers
(``emb_size``, the bottom MLP's last size) or a server (``--emb-size``), the table sizes to a
trainer script (``ln_emb``) or any role (``--emb-info-file``), the model to the trainers. Each
role states what it was given; a setting is taken from wherever it is given and must be the same
wherever else it is, else a clear error names both roles. Pure: no store, no processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Settings every role may state, and the model's (ModelConfig fields) under "model."
AGREED = ("emb_dim", "table_sizes", "cache_rows", "lookahead", "optimizer", "lr", "kind")
KINDS = ("model", "script")  # bagpipe trainers (the job's model) or user scripts (their own model)


@dataclass
class Given:
    """What one role was given: its label (``trainer 0 (rank 1)``) and its settings by name."""

    label: str
    settings: dict[str, Any] = field(default_factory=dict)


def agree(givens: list[Given]) -> dict[str, Any]:
    """Every setting some role states, once: a ValueError naming two roles that state it differently."""
    agreed: dict[str, tuple[Any, str]] = {}
    for given in givens:
        for name, value in given.settings.items():
            if name not in agreed:
                agreed[name] = (value, given.label)
            elif not _same(agreed[name][0], value):
                first, where = agreed[name]
                raise ValueError(f"the roles disagree on {_flag(name)}: {where} has {_shown(first)}, "
                                 f"{given.label} has {_shown(value)}")
    if "kind" in agreed and agreed["kind"][0] not in KINDS:
        raise ValueError(f"unknown trainer kind {agreed['kind'][0]!r}")
    return {name: value for name, (value, _) in agreed.items()}


def agree_table_sizes(given: list[int] | None, data: list[int], *, inferred: bool, where: str) -> list[int]:
    """The job's table sizes: the data's, or the ones given, which the data's ids must fit.

    Sizes a data set states (a meta.json, --table-sizes) must equal any given; sizes inferred from
    the largest ids (JSON lines with none stated) only bound them from below.
    """
    if given is None:
        return list(data)
    if len(given) != len(data):
        raise ValueError(f"{where} gives {len(given)} table sizes, the data has {len(data)} tables")
    if not inferred and list(given) != list(data):
        first = next(i for i, (a, b) in enumerate(zip(given, data)) if a != b)
        raise ValueError(f"{where} gives table {first} {given[first]} rows, the data states {data[first]}")
    small = [i for i, (a, b) in enumerate(zip(given, data)) if a < b]
    if small:
        raise ValueError(f"{where} gives table {small[0]} {given[small[0]]} rows, but the data has ids up to "
                         f"{data[small[0]] - 1} there")
    return list(given)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9)
    return a == b


def _flag(name: str) -> str:
    return {"emb_dim": "the embedding size (--emb-size, emb_size)", "table_sizes": "the table sizes "
            "(--emb-info-file, ln_emb)", "cache_rows": "the cache size (--cache-size, cache_size)",
            "lookahead": "the lookahead (--lookahead-value, lookahead_value)", "kind": "the trainers' kind (bagpipe "
            "trainers or user scripts)", "optimizer": "the embedding optimizer (--optimizer, emb_optim)",
            "lr": "the learning rate (--lr, emb_optim_params)", "model.name": "the model (--model, "
            "init_cache(model=...); external: a script's own)"}.get(name, f"--{name.removeprefix('model.')}")


def _shown(value: Any) -> str:
    if isinstance(value, list) and len(value) > 4:
        return f"[{', '.join(map(str, value[:4]))}, ... ({len(value)} values)]"
    return repr(value)


def stated(train: dict[str, Any], model: dict[str, Any], *, table_sizes: list[int] | None = None,
           kind: str | None = None) -> dict[str, Any]:
    """A role's given settings (``config.given_settings``' two dicts) as ``agree`` takes them."""
    settings = {name: train[name] for name in ("cache_rows", "lookahead", "optimizer", "lr") if name in train}
    settings.update({("emb_dim" if name == "emb_dim" else f"model.{name}"): value for name, value in model.items()})
    if table_sizes is not None:
        settings["table_sizes"] = list(table_sizes)
    if kind is not None:
        settings["kind"] = kind
    return settings
