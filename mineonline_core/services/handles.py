"""What a handle to a run's actor is typed as, where the actor's class cannot be named.

The wiring passes Ray actor handles around. A handle's method is called as ``handle.method.remote(*args)``,
which returns an ``ObjectRef`` at once; ``ray.get`` waits for the value. A module that holds a handle
types it as ``ray.actor.ActorHandle[TheActor]``, importing the actor's class under ``TYPE_CHECKING``:
the methods and their signatures are written once, in the class.

Two places cannot name the class, because the import would run across a floor or close a cycle
(``tests/test_architecture.py`` counts ``TYPE_CHECKING`` imports too): the trainer (``trainer/``) holds
the rollout manager, its replay buffer and the weight receivers, which live on the ``rollout/`` floor
beside it; a rollout worker and the shared inference server hold the manager that starts them. For
those, the Protocols below list the methods such holders call, marked ``@remote_method``, which types
the attribute as ``Remote[P, R]``: ``.remote(...)`` takes the method's parameters and returns
``ObjectRef[R]``. ``tests/test_handles.py`` checks each against its actor class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar

if TYPE_CHECKING:
    from typing import TypeAlias

    from ray import ObjectRef

    from mineonline_core.contracts.store import FragmentStore
    from mineonline_core.services.storehost import StoreClient

    # The replay store as the buffer, the rollout workers and the trainer use it: a ``StoreClient`` in a
    # run; a test may hand over the ``FragmentStore`` itself. Plain calls, not an actor's.
    StoreAccess: TypeAlias = "FragmentStore | StoreClient"

_P = ParamSpec("_P")
_R = TypeVar("_R")


class Remote(Protocol[_P, _R]):
    """An actor method as a handle has it: ``.remote(*args)`` starts the call and returns its ``ObjectRef``."""

    def remote(self, *args: _P.args, **kwargs: _P.kwargs) -> ObjectRef[_R]: ...


def remote_method(method: Callable[Concatenate[Any, _P], _R]) -> Remote[_P, _R]:
    """Declare, in a handle Protocol, an actor method reached through ``.remote``. ``method`` is a stub
    with the actor method's signature; it is returned as it is (the tests read its signature)."""
    return method  # type: ignore[return-value]


class WeightReceiverHandle(Protocol):
    """A rollout worker or the shared inference server, as the trainer's rank 0 sends it weights:
    ``weights`` is ``[ObjectRef of the state dict, ObjectRef of the reference's]`` (the second when
    the algorithm has a reference policy); the receiver fetches them itself."""

    @remote_method
    def update_weights(self, weights: list, version: int) -> None: ...


class ReplayBufferHandle(Protocol):
    """The replay buffer (``rollout/buffer.py``'s ``ReplayBuffer``) as the trainer samples and releases chunks."""

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
    def release(self, chunk_ids: list[str]) -> None: ...


class RolloutManagerHandle(Protocol):
    """The run's rollout manager (``rollout/manager.py``'s ``RolloutManager``), as the trainer, the
    rollout workers and the shared inference server call it."""

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
    def stop_requested(self) -> bool: ...
