"""Three raylets on one machine: the store host is pinned to one node, others reach it through it."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
import ray
from mineonline_lmdb import LMDBStore
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from mineonline_core.services.storehost import StoreClient, start_store_host
from mineonline_core.testing.fixtures import start_cluster

PLUGIN_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fragment(seed: int) -> dict:
    image = np.random.default_rng(seed).integers(0, 256, (4, 64, 64, 3), dtype=np.uint8)
    return {"obs": {"image": image}, "state_in": [(np.full((1, 8), seed, np.float32), None)], "index": seed}


@ray.remote(num_cpus=0.5)
def write(client: StoreClient, seeds: list[int]) -> tuple[str, bool]:
    client.put_many((f"f.{s:09d}", fragment(s)) for s in seeds)
    return ray.get_runtime_context().get_node_id(), client.is_local


@ray.remote(num_cpus=0.5)
def read(client: StoreClient, seeds: list[int]) -> tuple[str, bool, list[int]]:
    got = client.get_many([f"f.{s:09d}" for s in seeds])
    sums = [zlib.crc32(g["obs"]["image"]) + int(g["state_in"][0][0][0, 0]) for g in got]
    return ray.get_runtime_context().get_node_id(), client.is_local, sums


@pytest.fixture
def cluster(monkeypatch):
    # Workers of every raylet must import the plugin from this checkout.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([PLUGIN_ROOT, os.environ.get("PYTHONPATH", "")]))
    cluster = start_cluster({"num_cpus": 1}, [{"num_cpus": 1}] * 2)
    nodes = cluster.worker_nodes
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster, [n.node_id for n in nodes]
    ray.shutdown()
    cluster.shutdown()


def on(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def test_store_host_pinned_to_one_node_serves_the_others(cluster, tmp_path):
    _, (store_node, other_node) = cluster
    head_node = ray.get_runtime_context().get_node_id()
    path = str(tmp_path / "replay")
    host = start_store_host(
        store_cls=LMDBStore,
        path=path,
        num_shards=2,
        resume=False,
        options={"map_size_mb": 4},
        node_id=store_node,
        name="replay-store",
    )
    client = StoreClient.connect(host, store_cls=LMDBStore, path=path, num_shards=2, options={"map_size_mb": 4})
    assert client.host_node_id == store_node

    # A rollout worker on another node writes through the host actor.
    node, local = ray.get(write.options(scheduling_strategy=on(other_node)).remote(client, list(range(12))))
    assert (node, local) == (other_node, False)
    # A worker on the store's node opens LMDB itself and writes too.
    node, local = ray.get(write.options(scheduling_strategy=on(store_node)).remote(client, list(range(12, 16))))
    assert (node, local) == (store_node, True)

    want = [zlib.crc32(fragment(s)["obs"]["image"]) + s for s in range(16)]
    for reader_node, expect_local in [(head_node, False), (store_node, True), (other_node, False)]:
        node, local, sums = ray.get(read.options(scheduling_strategy=on(reader_node)).remote(client, list(range(16))))
        assert (node, local, sums) == (reader_node, expect_local, want)
    assert client.size() == 16 and not client.is_local  # the driver runs on the head node
    assert client.nbytes() >= 16 * fragment(0)["obs"]["image"].nbytes
    ray.get(host.close.remote())
