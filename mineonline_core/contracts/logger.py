"""The Logger contract.

Loggers run inside the run's logging actor (``LoggerHub``), never on the rollout or training hot
path: producers send metrics with fire-and-forget actor calls and the hub feeds every active logger
from a background thread. All metrics share one step axis: total env steps.

A logger's ``Config`` lists the ``logger_config`` keys it consumes. ``logger_config.loggers`` selects
loggers by name; every other ``logger_config`` key must be consumed by at least one selected logger.

A logger that keeps a run of its own (wandb's) stores that run's id in the run directory
(``keep_run_id``) and, when the run resumes from a checkpoint, continues it (``resumed_run_id``):
one curve across a resume.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict


#: The run directory's file of logger run ids, ``{logger name: run id}``.
RUN_IDS = "logger_runs.json"


class LoggerOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Logger(ABC):
    """Receives scalars, histograms, videos and the resolved config of one run."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[BaseModel]] = LoggerOptions

    def __init__(self, *, run_dir: str, options: BaseModel, config: dict[str, Any]) -> None:
        self.run_dir, self.options, self.config = run_dir, options, config

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Scalars, keyed by ``/``-namespaced names (``trainer/policy_loss``)."""

    def log_histogram(self, key: str, values: np.ndarray, step: int) -> None:
        """A distribution (advantages, values, staleness). Optional."""

    def log_video(self, key: str, path: str, step: int) -> None:
        """An mp4 file already written under the run directory. Optional."""

    def resume(self, step: int) -> None:
        """The run resumed from a checkpoint taken at env step ``step``: what the run logged after that
        step is about to be logged again. Called before any new point. Optional: a logger whose
        storage can drop later points (TensorBoard's purge step) does so here."""

    def rewind(self, iteration: int) -> None:
        """A trainer rank died and its replacement restarted from the checkpoint of ``iteration``: the
        iterations after it are trained and logged again. Optional: a logger that can drop what it
        recorded of them does so (the console logger does: ``metrics.jsonl`` keeps one record per
        iteration); rollout's own points stay, they happened."""

    def finish(self) -> None:
        """Flush and close; called once at the end of the run."""

    def resumed_run_id(self) -> str | None:
        """The id this logger kept (``keep_run_id``) when this run resumes from a checkpoint, else None."""
        if not (self.config.get("train_config") or {}).get("resume"):
            return None
        try:
            return json.loads((Path(self.run_dir) / RUN_IDS).read_text()).get(self.name)
        except (OSError, ValueError, AttributeError):
            return None

    def keep_run_id(self, run_id: Any) -> None:
        """Remember this logger's own run id in the run directory, for a resumed run to continue."""
        path = Path(self.run_dir) / RUN_IDS
        try:
            ids = json.loads(path.read_text())
        except (OSError, ValueError):
            ids = {}
        ids[self.name] = str(run_id)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(ids, indent=1))
        os.replace(tmp, path)
