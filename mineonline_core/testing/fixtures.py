"""Pytest fixtures for mineonline and its plugins: a fresh plugin manager, temporary plugin
registration, a local Ray cluster sized for small machines, and several nodes on one machine
(``start_cluster``).

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


def start_cluster(head: dict[str, Any], nodes: list[dict[str, Any]], *, attempts: int = 3) -> Any:
    """A ``ray.cluster_utils.Cluster`` on this machine: a head node and one node per entry of ``nodes`` (each
    ``add_node``'s arguments), all registered. Ray gives a node 30 s to register with the GCS, which a busy
    machine can pass (a CI run beside two CPU burners): a start that timed out is shut down and tried again."""
    from ray.cluster_utils import Cluster

    from mineonline_core.driver.localcluster import TIMED_OUT

    for attempt in range(1, attempts + 1):
        cluster = Cluster(shutdown_at_exit=True)
        try:
            cluster.add_node(**head)
            for node in nodes:
                cluster.add_node(**node)
            cluster.wait_for_nodes()
            return cluster
        except Exception as exc:  # Ray raises a bare Exception (or a TimeoutError) for these
            cluster.shutdown()
            if attempt == attempts or not any(marker in str(exc) for marker in (*TIMED_OUT, "Timed out while")):
                raise
            print(f"the local cluster did not start ({exc}); starting it again ({attempt + 1} of {attempts})")
    raise AssertionError("unreachable")
