"""mineonline-tensorboard-logger: a run's scalars and histograms as TensorBoard event files.

Select it with ``logger_config.loggers: [tensorboard]`` (alone or beside ``wandb``); view with
``tensorboard --logdir runs/<run_name>/tensorboard``. It is also the smallest complete logger plugin,
for third parties to copy: one module, a ``Config`` of the ``logger_config`` keys it consumes, the
``Logger`` methods, and one hook that registers the class.

* The step of every point is the run's env-step count (the axis every mineonline metric shares).
* Writing is PyTorch's ``SummaryWriter``, inside the run's logging actor: never on a hot path.
* A resumed run continues the same event files' curves: ``resume(step)`` reopens the writer with
  TensorBoard's purge step, so the points the previous process logged after the checkpoint are
  dropped by TensorBoard and replaced by the retrained ones.
* The run's config (the public one, secrets redacted) is recorded once per process start: as text
  (tag ``config``, the YAML in a code block) and as TensorBoard HParams, every leaf key flattened to
  its dotted path (``train_config.learning_rate``), with ``episode/return_mean`` as the metric the
  HParams dashboard compares runs by. Lists and null are shown as their YAML text.
* Videos are left to the run directory (``videos/``) and wandb: TensorBoard's video support needs
  moviepy and stores every frame again.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

import mineonline_core
from mineonline_core.contracts.logger import Logger


HPARAMS_METRIC = "episode/return_mean"


def flat_hparams(config: dict[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """Every leaf of a nested config as ``dotted.key -> value`` of a type HParams accepts."""
    out: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_hparams(value, f"{path}."))
        elif isinstance(value, (bool, int, float, str)):
            out[path] = value
        else:  # lists and null: their YAML text
            import yaml

            out[path] = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    return out


class TensorBoardOptions(BaseModel):
    """The ``logger_config`` keys the TensorBoard logger consumes."""

    model_config = ConfigDict(extra="ignore")

    tensorboard_dir: str = Field(
        "tensorboard", description="Event file directory; relative paths are under the run directory."
    )
    flush_secs: float = Field(10.0, gt=0, description="Seconds between flushes of pending events to disk.")


class TensorBoardLogger(Logger):
    """Writes scalars and histograms with ``torch.utils.tensorboard.SummaryWriter``."""

    name: ClassVar[str] = "tensorboard"
    Config: ClassVar[type[BaseModel]] = TensorBoardOptions

    def __init__(self, *, run_dir: str, options: BaseModel | None = None, config: dict[str, Any] | None = None) -> None:
        options = options if options is not None else TensorBoardOptions()
        super().__init__(run_dir=run_dir, options=options, config=config or {})
        directory = options.tensorboard_dir
        self.log_dir = directory if os.path.isabs(directory) else os.path.join(run_dir, directory)
        self.writer = self._open(purge_step=None)
        self._record_config(self.config)

    def _open(self, *, purge_step: int | None) -> Any:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package: a declared dependency

        return SummaryWriter(log_dir=self.log_dir, purge_step=purge_step, flush_secs=self.options.flush_secs)

    def _record_config(self, config: dict[str, Any]) -> None:
        if not config:
            return
        import yaml
        from torch.utils.tensorboard.summary import hparams

        text = yaml.safe_dump(config, sort_keys=False)
        # TensorBoard renders text as Markdown: an indented block keeps the YAML as written.
        self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), global_step=0)
        for summary in hparams(flat_hparams(config), {HPARAMS_METRIC: 0.0}):
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)

    def log_histogram(self, key: str, values: np.ndarray, step: int) -> None:
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        values = values[np.isfinite(values)]
        if values.size:
            self.writer.add_histogram(key, values, global_step=step)

    def resume(self, step: int) -> None:
        self.writer.close()
        # TensorBoard discards earlier points at steps >= purge_step: the previous process's points
        # after the checkpoint, which this run logs again.
        self.writer = self._open(purge_step=step + 1)

    def finish(self) -> None:
        self.writer.close()


@mineonline_core.hookimpl
def mineonline_register_loggers(register: Any) -> None:
    register(TensorBoardLogger)
