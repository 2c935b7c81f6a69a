"""Shared fixtures of the fault-injection suite: one local Ray cluster per test module."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(scope="module")
def ray_cluster():
    """A private local cluster (``address="local"``: never another engineer's); yields its GCS address."""
    import ray

    from mineonline_core.driver.localcluster import start_local_cluster

    start_local_cluster(num_cpus=2, include_dashboard=False, namespace="mineonline", log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
