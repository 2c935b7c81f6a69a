"""Trainer recovery: a train worker (rank) whose process dies is restarted from this run's latest checkpoint.

Ray Train's ``FailureConfig`` retries every failure of the worker group, a deliberate error included (the
non-finite guard, a config mistake), which would only fail again. So ``BaseTrainer.fit`` runs its own
loop: an attempt that ended because a rank's process died (a ``RayActorError`` among its causes) is
started again, at most ``train_config.max_trainer_restarts`` times; any other failure ends the run. A
rank lost with its node is a dead rank too: Ray Train's health check of it then fails with an
``ActorUnavailableError`` (connection reset, the node's raylet gone), which names no actor class, inside
its ``WorkerHealthCheckFailedError``; the new attempt's ranks go to the nodes that are left.

The new attempt's ranks resume from the newest checkpoint written since ``fit`` began
(``own_checkpoint``), so the run continues at the iteration after it, and number versions on from the
rollout side's latest (``rejoin_version``): the workers hold weights the dead rank published after
that checkpoint, and a broadcast with an older version would be ignored as stale. Those weights died
with the rank that owned them; a worker that had not loaded them yet waits for the next broadcast.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from mineonline_core.errors import iter_causes
from mineonline_core.trainer import checkpoint as ckpt

if TYPE_CHECKING:
    from mineonline_core.services.handles import RolloutManagerHandle

log = logging.getLogger(__name__)


def is_rank_death(exc: BaseException) -> bool:
    """Whether a failed Ray Train attempt ended because a rank's process died (not because the training
    function raised, even an actor error of its own, such as a replay buffer killed at shutdown)."""
    import ray

    for err in iter_causes(exc):
        if isinstance(err, ray.exceptions.RayActorError) and "RayTrainWorker" in str(err):
            return True
        # Ray Train health-checks only its ranks: an actor error there is a rank that died or left with its node.
        if isinstance(getattr(err, "health_check_failure", None), ray.exceptions.RayActorError):
            return True
    return False


def own_checkpoint(save_dir: Path, since: float | None) -> Path | None:
    """The newest checkpoint under ``save_dir`` written at or after ``since`` (a ``time.time()``), if any."""
    if since is None:
        return None
    latest = ckpt.latest_checkpoint(save_dir)
    if latest is None or (latest / ckpt.MANIFEST).stat().st_mtime < since:
        return None  # none yet, or one left by an earlier run: not this run's progress
    return latest


def rejoin_version(manager: RolloutManagerHandle | None, version: int) -> int:
    """The version to continue from: ``version``, or one past the rollout side's latest when that is
    newer (the checkpoint's weights are not the weights that version named)."""
    import ray

    if not hasattr(manager, "latest_version"):
        return version
    latest = ray.get(manager.latest_version.remote())
    if latest is not None and latest > version:
        log.warning(
            "the rollout workers hold weights of version %d, newer than the checkpoint's %d (published by a "
            "trainer that died); the checkpoint's weights are published as version %d",
            latest,
            version,
            latest + 1,
        )
        return int(latest) + 1
    return version
