"""The driver while a run trains, and its teardown.

``driver/api.py`` validates, claims the run directory, starts Ray and the run's actors, and then
hands over to ``train_with_progress``: the trainer's ``fit()`` runs on a thread of its own while the
main thread, once a second, shows progress (``driver/progress.py``), asks the logging actor and the
rollout manager whether they live (a dead one, or a failure it reports, ends the run with its cause),
watches for an actor no node can hold (``driver/placement.py``) and for a stall
(``driver/watchdog.py``), and turns Ctrl-C (or SIGTERM, or a Tune scheduler's ``monitor``) into a
stop request: the trainer finishes its iteration and writes a final checkpoint. Whatever happened,
``shutdown_actors`` then ends the manager (and with it the actors it started) and the logging actor,
whose ``finish`` gives the run's summary, and ``write_report`` plots the run.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from mineonline_core.driver.continuity import resume_point
from mineonline_core.errors import RunFailedError, find_user_error, last_line

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from mineonline_core.config import OnlineConfig
    from mineonline_core.rollout.manager import RolloutManager
    from mineonline_core.services.handles import Remote
    from mineonline_core.services.loggerhub import LoggerHub
    from mineonline_core.trainer.loop import TrainLoop

log = logging.getLogger("mineonline")

_T = TypeVar("_T")


def train_with_progress(
    trainer: TrainLoop,
    manager: ActorHandle[RolloutManager],
    hub: ActorHandle[LoggerHub],
    cfg: OnlineConfig,
    progress: bool | None,
    monitor: Callable[[dict], bool] | None = None,
) -> dict:
    """Run ``trainer.fit()`` in a thread; the main thread shows progress (the live panel; plain lines when
    ``progress`` is False; nothing when None) and turns Ctrl-C into a stop."""

    from mineonline_core.driver.progress import Progress
    from mineonline_core.driver.placement import PendingWatch
    from mineonline_core.driver.watchdog import ProgressWatchdog, stall_report

    outcome: dict[str, Any] = {}
    # Not thread.join/is_alive: on Python < 3.12 a KeyboardInterrupt inside join() marks the thread as
    # stopped while it still runs (bpo-45274), and the run was torn down before its final checkpoint.
    done = threading.Event()

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread below
            outcome["error"] = exc
        finally:
            done.set()

    trainer_thread = threading.Thread(target=fit, name="mineonline-trainer", daemon=True)
    # --no-progress: plain log lines (what its help promises), never the live panel; --quiet: neither.
    display = Progress(
        cfg.train_config.num_iterations,
        max_env_steps=cfg.train_config.max_env_steps,
        start_iteration=resume_point(cfg.train_config.resume).iteration if cfg.train_config.resume else 0,
        enabled=progress is not None,
        force_terminal=None if progress else False,
    )
    watchdog = ProgressWatchdog(timeout=cfg.progress_timeout)
    pending = PendingWatch()  # an actor no node can hold fails the run in ~30 s, not progress_timeout
    stopping = False
    try:
        while not done.is_set():
            try:
                # Started here, under the Ctrl-C handler: a CartPole trainer finishes iterations within
                # milliseconds, and a Ctrl-C that arrived while the display was being set up (the thread
                # already running) left the trainer going through the whole teardown. Once started, the
                # thread has an ident, so a Ctrl-C inside start() never starts it twice.
                if trainer_thread.ident is None:
                    trainer_thread.start()
                done.wait(timeout=1.0)
                latest = _checked(hub.latest, "logging actor (LoggerHub)")
                display.update(latest)
                if monitor is not None and monitor(latest) and not stopping:
                    # A Tune scheduler's stop: the trainer finishes its iteration, then a final checkpoint.
                    stopping = True
                    manager.request_stop.remote()
                _checked(manager.health, "rollout manager (RolloutManager)")
                pending.check()
                stalled = watchdog.stalled(latest)
                if stalled and not done.is_set():
                    raise stall_report(manager, stalled)
            except KeyboardInterrupt:
                if stopping:
                    raise
                stopping = True
                print(
                    "\nstopping: finishing the iteration and writing a final checkpoint"
                    " (Ctrl-C or SIGTERM again to abort)"
                )
                manager.request_stop.remote()
    finally:
        display.close()
    if "error" in outcome:
        error = outcome["error"]
        user_error = find_user_error(error)
        if user_error is not None:
            raise user_error
        raise RunFailedError(f"training failed: {type(error).__name__}: {error}") from error
    result = dict(outcome.get("result") or {})
    if stopping or (result.get("iteration", 0) < cfg.train_config.num_iterations and _stop_was_requested(manager)):
        result["status"] = "interrupted"  # Ctrl-C here, or `mineonline stop` from another driver
    return result


def _checked(method: Remote[[], _T], what: str) -> _T:
    """Call an actor method; a dead actor or a failure it reports ends the run with its cause."""
    import ray

    try:
        return ray.get(method.remote(), timeout=60)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        user_error = find_user_error(exc)
        if user_error is not None:
            raise user_error from None
        raise RunFailedError(
            f"the run's {what} failed or died, so the run stops: {type(exc).__name__}: {last_line(exc)}"
        ) from exc


def _stop_was_requested(manager: ActorHandle[RolloutManager]) -> bool:
    import ray

    try:
        return bool(ray.get(manager.stop_requested.remote(), timeout=10))
    except Exception:  # noqa: BLE001 - a manager that cannot answer did not ask for a stop
        return False


def shutdown_actors(manager: ActorHandle[RolloutManager] | None, hub: ActorHandle[LoggerHub] | None) -> dict:
    """End the rollout manager (it shuts down the actors it started) and then the logging actor;
    return the run's summary (``LoggerHub.finish``), ``{}`` when the hub could not give it."""
    import ray

    summary: dict = {}
    if manager is not None:
        try:
            ray.get(manager.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - a dead manager is already shut down
            log.warning("the rollout manager did not shut down cleanly", exc_info=True)
        ray.kill(manager)
    if hub is not None:
        try:
            summary = ray.get(hub.finish.remote(), timeout=120)
        except Exception:  # noqa: BLE001
            log.warning("the logging actor did not finish cleanly", exc_info=True)
        ray.kill(hub)
    return summary


def write_report(run_dir: Path) -> None:
    """Plot the run (``driver/report.py``) when it logged metrics; a failed plot is logged, never raised."""
    from mineonline_core.driver.report import write_report as write

    if (run_dir / "metrics.jsonl").exists():
        try:
            write(run_dir)
        except Exception as exc:  # noqa: BLE001 - a failed plot must not hide the run's outcome
            log.warning("writing the run report failed: %s: %s", type(exc).__name__, exc, exc_info=True)
