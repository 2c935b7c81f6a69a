"""What a rank publishes: weights to the rollout workers, metrics to the logger hub, checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import ray
import yaml

from mineonline_core.runtime.finite import require_finite
from mineonline_core.trainer import checkpoint as ckpt
from mineonline_core.trainer.goals import BEST_DIR, replace_best
from mineonline_core.trainer.sequence import unwrap


class Publishing:
    """``BaseTrainer``'s broadcasts, metric logging, checkpoints and best-checkpoint goals."""

    def _judge_goals(self, latest: dict[str, float]) -> None:
        """Rank 0: keep a new best checkpoint; note a reached stop criterion for ``_stop_requested``."""
        best = self.goals.improved(latest)
        if best is not None:
            root = self.save_dir / BEST_DIR
            written = self._write_checkpoint(root, keep_interval=None)
            replace_best(root, written, {"iteration": self.iteration, "episode/return_mean": best, "env_steps": self.env_steps})
        self._goal_reached = self.goals.stop_reason(latest)
        if self._goal_reached is not None:
            print(f"mineonline: stopping after iteration {self.iteration}: {self._goal_reached}", flush=True)

    def broadcast_model_to_rollout_workers(self, new_version: bool) -> None:
        """Bump the version (every rank) and publish the weights (rank 0, without waiting)."""
        if new_version:
            self.version += 1
        if self.rank == 0:
            self._publish_weights()

    def reference_changed(self) -> None:
        """The reference's weights changed: the next broadcast sends them to the rollout workers."""
        self._reference_ref = None

    def _publish_weights(self) -> None:
        weights = {k: v.detach().cpu().numpy() for k, v in unwrap(self.model).state_dict().items()}
        require_finite(weights, what="broadcast to the rollout workers")
        refs = [self._put_weights(weights)]
        if self.reference is not None:
            if self._reference_ref is None:
                self._reference_ref = self._put_weights({k: v.detach().cpu().numpy() for k, v in self.reference.state_dict().items()})
            refs.append(self._reference_ref)
        # Straight to the workers this rank knows: one actor hop between the put and each worker's
        # get, not two. The manager records the weights (for restarted workers), tells the buffer
        # the version, and forwards them only when this rank has no worker handles.
        for worker in self._workers:
            worker.update_weights.remote(refs, self.version)
        self.rollout_manager.update_weights.remote(refs, self.version, forward=not self._workers)

    def _put_weights(self, weights: dict[str, np.ndarray]) -> Any:
        # Owned by this rank (Ray >= 2.56 has no ``_owner``): workers fetch it while training runs.
        return ray.put(weights)

    def _log(self, metrics: dict[str, float], batch: dict) -> None:
        if self.logger_hub is None:
            return
        # The step is fixed here, not when the hub gets to the call, so that the checkpoint of this
        # iteration records exactly the step its metrics carry (a resume continues from it).
        self.env_steps = int(ray.get(self.logger_hub.env_steps.remote()))
        columns = {"trainer/advantages": "advantage", "trainer/values": "value", "trainer/staleness": "staleness"}
        histograms = {key: batch[column].detach().float().cpu().numpy().ravel() for key, column in columns.items()}
        self.logger_hub.log_batch.remote(metrics, histograms, self.env_steps)  # one actor task per iteration

    def save_checkpoint(self) -> Path | None:
        """Rank 0 writes the checkpoint of the current iteration; every rank then runs ``on_checkpoint``."""
        path = self._write_checkpoint(self.save_dir, keep_interval=self.train_config.keep_interval) if self.rank == 0 else None
        self.on_checkpoint(path)
        return path

    def _write_checkpoint(self, root: Path, *, keep_interval: int | None) -> Path:
        model_state = unwrap(self.model).state_dict()
        require_finite(model_state, what="checkpointed")
        return ckpt.save_checkpoint(
            root, iteration=self.iteration, model_state=model_state,
            optimizer_state=self.optimizer.state_dict(), scaler_state=self.scaler.state_dict() if self.scaler.is_enabled() else {},
            trainer_state={"version": self.version, "learning_rate": self.learning_rate,
                           "env_steps": self.env_steps, "best_return": self.goals.best_return, "extra": self.trainer_state()},
            config_yaml=yaml.safe_dump(self.saved_config, sort_keys=False), source_text=self.whole_config,
            keep_interval=keep_interval,
        )  # fmt: skip
