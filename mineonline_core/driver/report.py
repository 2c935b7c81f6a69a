"""The run report: PNG plots drawn from ``metrics.jsonl`` in a run directory.

``write_report(run_dir)`` runs at the end of every run and on ``mineonline report RUN_DIR`` (several
runs: ``compare.py``). It writes ``report_learning_curve.png`` (episode return vs env steps),
``report_losses.png`` (trainer losses vs env steps), ``report_throughput.png`` (env steps/s and training
samples/s) and, for Crafter runs, ``report_crafter.png`` (achievement success rates and the score). A
metric that never appeared gives a panel that says "no data", never a crash.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from mineonline_core.builtin.console import METRICS_FILE
from mineonline_core.errors import MineOnlineError

Series = dict[str, tuple[list[float], list[float]]]

RETURN_KEY = "episode/return_mean"
THROUGHPUT_KEYS = ("rollout/env_steps_per_s", "trainer/samples_per_s")
# Trainer scalars plotted with the losses: they are how one reads whether an update went wrong.
LOSS_EXTRA_KEYS = (
    "trainer/entropy",
    "trainer/kl_ref",
    "trainer/approx_kl",
    "trainer/clipfrac",
    "trainer/explained_variance",
)


def read_metrics(path: Path) -> Series:
    """Every numeric metric in a metrics JSONL file as (steps, values), steps strictly increasing.

    A resumed run logs again the steps after its checkpoint that the interrupted attempt had already
    logged: where a metric's step goes back, the later records replace the earlier ones from that step
    on, so a curve never zig-zags back. A truncated last line (a run killed
    mid-write) is skipped; non-numeric fields are ignored.
    """
    series: Series = defaultdict(lambda: ([], []))
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            step = record.get("step")
            if not isinstance(step, (int, float)):
                continue
            for key, value in record.items():
                if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if math.isfinite(value):
                    xs, ys = series[key]
                    while xs and xs[-1] >= step:  # a resume went back: its records replace the old ones
                        xs.pop()
                        ys.pop()
                    xs.append(float(step))
                    ys.append(float(value))
    return dict(series)


def _short_number(x: float, _pos: object = None) -> str:
    # Env-step axes reach millions: "2.5M" reads better than overlapping "2500000" labels.
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:g}{suffix}"
    return f"{x:g}"


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no data\n({what})", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _plot_keys(ax, series: Series, keys: list[str], *, title: str, ylabel: str = "") -> None:
    present = [k for k in keys if k in series]
    ax.set_title(title, fontsize=10)
    if not present:
        _no_data(ax, ", ".join(keys) if keys else title)
        return
    for key in present:
        xs, ys = series[key]
        ax.plot(xs, ys, label=key, marker="." if len(xs) < 30 else None)
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax.set_xlabel("env steps")
    ax.xaxis.set_major_formatter(FuncFormatter(_short_number))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(present) > 1:
        ax.legend(fontsize=7)


def _grid(n: int):
    import matplotlib.pyplot as plt

    cols = min(n, 3)
    rows = max(1, math.ceil(n / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    return fig, list(axes.flat[:n])


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


def _learning_curve(series: Series, path: Path) -> Path:
    tasks = sorted(k for k in series if k.startswith("episode/") and k.endswith("/return_mean") and k != RETURN_KEY)
    fig, (ax,) = _grid(1)
    _plot_keys(ax, series, [RETURN_KEY, *tasks], title="episode return (moving window)", ylabel="return")
    return _save(fig, path)


def _losses(series: Series, path: Path) -> Path:
    keys = sorted(k for k in series if k.startswith("trainer/") and "loss" in k.rsplit("/", 1)[-1])
    keys += [k for k in LOSS_EXTRA_KEYS if k in series]
    if not keys:
        fig, (ax,) = _grid(1)
        _plot_keys(ax, series, ["trainer/policy_loss", "trainer/value_loss"], title="trainer losses")
    else:
        fig, axes = _grid(len(keys))  # one panel per key: losses live on very different scales
        for ax, key in zip(axes, keys):
            _plot_keys(ax, series, [key], title=key)
    return _save(fig, path)


def _throughput(series: Series, path: Path) -> Path:
    fig, axes = _grid(len(THROUGHPUT_KEYS))
    for ax, key in zip(axes, THROUGHPUT_KEYS):
        _plot_keys(ax, series, [key], title=key, ylabel="per second")
    return _save(fig, path)


def _crafter(series: Series, path: Path) -> Path:
    import numpy as np

    fig, axes = _grid(2)
    names = sorted(k for k in series if k.startswith("crafter/success/"))
    axes[0].set_title("Crafter success rates (last window)", fontsize=10)
    rates = [100.0 * series[k][1][-1] for k in names]
    axes[0].barh(np.arange(len(names)), rates, color="tab:green")
    axes[0].set_yticks(np.arange(len(names)), [k.rsplit("/", 1)[-1] for k in names], fontsize=6)
    axes[0].set_xlabel("success rate (%)")
    axes[0].set_xlim(0, 100)
    _plot_keys(axes[1], series, ["crafter/score"], title="Crafter score (%)")
    return _save(fig, path)


def write_report(run_dir: str | Path) -> list[Path]:
    """Write the report PNGs into ``run_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters; must precede pyplot's first import

    run_dir = Path(run_dir)
    metrics = run_dir / METRICS_FILE
    if not run_dir.is_dir():
        raise MineOnlineError(
            f"mineonline report: {str(run_dir)!r} is not a directory. Pass a run directory "
            f"(<output_dir>/<run_name>, for example runs/my-run) that holds {METRICS_FILE}."
        )
    series = read_metrics(metrics) if metrics.is_file() else {}
    paths = [
        _learning_curve(series, run_dir / "report_learning_curve.png"),
        _losses(series, run_dir / "report_losses.png"),
        _throughput(series, run_dir / "report_throughput.png"),
    ]
    if any(k.startswith("crafter/success/") for k in series):
        paths.append(_crafter(series, run_dir / "report_crafter.png"))
    return paths
