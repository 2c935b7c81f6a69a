"""How processes on any node reach the replay store.

A store lives on the node that holds ``database_config.path``. ``start_store_host`` starts one
``StoreHost`` actor there, pinned with node-affinity scheduling (no custom resources), which owns
the store. Rollout workers and trainer ranks use a ``StoreClient``:

* on the host's node, when the store allows several processes to open its path
  (``store_cls.multi_process``, e.g. LMDB), the client opens the store in its own process, once, with
  ``resume=True`` so that it never clears it, and reads/writes without an actor round trip;
* anywhere else, or for single-process stores such as ``memory``, it calls the host actor.

The host actor is threaded (``max_concurrency``), so readers and writers are not serialised on it;
the store itself is thread-safe.

A host whose process dies is restarted by Ray in place (``max_restarts``: same name, same handle, calls
in flight retried; at most ``MAX_ACTOR_RESTARTS`` times, then the run fails with the cause). The restarted host says so on the console and in ``run.log`` and counts it in
``storehost/restarts``; it reopens a persistent store (LMDB: the records are on disk) with ``resume``, so
nothing is lost, while an in-memory store's records died with the process: the host says how many, and
the trainer drops the chunks that named them (``trainer/corrupt_fragments``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from mineonline_core.config.messages import validate_options
from mineonline_core.contracts.fragment import VERSION
from mineonline_core.contracts.store import FragmentStore
from mineonline_core.services.restarts import MAX_ACTOR_RESTARTS, actor_restart
from mineonline_core.services.runlog import setup_actor_logging
from mineonline_core.services.names import NAMESPACE, STORE_HOST, on_node

if TYPE_CHECKING:
    from ray.actor import ActorHandle

log = logging.getLogger(__name__)

# Threads of the host actor: enough for every rollout worker and trainer reader to be served at once.
HOST_MAX_CONCURRENCY = 32
#: ``storehost/restarts``: how many times Ray restarted a run's store host (logged to the run's hub).
RESTARTS_METRIC = "storehost/restarts"
#: Records a resumed store dropped at its open because they could not be decoded (LMDB: ``corrupt_records``).
CORRUPT_AT_OPEN_METRIC = "buffer/corrupt_records_at_open"
# Payloads read at once while looking for the newest stored version.
_SCAN_BATCH = 64


def _options(store_cls: type[FragmentStore], options: BaseModel | dict[str, Any] | None) -> BaseModel:
    if isinstance(options, BaseModel):
        return options
    return validate_options(store_cls, options, section="rollout_config.replay_buffer_config.database_config")


def _current_node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


class StoreHost:
    """Owns one ``FragmentStore``; started with ``start_store_host`` (it applies ``ray.remote``)."""

    def __init__(
        self,
        *,
        store_cls: type[FragmentStore],
        path: str,
        num_shards: int,
        resume: bool,
        options: BaseModel | dict[str, Any] | None = None,
        logger_hub: Any = None,
    ) -> None:
        setup_actor_logging()  # its records reach the console marked (runlog.py)
        restart = actor_restart(STORE_HOST)
        if restart is not None and store_cls.persistent:
            resume = True  # the store on disk is this run's: a restart must never clear it
        self._store = store_cls(path=path, num_shards=num_shards, resume=resume, options=_options(store_cls, options))
        dropped = getattr(self._store, "corrupt_records", 0)  # undecodable records a resumed store dropped
        if dropped and logger_hub is not None:
            logger_hub.log_metrics.remote({CORRUPT_AT_OPEN_METRIC: float(dropped)})
        if restart is not None:
            count, name = restart
            kept = (
                f"reopened the store at {path} with its {self._store.size()} records"
                if store_cls.persistent
                else f"the in-memory {store_cls.name!r} store's records died with it (chunks that named them are "
                "dropped when sampled, trainer/corrupt_fragments); rollout refills it"
            )
            log.warning(
                "the replay store host %s died; Ray restarted it (restart %d, %s): %s",
                name,
                count,
                RESTARTS_METRIC,
                kept,
            )
            if logger_hub is not None:
                logger_hub.log_metrics.remote({RESTARTS_METRIC: float(count)})

    def put(self, key: str, payload: Any) -> None:
        self._store.put(key, payload)

    def put_many(self, items: list[tuple[str, Any]]) -> None:
        self._store.put_many(items)

    def get_many(self, keys: list[str]) -> list[Any]:
        return self._store.get_many(keys)

    def delete_many(self, keys: list[str]) -> None:
        self._store.delete_many(keys)

    def keys(self) -> list[str]:
        return self._store.keys()

    def size(self) -> int:
        return self._store.size()

    def nbytes(self) -> int:
        return self._store.nbytes()

    def node_id(self) -> str:
        return _current_node_id()

    def newest_version(self) -> int | None:
        """The highest weights version of any stored fragment (None: none stored). Read next to the data,
        so that a resumed trainer can number its versions past everything the store holds."""
        keys = self._store.keys()
        newest: int | None = None
        for start in range(0, len(keys), _SCAN_BATCH):
            for payload in _readable(self._store, keys[start : start + _SCAN_BATCH]):
                versions = payload.get(VERSION) if isinstance(payload, dict) else None
                try:
                    high = int(max(versions.reshape(-1))) if getattr(versions, "size", 0) else None
                except (TypeError, ValueError, AttributeError):
                    high = None  # a damaged record: the trainer's fetch refuses it when sampled
                if high is not None and (newest is None or high > newest):
                    newest = high
        return newest

    def close(self) -> None:
        self._store.close()


def _readable(store: FragmentStore, keys: list[str]) -> list[Any]:
    """The payloads of ``keys`` that can be read; one that cannot (deleted meanwhile, undecodable) is skipped."""
    try:
        return store.get_many(keys)
    except Exception:  # noqa: BLE001 - find the one that failed, keep the others
        out = []
        for key in keys:
            try:
                out.extend(store.get_many([key]))
            except Exception:  # noqa: BLE001 - left to the fetch, which names and counts it
                log.debug("stored record %r unreadable while scanning versions", key, exc_info=True)
        return out


def start_store_host(
    *,
    store_cls: type[FragmentStore],
    path: str,
    num_shards: int,
    resume: bool,
    options: BaseModel | dict[str, Any] | None = None,
    name: str | None = None,
    namespace: str = NAMESPACE,
    node_id: str | None = None,
    lifetime: str | None = None,
    logger_hub: Any = None,
) -> ActorHandle[StoreHost]:
    """Start the store host on ``node_id`` (default: this process's node, the one that holds ``path``).

    ``soft=False``: the actor must run where the files are, or not at all. It takes no CPU so that it
    never competes with rollout workers for the node's slots. Ray restarts it when its process dies
    (``logger_hub`` hears of each restart). Returns the actor handle; the store is open once
    ``ray.get(handle.node_id.remote())`` returns.
    """
    import ray

    actor_cls = ray.remote(
        num_cpus=0, max_concurrency=HOST_MAX_CONCURRENCY, max_restarts=MAX_ACTOR_RESTARTS, max_task_retries=-1
    )(StoreHost)
    actor_options: dict[str, Any] = {
        "scheduling_strategy": on_node(node_id),
        "namespace": namespace,
    }
    if name is not None:
        actor_options["name"] = name
    if lifetime is not None:
        actor_options["lifetime"] = lifetime
    return actor_cls.options(**actor_options).remote(
        store_cls=store_cls,
        path=path,
        num_shards=num_shards,
        resume=resume,
        options=_options(store_cls, options),
        logger_hub=logger_hub,
    )


# Stores opened directly by clients, one per (class, path, shards) per process.
_LOCAL_STORES: dict[tuple[str, str, int], FragmentStore] = {}
_LOCAL_LOCK = threading.Lock()


def _forget_local_stores_after_fork() -> None:
    # A forked child (an env subprocess, say) must not use its parent's open database handles.
    global _LOCAL_STORES, _LOCAL_LOCK
    _LOCAL_STORES, _LOCAL_LOCK = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_local_stores_after_fork)


class StoreClient:
    """Picklable access to the store from any process of the Ray cluster."""

    def __init__(
        self,
        *,
        host: ActorHandle[StoreHost],
        store_cls: type[FragmentStore],
        path: str,
        num_shards: int,
        options: BaseModel | dict[str, Any] | None,
        host_node_id: str,
    ) -> None:
        self.host = host
        self.store_cls = store_cls
        self.path = path
        self.num_shards = num_shards
        self.options = _options(store_cls, options)
        self.host_node_id = host_node_id
        self._local: FragmentStore | None = None
        self._decided_in: int | None = None  # the pid that decided local vs remote

    @classmethod
    def connect(
        cls,
        host: ActorHandle[StoreHost],
        *,
        store_cls: type[FragmentStore],
        path: str,
        num_shards: int,
        options: BaseModel | dict[str, Any] | None = None,
    ) -> StoreClient:
        """A client for a running host; waits until the host has opened its store."""
        import ray

        return cls(
            host=host,
            store_cls=store_cls,
            path=path,
            num_shards=num_shards,
            options=options,
            host_node_id=ray.get(host.node_id.remote()),
        )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_local"], state["_decided_in"] = None, None  # each process decides (and opens) for itself
        return state

    @property
    def is_local(self) -> bool:
        """True when this process opened the store directly instead of calling the host."""
        return self._local_store() is not None

    def _local_store(self) -> FragmentStore | None:
        if self._decided_in != os.getpid():
            import ray

            self._local = None

            if self.store_cls.multi_process and ray.is_initialized() and _current_node_id() == self.host_node_id:
                key = (f"{self.store_cls.__module__}.{self.store_cls.__qualname__}", self.path, self.num_shards)
                with _LOCAL_LOCK:
                    if key not in _LOCAL_STORES:
                        _LOCAL_STORES[key] = self.store_cls(
                            path=self.path, num_shards=self.num_shards, resume=True, options=self.options
                        )
                    self._local = _LOCAL_STORES[key]
            self._decided_in = os.getpid()
        return self._local

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.host, method).remote(*args))

    def put(self, key: str, payload: Any) -> None:
        store = self._local_store()
        store.put(key, payload) if store is not None else self._call("put", key, payload)

    def put_many(self, items: Iterable[tuple[str, Any]]) -> None:
        store = self._local_store()
        store.put_many(items) if store is not None else self._call("put_many", list(items))

    def get_many(self, keys: Iterable[str]) -> list[Any]:
        store = self._local_store()
        return store.get_many(keys) if store is not None else self._call("get_many", list(keys))

    def get(self, key: str) -> Any:
        return self.get_many([key])[0]

    def delete_many(self, keys: Iterable[str]) -> None:
        store = self._local_store()
        store.delete_many(keys) if store is not None else self._call("delete_many", list(keys))

    def keys(self) -> list[str]:
        store = self._local_store()
        return store.keys() if store is not None else self._call("keys")

    def size(self) -> int:
        store = self._local_store()
        return store.size() if store is not None else self._call("size")

    def nbytes(self) -> int:
        store = self._local_store()
        return store.nbytes() if store is not None else self._call("nbytes")

    def newest_version(self) -> int | None:
        """The highest version of any stored fragment, read by the host next to the data."""
        return self._call("newest_version")
