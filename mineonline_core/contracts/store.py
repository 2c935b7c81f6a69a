"""The FragmentStore contract and the core's in-memory reference store.

A store keeps fragment payloads by key. A payload is a tree (``mineonline_core.contracts.tree``) of numpy
arrays, Python scalars, strings and None: dicts with string keys, lists and tuples. Stores must
round-trip it exactly: dtype, shape, bit pattern, and the container types (a tuple stays a tuple).
The replay buffer keeps only keys and small metadata; trainers and rollout workers reach payloads
through the store, never through the buffer actor. A store returns what it holds without judging it:
a fragment carries the checksums of its columns (``contracts.fragment.seal``, written by the rollout
worker with the payload) and its reader verifies them (``contracts.fragment.verify_fragment``, at the
trainer's fetch), so a record garbled at rest, in any store, is refused there.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict

from mineonline_core.contracts.tree import tree_leaves


class StoreOptions(BaseModel):
    """Backend-specific ``database_config`` keys; the base store accepts none."""

    model_config = ConfigDict(extra="forbid")


class FragmentStore(ABC):
    """Where replay payloads live. Thread-safe: writers and readers may run concurrently.

    ``path`` is the absolute ``database_config.path``; ``num_shards`` spreads keys over independent
    shards; ``resume=False`` means start empty (clearing what the path holds), ``resume=True`` means
    keep what a previous run persisted so that the buffer can rebuild its index from ``keys()``.
    """

    name: ClassVar[str] = ""
    Config: ClassVar[type[BaseModel]] = StoreOptions
    #: True when several processes on one node may open the same ``path`` at once.
    multi_process: ClassVar[bool] = False
    #: True when the contents survive the process (a restart may resume from them).
    persistent: ClassVar[bool] = False

    def __init__(
        self, *, path: str, num_shards: int = 1, resume: bool = False, options: BaseModel | None = None
    ) -> None:
        self.path, self.num_shards, self.resume = path, num_shards, resume
        self.options = options if options is not None else self.Config()

    @abstractmethod
    def put(self, key: str, payload: Any) -> None:
        """Store ``payload`` under ``key``, atomically: afterwards it is whole or absent."""

    @abstractmethod
    def get(self, key: str) -> Any:
        """The payload stored under ``key``; ``KeyError`` when absent."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; absent keys are ignored."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every key."""

    @abstractmethod
    def keys(self) -> list[str]:
        """Every stored key (order unspecified)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the store occupies (on disk or in memory)."""

    def size(self) -> int:
        """The number of stored payloads."""
        return len(self.keys())

    def put_many(self, items: Iterable[tuple[str, Any]]) -> None:
        for key, payload in items:
            self.put(key, payload)

    def get_many(self, keys: Iterable[str]) -> list[Any]:
        return [self.get(key) for key in keys]

    def delete_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.delete(key)

    def close(self) -> None:
        """Release files and handles; the store is unusable afterwards."""


def payload_nbytes(payload: Any) -> int:
    return sum(np.asarray(leaf).nbytes for leaf in tree_leaves(payload))


class MemoryStore(FragmentStore):
    """Payloads in a dict in the process that owns the store (the store host actor)."""

    name = "memory"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._data: dict[str, Any] = {}
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    def put(self, key: str, payload: Any) -> None:
        with self._lock:
            self._data[key] = payload
            self._bytes[key] = payload_nbytes(payload)

    def get(self, key: str) -> Any:
        with self._lock:
            return self._data[key]

    def delete(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)
            self._bytes.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes.clear()

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._data)

    def size(self) -> int:
        return len(self._data)

    def nbytes(self) -> int:
        with self._lock:
            return sum(self._bytes.values())
