"""Pytest fixtures for mineonline and its plugins: a fresh plugin manager, temporary plugin
registration, and a local Ray cluster sized for small machines.

Use them from a ``conftest.py``::

    pytest_plugins = ["mineonline_core.testing.fixtures"]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from mineonline_core.registry import Origin, PluginManager, get_plugin_manager


@pytest.fixture
def plugin_manager() -> PluginManager:
    """A fresh plugin manager with the core's defaults and every installed plugin."""
    return get_plugin_manager()


@contextlib.contextmanager
def registered(
    pm: PluginManager, plugin: Any, *, name: str = "test-plugin", distribution: str = "test", version: str = "0"
) -> Iterator[Any]:
    """Register ``plugin`` (a module or object with hook implementations) for the duration of a block."""
    pm.add_plugin(plugin, Origin(name, distribution, version))
    try:
        yield plugin
    finally:
        pm.remove_plugin(plugin)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[Any]:
    """A local Ray cluster with 2 CPUs, never attached to another cluster on the machine, started as a run
    starts its own (workers at the test's priority, a second start after a start-up timeout)."""
    import ray

    from mineonline_core.driver.localcluster import start_local_cluster
    from mineonline_core.services.names import NAMESPACE

    start_local_cluster(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
