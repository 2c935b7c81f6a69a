"""The plugin registers the ``lmdb`` store and validates its extra ``database_config`` keys."""

from __future__ import annotations

import pydantic
import pytest

import mineonline_lmdb
from mineonline_core.plugins import Origin, PluginManager
from mineonline_core.store import FragmentStore
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


def test_plugin_module_does_not_import_lmdb_eagerly():
    import subprocess
    import sys

    code = "import sys, mineonline_lmdb; print('lmdb' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=_env()).stdout.strip()
    assert out == "False"


def _env() -> dict:
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
