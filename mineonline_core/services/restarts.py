"""Restarts counted over a sliding window (RLlib's ``max_num_env_runner_restarts``, per time window).

The rollout manager holds one ``RestartBudget`` for worker restarts (``rollout_config.max_worker_restarts``),
each env pool one for env rebuilds (``worker_config.max_env_rebuilds``), both over
``rollout_config.restart_window``; a budget spent fails the run instead of restarting forever.

A bookkeeping actor that Ray restarts in place (the episode statistics, the store host, the logging
actor: ``max_restarts=-1``) learns in its constructor that it is a restart (``actor_restart``) and how
many there were (``note_actor_restart``: counted in the GCS's key-value store, which outlives the actor).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable


class RestartBudget:
    """At most ``cap`` events within any ``window`` seconds; ``add`` says whether this one is over."""

    def __init__(self, *, cap: int, window: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.cap, self.window, self._clock = cap, window, clock
        self._times: deque[float] = deque()

    def add(self) -> bool:
        """Record one event; True when the window now holds more than ``cap`` events."""
        now = self._clock()
        self._times.append(now)
        while self._times and now - self._times[0] > self.window:
            self._times.popleft()
        return len(self._times) > self.cap

    def count(self) -> int:
        return len(self._times)

    def span(self) -> float:
        """Seconds between the oldest and the newest event in the window."""
        return self._times[-1] - self._times[0] if self._times else 0.0


#: ``max_restarts`` of a bookkeeping actor that Ray restarts in place: a fourth death in a run is final (a
#: crash loop, such as a damaged store that kills its mapper at every open, ends the run with its cause).
MAX_ACTOR_RESTARTS = 3

# Ray's key-value store in the GCS outlives any actor of the run: a restarted actor counts its lives there.
_KV_NAMESPACE = b"mineonline-restarts"


def note_actor_restart(name: str) -> int:
    """Count one restart of the actor named ``name`` (its Ray name, unique to its run); returns how many
    times it has been restarted. The count outlives the actor's process, which is what restarts."""
    from ray.experimental import internal_kv

    key = name.encode("utf-8")
    count = int(internal_kv._internal_kv_get(key, namespace=_KV_NAMESPACE) or 0) + 1
    internal_kv._internal_kv_put(key, str(count).encode(), overwrite=True, namespace=_KV_NAMESPACE)
    return count


def actor_restart(default_name: str) -> tuple[int, str] | None:
    """Called in an actor's constructor: ``(restart count, actor name)`` when Ray is restarting this actor
    after its process died (``max_restarts``), else None (its first start, or a plain object in a test)."""
    import ray

    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    try:
        if context.get_actor_id() is None:
            return None  # not inside an actor
        reconstructed = context.was_current_actor_reconstructed
        name = context.get_actor_name() or default_name
    except Exception:  # noqa: BLE001 - not inside an actor
        return None
    if not reconstructed:  # a first start: an earlier run of the same name on this cluster counted its own
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(name.encode("utf-8"), namespace=_KV_NAMESPACE)
        return None
    return note_actor_restart(name), name


def current_actor_name() -> str | None:
    """This process's actor's Ray name, or None outside a named actor (a test's plain object)."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        return ray.get_runtime_context().get_actor_name() or None
    except Exception:  # noqa: BLE001 - not inside an actor
        return None


def remember(name: str, value: int) -> None:
    """Keep ``value`` for the actor named ``name`` where its restart finds it (``recall``)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(b"memo:" + name.encode("utf-8"), str(int(value)).encode(), namespace=_KV_NAMESPACE)


def recall(name: str) -> int | None:
    """What the actor named ``name`` last ``remember``ed, or None."""
    from ray.experimental import internal_kv

    found = internal_kv._internal_kv_get(b"memo:" + name.encode("utf-8"), namespace=_KV_NAMESPACE)
    return None if found is None else int(found)
