"""``bagpipe report RUN_DIR [RUN_DIR ...]``: a printed summary and PNG plots of finished runs.

Reads each run dir's ``metrics.jsonl`` and ``summary.json`` (both modes) and writes, with every
run drawn in the same axes so that runs compare at a glance:

    loss_auc.png         train loss over samples; eval AUC and HR@10, each on axes of its own (one point per
                         evaluation: --eval-every N), with the planted best and a next-item run's baselines
    throughput.png       samples/s over time (per log window)
    time_breakdown.png   steady-state milliseconds per iteration by phase, one bar per run
    time_per_window.png  the same breakdown over the iterations of each run
    cache.png            cache hit rate and rows fetched per iteration (bagpipe runs)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from bagpipe.config import RUN_MODES, Mode, partitioned_cache
from bagpipe.timing import PHASES

PLOTS = ("loss_auc.png", "throughput.png", "time_breakdown.png", "time_per_window.png", "cache.png")


@dataclass
class Run:
    path: Path
    label: str
    summary: dict
    train: list[dict]  # periodic training records
    evals: list[dict]  # in iteration order

    def eval_samples(self, record: dict) -> int:
        """Samples trained before an evaluation (a run that logged only its iteration: from its batch size)."""
        if "samples" in record:
            return record["samples"]
        last = self.train[-1]
        return record["iteration"] * last["samples"] // max(last["iteration"], 1)


def load_run(path: str | Path, label: str | None = None) -> Run:
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ValueError(f"{path}: no metrics.jsonl; is this a run dir?")
    records = []
    for number, line in enumerate(metrics.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{metrics}:{number}: not JSON ({err})") from None
    summary_path = path / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    train = sorted((r for r in records if "train_loss" in r), key=lambda r: r["iteration"])
    evals = sorted((r for r in records if r.get("event") == "eval"), key=lambda r: r["iteration"])
    if not train:
        raise ValueError(f"{metrics}: no training records yet")
    return Run(path=path, label=label or _default_label(path, summary), summary=summary, train=train, evals=evals)


def summary_mode(summary: dict) -> Mode:
    """The mode a run's summary names (a mode of no cache and one process where it names none this bagpipe has)."""
    return RUN_MODES.get(summary.get("mode"), Mode(str(summary.get("mode")), frozenset(), "unknown"))


def _default_label(path: Path, summary: dict) -> str:
    if "mode" not in summary:
        return path.name
    mode = summary_mode(summary)
    if mode.processes:
        return (f"{path.name} ({mode.name}, {summary.get('trainers')} trainers, {summary.get('policy')}"
                + (", partitioned" if partitioned_cache(summary.get("cache_mode", "")) else "") + ")")
    if mode.cached:
        return f"{path.name} ({mode.name}, {summary.get('policy')})"
    return f"{path.name} ({mode.name})"


def figure(value, spec: str) -> str:
    """``value`` formatted by ``spec``, or ``n/a`` for a figure a run could not measure (null or NaN in its
    summary: a hit rate with no lookups, a throughput with no steady state)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec)


def headline(record: dict) -> tuple[str, str]:
    """The evaluation metric a run reports first: AUC for CTR models, HR@10 for next-item ones."""
    return ("hr10", "HR@10") if "eval_hr10" in record else ("auc", "AUC")


def summarize(run: Run) -> str:
    s, last = run.summary, run.train[-1]
    lines = [f"{run.label}: {s.get('mode', '?')} mode, {last['iteration']} iterations, {last['samples']:,} samples"]
    if s:
        lines.append(f"  throughput   {figure(s['samples_per_s'], ',.0f')} samples/s steady state"
                     + (f", start-up {s['startup_s']:.1f} s" if _finite(s.get("startup_s")) else "")
                     + f", wall {s['wall_s']:.1f} s")
        metric, name = headline(s)
        other = (f"log-loss {figure(s['eval_logloss'], '.4f')}" if metric == "auc" else f"NDCG@10 {figure(s['eval_ndcg10'], '.4f')}")
        lines.append(f"  train loss   {figure(s['final_train_loss'], '.4f')}   eval {name} {figure(s['eval_' + metric], '.4f')}   {other}")
    else:
        lines.append(f"  (no summary.json: unfinished run) last train loss {last['train_loss']:.4f}")
    if summary_mode(s).cached:
        lines.append(f"  cache        {s['cache_rows']:,} of {s['total_rows']:,} rows, hit rate "
                     f"{figure(s['cache_hit_rate'], '.3f')}, {figure(s['rows_moved_per_iteration'], ',.0f')} rows moved per iteration"
                     + (f", stall {100 * s['embedding_stall_fraction']:.1f}%, {s['bytes_sent'] / 2**20:,.1f} MiB sent"
                        if summary_mode(s).processes else ""))
    breakdown = s.get("time_breakdown_ms") or {}
    if breakdown:
        total = sum(breakdown.values())
        parts = ", ".join(f"{phase} {ms:.1f}" for phase, ms in sorted(breakdown.items(), key=lambda kv: -kv[1])
                          if ms >= 0.05 * total)
        lines.append(f"  iteration    {total:.1f} ms: {parts} (phases over 5%)")
    peak = s.get("peak_rss_bytes") or {}
    if peak:
        lines.append("  peak memory  " + ", ".join(f"{role} {b / 2**20:,.0f} MiB" for role, b in peak.items()))
    cpu = s.get("cpu_s") or {}
    if cpu:
        lines.append("  CPU time     " + ", ".join(f"{role} {sec:,.1f} s" for role, sec in cpu.items()))
    return "\n".join(lines + baseline_lines(s) + health_lines(s))


def baseline_lines(summary: dict) -> list[str]:
    """A next-item run's baselines, ranked as its model was (bagpipe.ranking), beside its own figures."""
    if "eval_popular_hr10" not in summary:
        return []
    rows = [("model", "eval_"), ("most popular", "eval_popular_"), ("co-occurrence", "eval_cooccurrence_")]
    return [f"  {'vs baselines' if i == 0 else '':12} {name:14} HR@10 {figure(summary.get(prefix + 'hr10'), '.4f')}"
            f"   NDCG@10 {figure(summary.get(prefix + 'ndcg10'), '.4f')}" for i, (name, prefix) in enumerate(rows)]


def health_lines(summary: dict) -> list[str]:
    """The best evaluation (which model/ holds, with --keep-best) and the warnings about the run's health."""
    lines = []
    best = summary.get("best_metrics")
    if best and summary.get("best_iteration") != summary.get("iterations"):
        metric, name = headline(best)
        kept = "model/ holds it (--keep-best)" if summary.get("keep_best") else "model/ holds the last"
        chosen = (f" (test; chosen by its validation {name} {figure(best['valid_' + metric], '.4f')})"
                  if "valid_" + metric in best else "")
        lines.append(f"  best eval    {name} {figure(best.get('eval_' + metric), '.4f')}{chosen} at iteration "
                     f"{summary['best_iteration']}: {kept}")
    lines += [f"  WARNING      {warning['message']}" for warning in summary.get("warnings") or []]
    return lines


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def write_plots(runs: list[Run], out: str | Path) -> list[Path]:
    """Write the PNGs into ``out``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    # Loss, and each evaluation metric on axes of its own (AUC for click models, HR@10 for next-item ones).
    metrics = [(m, n) for m, n in (("auc", "AUC"), ("hr10", "HR@10"))
               if any(f"eval_{m}" in r for run in runs for r in run.evals)]
    fig, axes = plt.subplots(1, 1 + max(len(metrics), 1), figsize=(5.5 * (1 + max(len(metrics), 1)), 4),
                             squeeze=False)
    ax_loss, eval_axes = axes[0, 0], list(axes[0, 1:])
    styles = _styles(runs)
    for run in runs:
        ax_loss.plot([r["samples"] for r in run.train], [r["train_loss"] for r in run.train], label=run.label,
                     **styles[run.label])
    ax_loss.set(title="train loss (mean per log window)", xlabel="samples", ylabel="loss")
    ax_loss.legend(fontsize="small")
    for ax, (metric, name) in zip(eval_axes, metrics):
        for run in runs:
            points = [(run.eval_samples(r), r[f"eval_{metric}"]) for r in run.evals if f"eval_{metric}" in r]
            if not points:
                continue
            line, = ax.plot(*zip(*points), marker="o", label=run.label, **styles[run.label])
            chosen_by = [(run.eval_samples(r), r[f"valid_{metric}"]) for r in run.evals if f"valid_{metric}" in r]
            if chosen_by:  # the validation split's curve: what the warnings and --keep-best judge
                ax.plot(*zip(*chosen_by), marker="o", markerfacecolor="none", linewidth=0.8, alpha=0.7,
                        color=line.get_color(), label=f"validation split: {run.label}")
            lines = [("best", "best achievable (planted model)", ":")] + [
                (f"eval_{key}_", f"{what} baseline", "--") for key, what in (("popular", "most-popular"),
                                                                              ("cooccurrence", "co-occurrence"))]
            for key, what, dash in lines:
                value = run.summary.get(f"{key}_{metric}" if key == "best" else f"{key}{metric}")
                if _finite(value):
                    ax.axhline(value, linestyle=dash, color=line.get_color(), linewidth=1,
                               label=f"{what}: {run.label}")
        single = all(len(run.evals) <= 1 for run in runs)
        ax.set(title=f"eval {name}" + (" (the final evaluation only: --eval-every N draws a curve)" if single
                                       else ""), xlabel="samples", ylabel=name)
        ax.legend(fontsize="x-small")
    if not metrics:
        eval_axes[0].text(0.5, 0.5, "no evaluation in these runs", ha="center", transform=eval_axes[0].transAxes)
    save(fig, "loss_auc.png")

    # Throughput over time.
    fig, ax = plt.subplots(figsize=(8, 4))
    for run in runs:
        key = "window_samples_per_s" if "window_samples_per_s" in run.train[-1] else "samples_per_s"
        points = [(r["elapsed_s"], r[key]) for r in run.train if _finite(r.get(key))]
        if points:
            ax.plot(*zip(*points), marker=".", label=run.label)
    ax.set(title="training throughput per log window", xlabel="training time (s)", ylabel="samples/s")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    save(fig, "throughput.png")

    # Steady-state time breakdown: one stacked bar per run.
    phases = _phases(run.summary.get("time_breakdown_ms") or {} for run in runs)
    fig, ax = plt.subplots(figsize=(12, 2.2 + 0.6 * len(runs)))
    left = [0.0] * len(runs)
    for phase in phases:
        widths = [(run.summary.get("time_breakdown_ms") or {}).get(phase, 0.0) for run in runs]
        ax.barh(range(len(runs)), widths, left=left, label=phase, color=_color(plt, phase))
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(range(len(runs)), [run.label for run in runs], fontsize="small")
    ax.set(title="where an iteration's time goes (steady state, per trainer)", xlabel="ms per iteration")
    if phases:
        ax.legend(fontsize="small", ncol=min(len(phases), 4), loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save(fig, "time_breakdown.png")

    # The breakdown over each run's iterations.
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        windows = [r for r in run.train if r.get("time_ms")]
        run_phases = _phases(r["time_ms"] for r in windows)
        if windows:
            ax.stackplot([r["iteration"] for r in windows],
                         *[[r["time_ms"].get(p, 0.0) for r in windows] for p in run_phases], labels=run_phases,
                         colors=[_color(plt, p) for p in run_phases])
            ax.legend(fontsize="x-small", ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        else:
            ax.text(0.5, 0.5, "no per-iteration timing in this run's metrics", ha="center", transform=ax.transAxes)
        ax.set(title=run.label, xlabel="iteration", ylabel="ms per iteration")
    save(fig, "time_per_window.png")

    # Cache behaviour.
    fig, (ax_hit, ax_rows) = plt.subplots(1, 2, figsize=(11, 4))
    cached = [run for run in runs if any("cache_hit_rate" in r for r in run.train)]
    for run in cached:
        points = [(r["iteration"], r["cache_hit_rate"]) for r in run.train if r.get("cache_hit_rate") is not None]
        if points:
            ax_hit.plot(*zip(*points), label=run.label)
        ax_rows.plot([r["iteration"] for r in run.train],
                     [r.get("rows_fetched_per_iteration", float("nan")) for r in run.train], label=run.label)
    if not cached:
        for ax in (ax_hit, ax_rows):
            ax.text(0.5, 0.5, "no cache in these runs (reference mode)", ha="center", transform=ax.transAxes)
    else:
        ax_hit.legend(fontsize="small")
    ax_hit.set(title="cache hit rate (distinct rows of the batch already resident)", xlabel="iteration",
               ylabel="hit rate")
    ax_rows.set(title="rows fetched per iteration (per trainer)", xlabel="iteration", ylabel="rows")
    save(fig, "cache.png")
    return written


def _styles(runs: list[Run]) -> dict[str, dict]:
    """Each run's line style: runs drawn over one another (identical runs, as the exactness claims make them)
    stay visible, the later ones dashed, dotted and thinner on top of the earlier."""
    dashes = ["-", "--", ":", "-."]
    return {run.label: {"linestyle": dashes[i % len(dashes)], "linewidth": max(2.5 - 0.5 * i, 1.0)}
            for i, run in enumerate(runs)}


def _color(plt, phase: str):
    """One fixed colour per phase in every figure (tab20 has enough for all of them)."""
    index = PHASES.index(phase) if phase in PHASES else len(PHASES) + hash(phase) % 8
    return plt.get_cmap("tab20")(index % 20)


def _phases(breakdowns) -> list[str]:
    seen = set()
    for breakdown in breakdowns:
        seen.update(breakdown)
    return [p for p in PHASES if p in seen] + sorted(seen - set(PHASES))


def report(run_dirs: list[str | Path], *, out: str | Path | None = None, labels: list[str] | None = None) -> tuple[str, list[Path]]:
    """Summaries (one text block) and the plot files of ``run_dirs``."""
    if not run_dirs:
        raise ValueError("give at least one run dir")
    if labels and len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} run dirs")
    runs = [load_run(path, labels[i] if labels else None) for i, path in enumerate(run_dirs)]
    seen: dict[str, int] = {}
    for run in runs:  # one label per run in every legend: runs of one name in other folders told apart
        seen[run.label] = seen.get(run.label, 0) + 1
        if seen[run.label] > 1:
            run.label = f"{run.label} [{run.path.parent.name}/{run.path.name} #{seen[run.label]}]"
    out = Path(out) if out else Path(run_dirs[0]) / "report"
    files = write_plots(runs, out)
    return "\n\n".join(summarize(run) for run in runs), files
