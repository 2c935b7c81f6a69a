"""The Logger contract.

Loggers run inside the run's logging actor (``LoggerHub``), never on the rollout or training hot
path: producers send metrics with fire-and-forget actor calls and the hub feeds every active logger
from a background thread. All metrics share one step axis: total env steps.

A logger's ``Config`` lists the ``logger_config`` keys it consumes. ``logger_config.loggers`` selects
loggers by name; every other ``logger_config`` key must be consumed by at least one selected logger.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict


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

    def finish(self) -> None:
        """Flush and close; called once at the end of the run."""
