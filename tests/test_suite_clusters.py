"""The clusters the suite starts run their workers at the tests' priority, as a run's own cluster does.

At Ray's default (nice 15) any other busy process on a CI machine takes the CPU from the workers that do
a test's rollout and training: beside two CPU burners the suite got a quarter of a core
(benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

import ray

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
