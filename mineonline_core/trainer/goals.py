"""When a run has done enough, and which checkpoint is its best, judged from the run's metrics.

``train_config.max_env_steps`` and ``train_config.stop_at_return`` end a run before
``num_iterations``; ``train_config.keep_best`` keeps the checkpoint with the highest
``keep_best_metric`` in ``<save_path>/best/``. For the moving-window episode return
(``episode/return_mean``) rank 0 reads the logging actor's latest values once per iteration; the
return is trusted only once the statistics window is full, so one lucky early episode neither stops
a run nor becomes its best. For the evaluation's return (``eval/return_mean``) rank 0 judges each
evaluation's result as it arrives (``trainer/evaluation.py``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

RETURN_KEY, COUNT_KEY, STEPS_KEY = "episode/return_mean", "episode/count", "env_steps"
BEST_DIR, BEST_FILE = "best", "best.json"


class Goals:
    """The stop criteria and the best-checkpoint rule of one run's config."""

    def __init__(self, config: Any) -> None:
        train_config = config.train_config
        self.max_env_steps, self.stop_at_return, self.keep_best = (
            train_config.max_env_steps,
            train_config.stop_at_return,
            train_config.keep_best,
        )
        self.window = config.rollout_config.episode_statistics_config.window
        self.metric = train_config.keep_best_metric
        self.best_return: float | None = None  # the best keep_best_metric so far

    @property
    def active(self) -> bool:
        return self.max_env_steps is not None or self.stop_at_return is not None or self.keep_best

    def window_return(self, latest: dict[str, float]) -> float | None:
        """The moving-window mean return, once ``window`` episodes have finished."""
        if latest.get(COUNT_KEY, 0.0) < self.window or RETURN_KEY not in latest:
            return None
        return float(latest[RETURN_KEY])

    def stop_reason(self, latest: dict[str, float]) -> str | None:
        """Why the run should stop now, or None."""
        steps = latest.get(STEPS_KEY, 0.0)
        if self.max_env_steps is not None and steps >= self.max_env_steps:
            return f"train_config.max_env_steps={self.max_env_steps} reached ({int(steps)} env steps)"
        value = self.window_return(latest)
        if self.stop_at_return is not None and value is not None and value >= self.stop_at_return:
            over = f"({RETURN_KEY} {value:.4g} over {self.window} episodes)"
            return f"train_config.stop_at_return={self.stop_at_return:g} reached {over}"
        return None

    @property
    def judges_by_eval(self) -> bool:
        """``keep_best`` judged by the evaluations' results rather than by the latest metrics."""
        return self.keep_best and self.metric.startswith("eval/")

    def improved(self, latest: dict[str, float]) -> float | None:
        """The new best window return when ``keep_best`` judges by it and it beats the best so far."""
        if self.judges_by_eval:
            return None
        return self.improved_value(self.window_return(latest))

    def improved_value(self, value: float | None) -> float | None:
        """``value`` of ``keep_best_metric`` when ``keep_best`` is on and it beats the best so far."""
        if not self.keep_best or value is None or (self.best_return is not None and value <= self.best_return):
            return None
        self.best_return = value
        return value


def replace_best(best_root: Path, written: Path, record: dict[str, Any]) -> None:
    """Keep only ``written`` under ``best_root`` and describe it in ``best.json``."""
    for child in best_root.iterdir():
        if child.is_dir() and child != written:
            shutil.rmtree(child, ignore_errors=True)
    tmp = best_root / f".{BEST_FILE}.tmp"
    tmp.write_text(json.dumps({"checkpoint": written.name, **record}, indent=1))
    os.replace(tmp, best_root / BEST_FILE)
