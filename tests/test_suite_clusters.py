"""The clusters the suite starts run their workers at the tests' priority, as a run's own cluster does, and
a multi-node one whose start timed out on a busy machine is started again.

At Ray's default (nice 15) any other busy process on a CI machine takes the CPU from the workers that do
a test's rollout and training: beside two CPU burners the suite got a quarter of a core
(benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import ray

from mineonline_core.testing.fixtures import start_cluster

_PLAIN_START = """
import os, ray
ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
print(ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote()))
"""


def test_a_cluster_a_test_starts_itself_runs_its_workers_at_the_tests_priority() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PLAIN_START], check=False, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == str(os.nice(0)), done.stdout


def test_the_fixture_clusters_workers_run_at_the_tests_priority(local_ray) -> None:
    assert ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote()) == os.nice(0)


def test_a_cluster_whose_start_timed_out_is_started_again_and_another_error_raised_at_once(monkeypatch) -> None:
    from ray.cluster_utils import Cluster

    real, calls = Cluster.add_node, []

    def add_node(self, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs)
        if len(calls) == 1:  # what Ray raises when a raylet misses its 30 s to register
            raise Exception("The current node timed out during startup. This could happen because ...")
        return real(self, **kwargs)

    monkeypatch.setattr(Cluster, "add_node", add_node)
    cluster = start_cluster({"num_cpus": 0, "include_dashboard": False}, [])
    try:
        assert len(calls) == 2 and cluster.head_node is not None and cluster.head_node.remaining_processes_alive()
    finally:
        cluster.shutdown()

    def refused(self, **kwargs):  # type: ignore[no-untyped-def]
        raise ValueError("num_cpus must be >= 0")

    monkeypatch.setattr(Cluster, "add_node", refused)
    with pytest.raises(ValueError, match="num_cpus"):
        start_cluster({"num_cpus": -1}, [])
