"""Trainer recovery: a train worker (rank) whose process dies is restarted from this run's latest checkpoint.

Ray Train's ``FailureConfig`` retries every failure of the worker group, a deliberate error included (the
non-finite guard, a config mistake), which would only fail again. So ``TrainLoop.fit`` runs its own
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

A driver resumed on a kept replay store (LMDB) has a new rollout side that published nothing yet, but its
store may hold fragments of versions newer than the checkpoint's (written between that checkpoint and the
driver's end). ``rejoin_version`` then numbers on from the newest stored version, read by the store host
(``StoreHost.newest_version``): every stored fragment is then at or below the version it is trained at, a
non-negative staleness, instead of being refused by the fetch's domain check as if it were garbled.
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
    newer (the checkpoint's weights are not the weights that version named). A rollout side that has
    published nothing yet (a driver's start or resume) is asked for its store's newest version instead."""
    import ray

    if not hasattr(manager, "latest_version"):
        return version
    latest = ray.get(manager.latest_version.remote())
    if latest is None:
        stored = newest_stored_version(manager)
        if stored is not None and stored > version:
            log.warning(
                "the replay store holds fragments of versions up to %d, written after the checkpoint's version %d "
                "(before the run stopped); the checkpoint's weights are published as version %d, so that they "
                "train at a non-negative staleness",
                stored,
                version,
                stored + 1,
            )
            return int(stored) + 1
        return version
    if latest > version:
        log.warning(
            "the rollout workers hold weights of version %d, newer than the checkpoint's %d (published by a "
            "trainer that died); the checkpoint's weights are published as version %d",
            latest,
            version,
            latest + 1,
        )
        return int(latest) + 1
    return version


def newest_stored_version(manager: RolloutManagerHandle) -> int | None:
    """The newest version among the fragments in the run's replay store (None: empty, or a store that
    cannot tell)."""
    import ray

    if not hasattr(manager, "get_store_client"):
        return None
    try:
        store = ray.get(manager.get_store_client.remote())
        newest = getattr(store, "newest_version", None)
        return None if newest is None else newest()
    except ray.exceptions.RayError as exc:
        # Then fragments newer than the checkpoint are refused by the fetch, counted, never trained on.
        log.warning("the replay store did not tell its newest version (%s); versions go on from the checkpoint's", exc)
        return None
