"""The ``Logger`` conformance suite: a logger plugin, driven through the run's real ``LoggerHub``.

A logger plugin tests itself with a small subclass that says how to read back what it wrote::

    class TestMyLogger(LoggerConformance):
        logger_cls = MyLogger

        def read_scalars(self, run_dir):
            return {key: [(step, value), ...]}   # what the logger's own storage holds

The suite selects the logger as a run would (validated options from ``logger_config``, the run's
resolved config), feeds it through the hub (the process where loggers live), and checks that every
scalar arrives at its env step, that histograms and videos are accepted without disabling the
logger, that ``finish`` leaves the data readable, and that a resumed run continues the same axis.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from mineonline_core.contracts.logger import Logger
from mineonline_core.services.loggerhub import LoggerHub

Scalars = dict[str, list[tuple[int, float]]]


class LoggerConformance:
    logger_cls: ClassVar[type[Logger]]
    #: ``logger_config`` keys for the logger under test (validated by its ``Config``).
    logger_options: ClassVar[dict[str, Any]] = {}

    def read_scalars(self, run_dir: Path) -> Scalars:
        """Every scalar the logger stored for the run in ``run_dir``: key -> [(step, value), ...]."""
        raise NotImplementedError

    # -- helpers ----------------------------------------------------------------------------

    def make_hub(self, run_dir: Path, *, resume: str | None = None) -> LoggerHub:
        options = self.logger_cls.Config(**self.logger_options)
        config = {
            "run_name": run_dir.name,
            "train_config": {"resume": resume},
            "logger_config": {"loggers": [self.logger_cls.name]},
        }
        return LoggerHub(
            run_dir=str(run_dir),
            loggers=[(self.logger_cls, options)],
            config=config,
            num_iterations=10,
            video_dir="videos",
        )

    def video_bytes(self) -> bytes:
        from mineonline_core.services.video import encode_episode_video

        frames = [np.full((16, 16, 3), 40 * t, np.uint8) for t in range(4)]
        return encode_episode_video(frames, fps=4, returns=[0.0, 1.0, 1.0, 2.0], values=[0.1] * 4)

    # -- the suite --------------------------------------------------------------------------

    def test_has_a_name_and_validated_options(self) -> None:
        assert self.logger_cls.name, "set the class attribute `name`: it is what logger_config.loggers selects"
        self.logger_cls.Config(**self.logger_options)

    def test_scalars_arrive_at_their_env_steps(self, tmp_path: Path) -> None:
        hub = self.make_hub(tmp_path / "run")
        hub.add_env_steps(128)
        hub.log_metrics({"trainer/policy_loss": 0.5, "episode/return_mean": 3.0})
        hub.log_batch({"trainer/policy_loss": 0.25}, {"trainer/advantages": np.linspace(-1, 1, 50)}, step=256)
        hub.log_video("rollout/video", self.video_bytes(), step=256)
        summary = hub.finish()
        assert hub.errors() == [] and summary["logger/errors"] == 0.0, hub.errors()
        scalars = self.read_scalars(tmp_path / "run")
        assert scalars["trainer/policy_loss"] == [(128, 0.5), (256, 0.25)], scalars.get("trainer/policy_loss")
        assert scalars["episode/return_mean"] == [(128, 3.0)]

    def test_a_resumed_run_continues_the_axis(self, tmp_path: Path) -> None:
        run_dir = tmp_path / "run"
        first = self.make_hub(run_dir)
        for step in (100, 200, 300):
            first.log_metrics({"episode/return_mean": step / 100}, step=step)
        first.finish()
        # The resumed run restarts from a checkpoint taken at step 200: what came later is trained again.
        resumed = self.make_hub(run_dir, resume=str(run_dir / "checkpoints" / "checkpoint_000002"))
        resumed.set_env_steps(200)
        resumed.log_metrics({"episode/return_mean": 9.0}, step=300)
        resumed.finish()
        assert resumed.errors() == []
        points = self.read_scalars(run_dir)["episode/return_mean"]
        assert sorted(points) == [(100, 1.0), (200, 2.0), (300, 9.0)], points
