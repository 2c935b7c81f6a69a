"""The store host actor and its client, on a real local Ray cluster, with the in-memory store."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import ray

from mineonline_core.services.storehost import StoreClient, start_store_host
from mineonline_core.contracts.store import MemoryStore
from mineonline_core.testing.store_conformance import assert_tree_equal, sample_payload


@pytest.fixture
def host(local_ray, tmp_path):
    handle = start_store_host(
        store_cls=MemoryStore,
        path=str(tmp_path / "replay"),
        num_shards=2,
        resume=False,
        options={},
        name=f"store-{tmp_path.name}",
    )
    yield handle
    ray.get(handle.close.remote())
    ray.kill(handle)


def test_host_runs_on_the_callers_node_and_takes_no_cpu(host):
    assert ray.get(host.node_id.remote()) == ray.get_runtime_context().get_node_id()
    # num_cpus=0: both CPUs of the cluster stay free for workers while the host runs.
    assert ray.available_resources().get("CPU", 0) == 2


def test_client_round_trip_through_the_host(host, tmp_path):
    client = StoreClient.connect(host, store_cls=MemoryStore, path=str(tmp_path / "replay"), num_shards=2)
    assert not client.is_local  # the memory store is single-process: always through the actor
    payloads = {f"s.{i:09d}": sample_payload(i) for i in range(4)}
    client.put("single", payloads["s.000000000"])
    client.put_many(payloads.items())
    assert client.size() == 5 and sorted(client.keys()) == sorted([*payloads, "single"])
    for key, got in zip(payloads, client.get_many(list(payloads))):
        assert_tree_equal(got, payloads[key], key)
    assert client.nbytes() >= 5 * sample_payload(0)["obs"]["image"].nbytes
    client.delete_many(["single", "s.000000001"])
    assert client.size() == 3
    with pytest.raises(KeyError):
        client.get("single")


def test_named_host_is_reachable_and_client_pickles(host, tmp_path):
    found = ray.get_actor(f"store-{tmp_path.name}", namespace="mineonline")
    client = StoreClient.connect(found, store_cls=MemoryStore, path=str(tmp_path / "replay"), num_shards=2)
    clone = pickle.loads(pickle.dumps(client))
    clone.put("k", {"x": np.arange(5)})
    assert_tree_equal(client.get("k"), {"x": np.arange(5)})


@ray.remote(num_cpus=1)
def _write(client: StoreClient, start: int, count: int) -> int:
    client.put_many((f"w.{i:09d}", sample_payload(i, frames=2)) for i in range(start, start + count))
    return count


@ray.remote(num_cpus=1)
def _read(client: StoreClient, keys: list[str]) -> list:
    return client.get_many(keys)


def test_tasks_write_and_read_concurrently(host, tmp_path):
    client = StoreClient.connect(host, store_cls=MemoryStore, path=str(tmp_path / "replay"), num_shards=2)
    client.put_many((f"w.{i:09d}", sample_payload(i, frames=2)) for i in range(4))
    # One CPU each: at most two worker processes, reused, on the two-CPU cluster.
    writes = [_write.remote(client, 100 * (n + 1), 10) for n in range(3)]
    reads = [_read.remote(client, [f"w.{i:09d}" for i in range(4)]) for _ in range(2)]
    assert sum(ray.get(writes)) == 30
    for got in ray.get(reads):
        for i, payload in enumerate(got):
            assert_tree_equal(payload, sample_payload(i, frames=2))
    assert client.size() == 34
    assert_tree_equal(client.get("w.000000305"), sample_payload(305, frames=2))
