"""mineonline-lmdb-buffer: the ``lmdb`` fragment store (the default ``database_config.backend``).

Select it in a config with::

    rollout_config:
      replay_buffer_config:
        database_config: {backend: lmdb, path: replay, num_shards: 4, map_size_mb: 64, sync: true}

``path`` is relative to the run directory unless absolute. The extra keys are validated by
``LMDBOptions`` (``map_size_mb``, ``max_map_size_gb``, ``sync``, ``max_readers``). See README.md.
The module only registers the store; ``lmdb`` itself is imported when a store is opened.
"""

from __future__ import annotations

from mineonline_core import hookimpl
from mineonline_lmdb.codec import CorruptRecordError
from mineonline_lmdb.store import LMDBOptions, LMDBStore, StoreDamagedError, StoreFullError

__all__ = ["CorruptRecordError", "LMDBOptions", "LMDBStore", "StoreDamagedError", "StoreFullError"]


@hookimpl
def mineonline_register_replay_stores(register):  # type: ignore[no-untyped-def]
    register(LMDBStore)
