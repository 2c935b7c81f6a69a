"""The console logger, the one logger every run has.

``ConsoleLogger`` runs inside the ``LoggerHub``: it appends one JSON object per ``log_metrics`` call
to ``metrics.jsonl`` in the run directory (the file ``mineonline report`` plots), and at the end
writes ``summary.json`` (the driver prints the summary table, ``driver/progress.py``).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import IO, Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict

from mineonline_core.contracts.logger import Logger

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"


def _json_value(value: float) -> float | None:
    # JSON has no NaN or infinity; null keeps the line valid for every reader.
    return value if math.isfinite(value) else None


class ConsoleOptions(BaseModel):
    """The console logger consumes no ``logger_config`` keys."""

    model_config = ConfigDict(extra="ignore")


class ConsoleLogger(Logger):
    """Writes ``metrics.jsonl`` and, when the run ends, ``summary.json``."""

    name: ClassVar[str] = "console"
    Config: ClassVar[type[BaseModel]] = ConsoleOptions

    def __init__(self, *, run_dir: str, options: BaseModel | None = None, config: dict[str, Any] | None = None) -> None:
        super().__init__(run_dir=run_dir, options=options or ConsoleOptions(), config=config or {})
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, METRICS_FILE)
        # Append: a resumed run continues the same file and the report shows the whole history.
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")
        self._last: dict[str, float] = {}
        self._last_step = 0

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        # One flush per call: lines are whole on disk even if the process is killed.
        self._file.flush()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._last.update(metrics)
        self._last_step = max(self._last_step, step)
        self._write({"step": step, "time": time.time(), **{k: _json_value(float(v)) for k, v in metrics.items()}})

    def log_histogram(self, key: str, values: np.ndarray, step: int) -> None:
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        values = values[np.isfinite(values)]
        if values.size == 0:
            return
        self._last_step = max(self._last_step, step)
        stats = {f"{key}/mean": float(values.mean()), f"{key}/std": float(values.std())}
        self._last.update(stats)
        self._write({"step": step, "time": time.time(), **stats})

    def log_video(self, key: str, path: str, step: int) -> None:
        self._last_step = max(self._last_step, step)
        rel = os.path.relpath(path, self.run_dir)
        # A non-numeric record: the report reads only numbers, people and scripts find the videos.
        self._write({"step": step, "time": time.time(), "video": key, "path": rel})

    def rewind(self, iteration: int) -> None:
        """Drop the training records logged after iteration ``iteration``'s: its later iterations'
        records and the histograms logged with them (``trainer/`` keys past that iteration's step)."""
        if self._file is None:
            return
        self._file.close()
        with open(self.path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        steps = [r["step"] for r in records if r.get("trainer/iteration") == iteration]
        last_step = steps[-1] if steps else -1

        def later(record: dict[str, Any]) -> bool:
            if not any(k.startswith("trainer/") for k in record):
                return False
            done = record.get("trainer/iteration")
            return done > iteration if done is not None else record.get("step", 0) > last_step

        kept = [r for r in records if not later(r)]
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in kept)
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")

    def finish(self) -> None:
        if self._file is None:
            return
        self._file.close()
        self._file = None
        summary = {"env_steps": self._last_step, **{k: _json_value(v) for k, v in sorted(self._last.items())}}
        tmp = os.path.join(self.run_dir, SUMMARY_FILE + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
        os.replace(tmp, os.path.join(self.run_dir, SUMMARY_FILE))
