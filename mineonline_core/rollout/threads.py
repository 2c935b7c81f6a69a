"""The background threads of a rollout actor (a rollout worker, the shared inference server).

The first thread that fails stops the others and hands its error to the actor, which re-raises it from
every later call (``health``), so the manager, and through it the driver, sees the cause instead of a
silent stall. A thread that fails after the stop (the actor shutting down) is not an error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

from mineonline_core.errors import MineOnlineError, RunFailedError

log = logging.getLogger(__name__)


def as_run_failure(exc: BaseException, what: str) -> MineOnlineError:
    """A user-facing error for a thread's death. Wrapping matters: an ``ActorDiedError`` (say, of
    the store host) re-raised as is would look to the manager like this actor's own restart."""
    if isinstance(exc, MineOnlineError):
        return exc
    error = RunFailedError(f"{what}: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def start_guarded(
    loops: Iterable[Callable[[], None]],
    *,
    what: str,
    prefix: str,
    stop: threading.Event,
    failed: Callable[[MineOnlineError], None],
) -> list[threading.Thread]:
    """Run each loop in a daemon thread named ``{prefix}-{loop name}``; the first to raise before
    ``stop`` is set is logged, passed to ``failed`` and sets ``stop``. ``what`` names the actor in the
    log and the error (``rollout worker 3``)."""

    def guard(loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as exc:  # noqa: BLE001 - handed to the actor, which raises it from every call
            if not stop.is_set():
                log.exception("%s: thread %s failed", what, loop.__name__)
                failed(as_run_failure(exc, f"{what}: {loop.__name__} thread failed"))
                stop.set()

    threads = [
        threading.Thread(target=guard, args=(loop,), name=f"{prefix}-{loop.__name__}", daemon=True) for loop in loops
    ]
    for thread in threads:
        thread.start()
    return threads
