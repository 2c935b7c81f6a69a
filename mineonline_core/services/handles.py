"""Typed handles: the run's actors as the code that holds them calls them.

The wiring passes Ray actor handles around: the driver hands the logging actor and the rollout
manager to the trainer; the manager hands the replay buffer, the episode statistics and the store to
each rollout worker; the trainer's rank 0 keeps the workers (or the shared inference server) to send
them weights. A handle's method is called as ``handle.method.remote(*args)``, which returns an
``ObjectRef`` at once; ``ray.get`` waits for the value.

Each Protocol here lists exactly the methods the core calls on one actor, written as the actor class
writes them (same parameters, same defaults) and marked ``@remote_method``, which types the attribute
as ``Remote[P, R]``: ``.remote(...)`` takes the method's parameters and returns ``ObjectRef[R]``. An
editor then completes ``.remote(`` with the real signature and knows what ``ray.get`` gives back.
Nothing here runs; ``tests/test_handles.py`` keeps it true: each method exists on its actor class
with the same parameters, and some module of the core calls it. Tests call a few more methods (a
manager's ``wait_ready``, ``get_workers``...) that the run's own code never does; those are not listed.
The buffer's ``async`` methods are written as plain ``def``: through a handle their value is the awaited one.

Why not Ray's own ``ActorHandle[RolloutManager]``: it names the actor class, and most of these classes
live above this floor (``rollout/``), which no module here may import, not even for typing
(``tests/test_architecture.py``); and a Protocol says which of an actor's methods its callers rely on.

Who starts whom: ``driver/api.py`` starts the logging actor (``services/loggerhub.py``) and the
rollout manager (``rollout/manager.py``); the manager starts the store host
(``services/storehost.py``), the replay buffer (``rollout/buffer.py``), the episode statistics
(``rollout/stats.py``), the shared inference server (``rollout/inference.py``) and the rollout workers
(``rollout/worker.py``); the trainer (``trainer/``) starts the ranks' heartbeat board
(``services/heartbeat.py``), its GPU lease (``services/gpulease.py``) and, on rank 0, the evaluator
(``services/evaluator.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar

if TYPE_CHECKING:
    from collections.abc import Iterable

    import numpy as np
    from ray import ObjectRef

_P = ParamSpec("_P")
_R = TypeVar("_R")


class Remote(Protocol[_P, _R]):
    """An actor method as a handle has it: ``.remote(*args)`` starts the call and returns its ``ObjectRef``."""

    def remote(self, *args: _P.args, **kwargs: _P.kwargs) -> ObjectRef[_R]: ...


def remote_method(method: Callable[Concatenate[Any, _P], _R]) -> Remote[_P, _R]:
    """Declare, in a handle Protocol, an actor method reached through ``.remote``. ``method`` is a stub
    with the actor method's signature; it is returned as it is (the tests read its signature)."""
    return method  # type: ignore[return-value]


class LoggerHubHandle(Protocol):
    """The run's logging actor (``LoggerHub``). Producers fire and forget; ``env_steps``, ``latest``,
    ``errors`` and ``finish`` are waited for."""

    @remote_method
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> int | None: ...

    @remote_method
    def log_histogram(self, key: str, values: np.ndarray, step: int | None = None) -> None: ...

    @remote_method
    def log_video(self, key: str, mp4: bytes, step: int | None = None, filename: str | None = None) -> None: ...

    @remote_method
    def log_batch(
        self,
        metrics: dict[str, float] | None = None,
        histograms: dict[str, np.ndarray] | None = None,
        step: int | None = None,
    ) -> int: ...

    @remote_method
    def add_env_steps(self, n: int) -> None: ...

    @remote_method
    def set_env_steps(self, n: int) -> None: ...

    @remote_method
    def rewind(self, iteration: int) -> None: ...

    @remote_method
    def env_steps(self) -> int: ...

    @remote_method
    def latest(self) -> dict[str, float]: ...

    @remote_method
    def errors(self) -> list[str]: ...

    @remote_method
    def finish(self) -> dict[str, float]: ...


class StoreAccess(Protocol):
    """The replay store as the buffer, the rollout workers and the trainer use it: a ``StoreClient``
    in a run (``services/storehost.py``); a test may hand over a ``FragmentStore``, which has the same
    methods. Plain calls, not an actor's: the client reaches the host actor itself when it must."""

    def put_many(self, items: Iterable[tuple[str, Any]]) -> None: ...

    def get_many(self, keys: Iterable[str]) -> list[Any]: ...

    def delete_many(self, keys: Iterable[str]) -> None: ...

    def keys(self) -> list[str]: ...


class StoreHostHandle(Protocol):
    """The actor that owns the replay store (``StoreHost``): a ``StoreClient`` calls it by name when it
    cannot open the store itself; the manager waits for ``node_id`` (the store is open) and closes it."""

    @remote_method
    def put(self, key: str, payload: Any) -> None: ...

    @remote_method
    def put_many(self, items: list[tuple[str, Any]]) -> None: ...

    @remote_method
    def get_many(self, keys: list[str]) -> list[Any]: ...

    @remote_method
    def delete_many(self, keys: list[str]) -> None: ...

    @remote_method
    def keys(self) -> list[str]: ...

    @remote_method
    def size(self) -> int: ...

    @remote_method
    def nbytes(self) -> int: ...

    @remote_method
    def node_id(self) -> str: ...

    @remote_method
    def close(self) -> None: ...


class ReplayBufferHandle(Protocol):
    """The replay buffer (``ReplayBuffer``): workers announce fragments, the trainer samples and
    releases chunks, the manager tells it versions, missing workers and a stop."""

    @remote_method
    def add_fragments(self, metas: list[dict]) -> None: ...

    @remote_method
    def set_version(self, version: int) -> None: ...

    @remote_method
    def sample(
        self,
        num_chunks: int,
        for_version: int | None = None,
        timeout: float | None = None,
        *,
        round_id: int | None = None,
    ) -> list[dict]: ...

    @remote_method
    def stop_waiting(self) -> None: ...

    @remote_method
    def release(self, chunk_ids: list[str]) -> None: ...

    @remote_method
    def explain(self, num_chunks: int, for_version: int | None = None) -> str: ...

    @remote_method
    def set_missing_workers(self, why: list[str]) -> None: ...

    @remote_method
    def stats(self) -> dict[str, float]: ...

    @remote_method
    def rebuild_from_store(self) -> int: ...


class EpisodeStatisticsHandle(Protocol):
    """The episode statistics actor (``EpisodeStatistics``): workers add finished episodes."""

    @remote_method
    def add_episodes(self, records: list[dict]) -> None: ...

    @remote_method
    def report(self) -> dict[str, float]: ...


class WeightReceiverHandle(Protocol):
    """An actor that runs the rollout policy: a rollout worker, or the shared inference server.
    ``weights`` is ``[ObjectRef of the state dict, ObjectRef of the reference's]`` (the second when
    the algorithm has a reference policy); the receiver fetches them itself."""

    @remote_method
    def update_weights(self, weights: list, version: int) -> None: ...


class InferenceServerHandle(WeightReceiverHandle, Protocol):
    """The shared inference server (``InferenceServer``, ``rollout_config.inference: shared``)."""

    @remote_method
    def wait_weights(self, timeout: float) -> bool: ...

    @remote_method  # rollout/stepping.py's StepRequest -> StepReply (a layer above this module)
    def step(self, request: Any) -> Any: ...

    @remote_method
    def metrics(self) -> dict[str, float]: ...


class RolloutWorkerHandle(WeightReceiverHandle, Protocol):
    """A rollout worker (``RolloutWorker``), as its manager and the trainer's rank 0 call it."""

    @remote_method
    def record_video(self) -> None: ...

    @remote_method
    def is_ready(self) -> bool: ...

    @remote_method
    def report(self) -> dict[str, float]: ...

    @remote_method
    def status(self) -> dict[str, Any]: ...

    @remote_method
    def shutdown(self) -> None: ...


class RolloutManagerHandle(Protocol):
    """The run's rollout manager (``RolloutManager``), as the driver, the trainer, the workers and the
    inference server call it."""

    @remote_method
    def update_weights(self, weights: list, version: int, forward: bool = True) -> None: ...

    @remote_method
    def weight_receivers(self) -> list[WeightReceiverHandle]: ...

    @remote_method
    def latest_weights(self) -> tuple[list, int] | None: ...

    @remote_method
    def register_worker(self, worker_id: int, pid: int = 0, node: str = "") -> tuple[int, tuple[list, int] | None]: ...

    @remote_method
    def latest_version(self) -> int | None: ...

    @remote_method
    def record_videos(self) -> None: ...

    @remote_method
    def get_buffer(self) -> ReplayBufferHandle: ...

    @remote_method
    def get_store_client(self) -> StoreAccess: ...

    @remote_method
    def health(self) -> None: ...

    @remote_method
    def status(self) -> dict[str, Any]: ...

    @remote_method
    def diagnose(self) -> list[str]: ...

    @remote_method
    def request_stop(self) -> None: ...

    @remote_method
    def stop_requested(self) -> bool: ...

    @remote_method
    def shutdown(self) -> None: ...


class EvaluatorHandle(Protocol):
    """The evaluator actor (``Evaluator``) that trainer rank 0 hands a version's weights to (their
    ``ObjectRef``: Ray resolves it before the call)."""

    @remote_method
    def evaluate(
        self, weights: dict[str, Any] | ObjectRef[dict[str, Any]], *, iteration: int, version: int, env_steps: int
    ) -> dict[str, float]: ...


class HeartbeatBoardHandle(Protocol):
    """The trainer ranks' heartbeat board (``HeartbeatBoard``): ranks beat, the driver reads."""

    @remote_method
    def beat(self, member: str, pid: int, node: str, detail: str) -> None: ...

    @remote_method
    def read(self) -> dict[str, tuple[int, str, float, float, str]]: ...

    @remote_method
    def clear(self) -> None: ...


class GpuLeaseHandle(Protocol):
    """The actor that holds a GPU share for the driver's training process (``GpuLease``)."""

    @remote_method
    def gpu_ids(self) -> list[str]: ...
