"""What a rank publishes: weights to the rollout workers, metrics to the logger hub, checkpoints.

Weights leave the trainer's critical path in two halves (``snapshot.py`` has the device side). On the
trainer's thread: a snapshot of the state dict into buffers allocated once (``WeightSnapshot``: a
device-memory copy the next optimiser step cannot change), the finite check, one sum per buffer on the
device (``surely_finite``; only a failed check scans per parameter, for ``require_finite``'s message),
and, on a CUDA rank, the start of the copy to pinned host buffers on a side stream. On one long-lived
broadcast thread: the wait for that copy, ``ray.put`` of the packed weights (``PackedWeights``: raw
bytes per dtype, so bfloat16 and float16 parameters travel bit-exactly) and the ``update_weights``
calls. At most one broadcast is in flight: the next one first waits for it, so broadcasts leave in
version order and the snapshot's buffers are free again when they are reused. A broadcast that
failed is logged on its thread and raised on the trainer's thread with its cause, at the start of
the next iteration or at the next broadcast, whichever comes first. The end of training
(``_train_func``) waits for the last broadcast; a run that fails drops the one in flight (the
thread is a daemon), since its rollout side is being torn down.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import ray
import yaml

from mineonline_core.contracts import fragment as F
from mineonline_core.errors import RunFailedError
from mineonline_core.services.finite import require_finite, surely_finite
from mineonline_core.trainer import checkpoint as ckpt
from mineonline_core.trainer.fetch import OrderedWorker
from mineonline_core.trainer.goals import BEST_DIR, replace_best
from mineonline_core.trainer.sequence import unwrap
from mineonline_core.trainer.snapshot import WeightSnapshot

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from mineonline_core.services.handles import RolloutManagerHandle, WeightReceiverHandle
    from mineonline_core.services.loggerhub import LoggerHub
    from mineonline_core.services.weights import PackedWeights

log = logging.getLogger(__name__)


class Publishing:
    """``TrainLoop``'s broadcasts, metric logging, checkpoints and best-checkpoint goals."""

    rollout_manager: RolloutManagerHandle | None
    logger_hub: ActorHandle[LoggerHub] | None
    _workers: list[WeightReceiverHandle]

    def _judge_goals(self, latest: dict[str, float]) -> None:
        """Rank 0: keep a new best checkpoint; note a reached stop criterion for ``_stop_requested``."""
        best = self.goals.improved(latest)
        if best is not None:
            root = self.save_dir / BEST_DIR
            written = self._write_checkpoint(root, keep_interval=None)
            replace_best(
                root, written, {"iteration": self.iteration, self.goals.metric: best, "env_steps": self.env_steps}
            )
        self._goal_reached = self.goals.stop_reason(latest)
        if self._goal_reached is not None:
            print(f"mineonline: stopping after iteration {self.iteration}: {self._goal_reached}", flush=True)

    def broadcast_model_to_rollout_workers(self, new_version: bool) -> None:
        """Bump the version (every rank) and publish the weights (rank 0, sent by the broadcast thread)."""
        if new_version:
            self.version += 1
        if self.rank == 0:
            self._publish_weights()

    def reference_changed(self) -> None:
        """The reference's weights changed: the next broadcast sends them to the rollout workers, and the logits
        rollout stored of steps older than that broadcast's version are no longer the reference's (``update.py``)."""
        self._reference_stale = True
        self.reference_since = self.version + 1

    def _publish_weights(self) -> None:
        """Snapshot and check the weights here; the broadcast thread sends them (see the module doc)."""
        # One in flight at most: versions leave in order, and the snapshot's buffers (the device ones the
        # side stream reads, the pinned ones ``ray.put`` reads) are free again before they are overwritten.
        self.flush_broadcast()
        state = unwrap(self.model).state_dict()
        if self._snapshot is None or not self._snapshot.holds(state):
            self._snapshot = WeightSnapshot(state)
        weights = self._snapshot.copy_from(state)
        if not surely_finite(weights.flats):
            require_finite(weights.views, what="broadcast to the rollout workers")
        weights.start_host_copy()
        reference = None
        if self.reference is not None and self._reference_stale:  # rare: its own buffers, not kept
            ref_state = self.reference.state_dict()
            reference, self._reference_stale = WeightSnapshot(ref_state).copy_from(ref_state), False
            reference.start_host_copy()
        if self._broadcaster is None:
            self._broadcaster = OrderedWorker(name="mineonline-broadcast")
        self._broadcast = (self.version, self._broadcaster.submit(self._send_weights, self.version, weights, reference))

    def _send_weights(self, version: int, weights: WeightSnapshot, reference: WeightSnapshot | None) -> float:
        """The broadcast thread's half: the host copy's end, ``ray.put``, ``update_weights``. Returns its ms."""
        start = time.perf_counter()
        try:
            if reference is not None:  # the reference's put is kept until it changes (``_reference_ref``)
                self._reference_ref = self._put_weights(reference.host())
            refs = [self._put_weights(weights.host())]
            if self._evaluation is not None:  # the evaluation of this version, if due, takes the same put
                self._evaluation.weights_sent(version, refs[0])
            if self._reference_ref is not None:
                refs.append(self._reference_ref)
            # Straight to the workers this rank knows: one actor hop between the put and each worker's
            # get, not two. The manager records the weights (for restarted workers), tells the buffer
            # the version, and forwards them only when this rank has no worker handles.
            for worker in self._workers:
                worker.update_weights.remote(refs, version)
            self.rollout_manager.update_weights.remote(refs, version, forward=not self._workers)
        except BaseException:
            log.exception("broadcasting model version %d to the rollout workers failed", version)
            raise
        return 1e3 * (time.perf_counter() - start)

    def check_broadcast(self) -> None:
        """Raise the failure of the broadcast in flight if it has already failed; never waits."""
        if self._broadcast is not None and self._broadcast[1].done():
            self.flush_broadcast()

    def flush_broadcast(self) -> None:
        """Wait for the broadcast in flight; raise its failure with its cause."""
        if self._broadcast is None:
            return
        (version, future), self._broadcast = self._broadcast, None
        try:
            self.perf["perf/broadcast_send_ms"] = future.result()
        except Exception as exc:
            raise RunFailedError(
                f"Broadcasting model version {version} to the rollout workers failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _put_weights(self, weights: PackedWeights) -> ObjectRef[PackedWeights]:
        # Owned by this rank (Ray >= 2.56 has no ``_owner``): workers fetch it while training runs.
        return ray.put(weights)

    def rewind_logs(self) -> None:
        """Rank 0 of an attempt that replaced a dead rank: what the dead attempt logged after the checkpoint
        this one resumed from is trained again, so the loggers drop it (one record per iteration)."""
        if self.rank == 0 and self.restarts and self.logger_hub is not None:
            ray.get(self.logger_hub.rewind.remote(self.iteration))

    def _log(self, metrics: dict[str, float], batch: dict) -> None:
        if self.logger_hub is None:
            return
        columns = {"trainer/advantages": F.ADVANTAGE, "trainer/values": F.VALUE, "trainer/staleness": F.STALENESS}
        histograms = {key: batch[column].detach().float().cpu().numpy().ravel() for key, column in columns.items()}
        # The hub stamps the record and says with which step, so that the checkpoint of this iteration
        # records exactly the step its metrics carry (a resume continues from it). A count read before
        # the call could be overtaken by a rollout record logged meanwhile: the axis would go back.
        self.env_steps = int(ray.get(self.logger_hub.log_batch.remote(metrics, histograms)))

    def save_checkpoint(self) -> Path | None:
        """Rank 0 writes the checkpoint of the current iteration; every rank then runs ``on_checkpoint``."""
        path = (
            self._write_checkpoint(self.save_dir, keep_interval=self.train_config.keep_interval)
            if self.rank == 0
            else None
        )
        self.algorithm.on_checkpoint(path)
        return path

    def _write_checkpoint(self, root: Path, *, keep_interval: int | None) -> Path:
        model_state = unwrap(self.model).state_dict()
        require_finite(model_state, what="checkpointed")
        return ckpt.save_checkpoint(
            root,
            iteration=self.iteration,
            model_state=model_state,
            optimizer_state=self.optimizer.state_dict(),
            scaler_state=self.scaler.state_dict() if self.scaler.is_enabled() else {},
            trainer_state={
                "version": self.version,
                "learning_rate": self.learning_rate,
                "env_steps": self.env_steps,
                "best_return": self.goals.best_return,
                "extra": self.algorithm.trainer_state(),
            },
            config_yaml=yaml.safe_dump(self.saved_config, sort_keys=False),
            source_text=self.whole_config,
            keep_interval=keep_interval,
        )
