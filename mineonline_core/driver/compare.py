"""Runs compared side by side: ``mineonline report RUN RUN ...``.

Each run directory gives its name (``run.json``), its resolved config (``config.yaml``) and its
metrics (``report.read_metrics``: one value per step, the later record winning where a resume
repeated steps, so no curve zig-zags). Runs are grouped by ``logger_config.group`` when they set
it, else by their config without the keys that only tell seeds and runs apart (``seed``,
``run_name``, ``output_dir``, ``logger_config.name``, ``train_config.resume``). A group of one run
is drawn as its curve; a group of several is drawn as the mean over its runs with a 95 % confidence
interval for that mean (Student's t over the seeds) as a band, each run's curve resampled onto the
env steps all of them reached. The legend names the runs; a text table gives each group's final
value. Steps differ between seeds (collection runs beside training), hence the resampling.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import yaml

from mineonline_core.errors import MineOnlineError
from mineonline_core.builtin.console import METRICS_FILE
from mineonline_core.driver.report import RETURN_KEY, Series, _save, read_metrics

# Keys that differ between the seeds of one experiment and say nothing about its settings.
RUN_ONLY_KEYS = (("seed",), ("run_name",), ("output_dir",), ("logger_config", "name"), ("train_config", "resume"))
# Two-sided 97.5 % quantiles of Student's t for 1..30 degrees of freedom (more: the normal's 1.96).
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)
GRID_POINTS = 100


@dataclasses.dataclass
class Run:
    name: str
    path: Path
    config: dict[str, Any]
    series: Series


@dataclasses.dataclass
class Curve:
    """One group's curve: ``low``/``high`` bound the 95 % interval of the mean (equal to ``mean`` for one run)."""

    label: str
    runs: list[str]
    steps: list[float]
    mean: list[float]
    low: list[float]
    high: list[float]


def load_run(path: str | Path) -> Run:
    path = Path(path)
    if not (path / METRICS_FILE).is_file():
        raise MineOnlineError(
            f"mineonline report: {str(path)!r} holds no {METRICS_FILE}. Fix: give run directories (runs/<run_name>)."
        )
    info = json.loads((path / "run.json").read_text()) if (path / "run.json").is_file() else {}
    config = yaml.safe_load((path / "config.yaml").read_text()) if (path / "config.yaml").is_file() else {}
    return Run(
        name=str(info.get("run_name") or path.name),
        path=path,
        config=config or {},
        series=read_metrics(path / METRICS_FILE),
    )


def group_key(config: dict[str, Any]) -> str:
    """``logger_config.group`` when set, else the config without its run-only keys (canonical JSON)."""
    group = (config.get("logger_config") or {}).get("group")
    if group:
        return str(group)
    stripped = json.loads(json.dumps(config, default=str))
    for path in RUN_ONLY_KEYS:
        section = stripped
        for key in path[:-1]:
            section = section.get(key) if isinstance(section, dict) else None
        if isinstance(section, dict):
            section.pop(path[-1], None)
    return json.dumps(stripped, sort_keys=True)


def group_runs(runs: list[Run]) -> list[list[Run]]:
    """Runs in groups of the same settings, in the order the runs were given."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(group_key(run.config), []).append(run)
    return list(groups.values())


def t975(n: int) -> float:
    return _T975[n - 2] if 2 <= n <= len(_T975) + 1 else 1.96


def aggregate(group: list[Run], key: str) -> Curve | None:
    """The group's mean curve of ``key`` with its 95 % interval; None when no run logged ``key``."""
    import numpy as np

    runs = [run for run in group if key in run.series and run.series[key][0]]
    if not runs:
        return None
    names = [run.name for run in runs]
    explicit = (runs[0].config.get("logger_config") or {}).get("group")
    label = (
        f"{explicit or names[0]}" if len(runs) == 1 else f"{explicit or 'seeds'} (n={len(runs)}: {', '.join(names)})"
    )
    if len(runs) == 1:
        xs, ys = runs[0].series[key]
        return Curve(label=label, runs=names, steps=list(xs), mean=list(ys), low=list(ys), high=list(ys))
    start = max(run.series[key][0][0] for run in runs)
    end = min(run.series[key][0][-1] for run in runs)
    grid = np.linspace(start, end, GRID_POINTS) if end > start else np.array([end])
    values = np.stack([np.interp(grid, *run.series[key]) for run in runs])
    mean = values.mean(axis=0)
    half = t975(len(runs)) * values.std(axis=0, ddof=1) / math.sqrt(len(runs))
    return Curve(
        label=label,
        runs=names,
        steps=grid.tolist(),
        mean=mean.tolist(),
        low=(mean - half).tolist(),
        high=(mean + half).tolist(),
    )


def _slug(key: str) -> str:
    return key.replace("/", "_")


def write_comparison(
    run_dirs: list[str | Path], *, output: str | Path | None = None, keys: tuple[str, ...] = (RETURN_KEY,)
) -> list[Path]:
    """One PNG per metric key overlaying the runs' groups, and ``compare.txt`` with each group's final
    value, in ``output`` (default: the first run's parent directory); returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [load_run(path) for path in run_dirs]
    out = Path(output) if output is not None else runs[0].path.parent
    out.mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs)
    written, table = [], []
    for key in keys:
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        curves = [curve for curve in (aggregate(group, key) for group in groups) if curve is not None]
        for curve in curves:
            (line,) = ax.plot(curve.steps, curve.mean, label=curve.label)
            if len(curve.runs) > 1:
                ax.fill_between(curve.steps, curve.low, curve.high, color=line.get_color(), alpha=0.25, linewidth=0)
            half = (curve.high[-1] - curve.low[-1]) / 2
            table.append(
                f"{key}\t{curve.label}\t{curve.mean[-1]:.4g}"
                + (f" ± {half:.3g} (95% CI)" if len(curve.runs) > 1 else "")
            )
        ax.set_title(
            f"{key}: mean and 95% interval over seeds" if any(len(c.runs) > 1 for c in curves) else key, fontsize=10
        )
        ax.set_xlabel("env steps")
        ax.grid(alpha=0.3)
        if curves:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, f"no data\n({key})", ha="center", va="center", transform=ax.transAxes, color="gray")
        written.append(_save(fig, out / f"compare_{_slug(key)}.png"))
    summary = out / "compare.txt"
    summary.write_text("metric\tgroup\tfinal value\n" + "\n".join(table) + "\n", encoding="utf-8")
    return [*written, summary]
