"""The plugin registers the ``lmdb`` store and validates its extra ``database_config`` keys."""

from __future__ import annotations

import pydantic
import pytest

import mineonline_lmdb
from mineonline_core.registry import Origin, PluginManager
from mineonline_core.contracts.store import FragmentStore
from mineonline_lmdb import LMDBOptions, LMDBStore


def test_plugin_registers_lmdb_store():
    pm = PluginManager()
    pm.add_plugin(mineonline_lmdb, Origin("lmdb_buffer", "mineonline-lmdb-buffer", "0.1.0"))
    cls = pm.lookup("replay_store", "lmdb")
    assert cls is LMDBStore and issubclass(cls, FragmentStore)
    assert cls.multi_process is True and cls.persistent is True
    assert pm.registries["replay_store"].origin("lmdb").distribution == "mineonline-lmdb-buffer"


def test_options_defaults_and_validation():
    options = LMDBOptions()
    assert (options.map_size_mb, options.sync) == (64, True)
    assert LMDBOptions(map_size_mb=1, max_map_size_gb=2, sync=False).max_map_size_gb == 2
    with pytest.raises(pydantic.ValidationError, match="map_sise_mb"):
        LMDBOptions(map_sise_mb=1)  # a typo is an error, not silently ignored
    with pytest.raises(pydantic.ValidationError):
        LMDBOptions(map_size_mb=0)


def test_plugin_modules_import_lmdb_only_when_a_store_opens():
    import mineonline_lmdb.codec
    import mineonline_lmdb.plan
    import mineonline_lmdb.shard
    import mineonline_lmdb.store

    modules = (
        mineonline_lmdb,
        mineonline_lmdb.codec,
        mineonline_lmdb.plan,
        mineonline_lmdb.shard,
        mineonline_lmdb.store,
    )
    for module in modules:
        assert "lmdb" not in vars(module), f"{module.__name__} imports lmdb at module level"
