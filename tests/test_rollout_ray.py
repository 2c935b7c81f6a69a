"""The rollout side on a real local Ray cluster: manager, workers, buffer and store together."""

from __future__ import annotations

import functools
import threading
import time

import numpy as np
import pytest

from mineonline_core.contracts import fragment as F
from mineonline_core.config import load_config
from mineonline_core.testing import kit as tk
from mineonline_core.contracts.fragment import fragment_checksum
from mineonline_core.rollout.worker import RolloutWorker
from mineonline_core.contracts.store import MemoryStore

POLICY = functools.partial(tk.TinyMLPPolicy, 4, 2)
ENV = functools.partial(tk.cartpole, 50)


def online_dict(tmp_path, **rollout) -> dict:
    return {
        "run_name": "rollout-smoke",
        "output_dir": str(tmp_path),
        "seed": 1,
        "rollout_config": {
            "num_rollout_workers": 2,
            "num_cpus_per_worker": 0.5,
            "fragment_length": 16,
            "to_send_queue_size": 1,
            "worker_config": {"num_envs": 2, "batch_size": 2, "step_timeout": 30},
            "replay_buffer_config": {
                "max_chunks": 64,
                "max_reuse": 1,
                "max_staleness": 1,
                "fragments_per_report": 10_000,
                "database_config": {"backend": "memory"},
            },
            **rollout,
        },
        "train_config": {"num_workers": 1, "num_cpus_per_worker": 0.5, "context_length": 16},
        "logger_config": {"loggers": []},
    }


def weights(version: int) -> dict[str, np.ndarray]:
    policy = POLICY()
    return {k: (v + 0.01 * version).numpy() for k, v in policy.state_dict().items()}


def test_manager_workers_buffer_end_to_end(local_ray, tmp_path) -> None:
    ray = local_ray
    from mineonline_core.rollout.manager import get_rollout_manager, launch_rollout_manager

    cfg = load_config(online_dict(tmp_path)).config
    manager = launch_rollout_manager(policy_generator=POLICY, env_generator=ENV, config=cfg)
    try:
        assert get_rollout_manager("rollout-smoke") == manager
        ray.get(manager.wait_ready.remote(120), timeout=150)
        workers = ray.get(manager.get_workers.remote())
        buffer, store = ray.get([manager.get_buffer.remote(), manager.get_store_client.remote()])
        # No weights yet: nothing is collected (rollout waits for the trainer's first broadcast).
        assert ray.get(buffer.stats.remote())["replay/fragments_added"] == 0

        manager.update_weights.remote([ray.put(weights(1))], 1)
        chunks = ray.get(buffer.sample.remote(8), timeout=120)
        payloads = store.get_many([k for c in chunks for k in c["keys"]])
        ray.get(buffer.release.remote([c["chunk_id"] for c in chunks]))
        for chunk, payload in zip(chunks, payloads):
            assert chunk["version"] == 1 and (payload[F.VERSION] == 1).all()
            assert payload[F.OBS]["obs"].shape == (16, 4) and payload[F.REWARD].shape == (16,)
            assert chunk["checksums"][0] == fragment_checksum(chunk["keys"][0], payload)

        # A new version: with max_staleness=1, every version-1 chunk is dropped at the bump (all of
        # them, not only the oldest); nothing stale is served afterwards, fresh data is version 3.
        manager.update_weights.remote([ray.put(weights(3))], 3)
        deadline = time.monotonic() + 60
        while ray.get(buffer.stats.remote())["replay/version"] != 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        chunks = ray.get(buffer.sample.remote(4), timeout=120)
        ray.get(buffer.release.remote([c["chunk_id"] for c in chunks]))
        assert all(c["version"] == 3 for c in chunks)
        stats = ray.get(buffer.stats.remote())
        assert stats["replay/staleness_mean"] == 0.0
        # Every env of both workers contributes; a slower worker may still be cutting its first
        # version-3 fragment, so the store is polled (a remote condition) until each stream shows up.
        seen = {k.rsplit(".", 1)[0] for c in chunks for k in c["keys"]}
        deadline = time.monotonic() + 60
        while not {"0.0.0", "0.0.1", "1.0.0", "1.0.1"} <= seen and time.monotonic() < deadline:
            seen |= {k.rsplit(".", 1)[0] for k in store.keys()}
            time.sleep(0.05)
        assert {"0.0.0", "0.0.1", "1.0.0", "1.0.1"} <= seen

        # (A killed worker's restart with current weights is tests/faults/test_actor_faults.py.)
        status = ray.get(manager.status.remote(), timeout=30)
        assert status["incarnations"] == {0: 0, 1: 0} and status["version"] == 3
        assert len(status["workers"]) == 2 and all(w["version"] == 3 for w in status["workers"])
        ray.get(manager.health.remote())
        store_size = store.size()
        assert store_size <= 64 + 8  # bounded by max_chunks (+ chunks being drained)
    finally:
        ray.get(manager.shutdown.remote(), timeout=120)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(workers[1].health.remote(), timeout=30)


class GatedStore(MemoryStore):
    """A store whose ``put`` blocks until ``gate`` opens: a stalled store or network."""

    def __init__(self) -> None:
        super().__init__(path="unused")
        self.gate = threading.Event()
        self.puts = 0

    def put(self, key, payload) -> None:
        self.puts += 1
        self.gate.wait()
        super().put(key, payload)


def test_full_send_queue_blocks_collection(local_ray) -> None:
    ray = local_ray
    from mineonline_core.rollout.buffer import ReplayBuffer
    from mineonline_core.services.storehost import StoreClient, start_store_host

    host = start_store_host(store_cls=MemoryStore, path="unused", num_shards=1, resume=False)
    client = StoreClient.connect(host, store_cls=MemoryStore, path="unused", num_shards=1)
    buffer = (
        ray.remote(ReplayBuffer)
        .options(num_cpus=0)
        .remote(store_client=client, max_chunks=1000, max_reuse=1, max_staleness=100)
    )
    store = GatedStore()
    worker = RolloutWorker(
        worker_id=5,
        config=tk.rollout_config(num_envs=2, batch_size=1, fragment_length=8, to_send_queue_size=1),
        policy_generator=POLICY,
        env_generator=ENV,
        store_client=store,
        buffer=buffer,
    )
    try:
        worker.update_weights([ray.put(weights(2))], 2)
        deadline = time.monotonic() + 60
        while not (store.puts == 1 and worker._queue.full()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker._queue.full() and store.puts == 1
        time.sleep(0.5)  # give a misbehaving collector the chance to run ahead
        done = worker.collector.fragments_done
        # The queue admits one step's fragments (at most num_envs) while below its bound: at most
        # that many in the sender's hands, as many in the queue, and one step's worth finished
        # while the collector waits to enqueue. Nothing more is produced.
        assert done <= 2 + 2 + 2
        store.gate.set()
        while ray.get(buffer.stats.remote())["replay/fragments_added"] < done + 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ray.get(buffer.stats.remote())["replay/fragments_added"] >= done + 4
        worker.health()
    finally:
        store.gate.set()
        worker.shutdown()


def test_a_failed_background_thread_is_raised_by_every_later_call(local_ray) -> None:
    ray = local_ray
    from mineonline_core.errors import RunFailedError
    from mineonline_core.rollout.buffer import ReplayBuffer

    buffer = (
        ray.remote(ReplayBuffer)
        .options(num_cpus=0)
        .remote(store_client=None, max_chunks=10, max_reuse=1, max_staleness=1)
    )
    broken_env = functools.partial(tk.faulty_counting, 0, raise_rate=1.0)
    config = tk.rollout_config(num_envs=1, batch_size=1, fragment_length=4, to_send_queue_size=1, max_env_restarts=0)
    worker = RolloutWorker(
        worker_id=7,
        config=config,
        policy_generator=tk.TinyMLPPolicy,
        env_generator=broken_env,
        store_client=None,
        buffer=buffer,
    )
    try:
        worker.update_weights([ray.put({k: v.numpy() for k, v in tk.TinyMLPPolicy().state_dict().items()})], 1)
        deadline = time.monotonic() + 60
        while worker._error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        for call in (worker.health, worker.report, worker.record_video, lambda: worker.update_weights([], 2)):
            with pytest.raises(RunFailedError, match="max_env_restarts=0"):
                call()
        assert worker.status()["error"] is not None
    finally:
        worker.shutdown()


class _Remote:
    """``handle.method.remote(*args)`` recorded in-process: stands in for the logging actor."""

    def __init__(self, calls: list, name: str) -> None:
        self.calls, self.name = calls, name

    def remote(self, *args, **kwargs) -> None:
        self.calls.append((self.name, args, kwargs))


class RecordingHub:
    def __init__(self) -> None:
        self.calls: list = []

    def __getattr__(self, name: str) -> _Remote:
        return _Remote(self.calls, name)


def test_recorded_episode_is_encoded_and_sent_with_env_steps(local_ray) -> None:
    ray = local_ray
    from mineonline_core.rollout.buffer import ReplayBuffer

    buffer = (
        ray.remote(ReplayBuffer)
        .options(num_cpus=0)
        .remote(store_client=None, max_chunks=10_000, max_reuse=1, max_staleness=100)
    )
    hub, store = RecordingHub(), MemoryStore(path="unused")
    image_env = functools.partial(tk.counting, 0, episode_len=12, image=True)
    config = tk.rollout_config(num_envs=1, batch_size=1, fragment_length=4, to_send_queue_size=4, video_fps=10)
    worker = RolloutWorker(
        worker_id=0,
        config=config,
        policy_generator=tk.TinyMLPPolicy,
        env_generator=image_env,
        store_client=store,
        buffer=buffer,
        stats=RecordingHub(),
        logger_hub=hub,
        report_interval=0.2,
    )
    try:
        worker.update_weights([ray.put({k: v.numpy() for k, v in tk.TinyMLPPolicy().state_dict().items()})], 1)
        deadline = time.monotonic() + 60
        while not worker.is_ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        worker.record_video()
        while not any(c[0] == "log_video" for c in hub.calls) and time.monotonic() < deadline:
            time.sleep(0.05)
        worker.health()
    finally:
        worker.shutdown()
    (video,) = [c for c in hub.calls if c[0] == "log_video"]
    key, mp4 = video[1][:2]
    assert key == "rollout/video" and mp4[4:8] == b"ftyp" and len(mp4) > 1000
    steps = sum(c[1][0] for c in hub.calls if c[0] == "add_env_steps")
    assert 12 <= steps <= worker.collector.env_steps


def test_worker_records_the_reference_policys_own_state_at_each_fragment_start(local_ray) -> None:
    """§5.4 on the rollout side: the broadcast's second ref is the KL reference; each fragment's
    ``ref_state_in`` is the reference's state after running over the stream from its start."""
    ray = local_ray
    import torch

    from mineonline_core.rollout.buffer import ReplayBuffer
    from mineonline_core.services.storehost import StoreClient, start_store_host
    from mineonline_core.contracts.tree import tree_stack

    host = start_store_host(store_cls=MemoryStore, path="unused", num_shards=1, resume=False)
    store = StoreClient.connect(host, store_cls=MemoryStore, path="unused", num_shards=1)
    buffer = (
        ray.remote(ReplayBuffer)
        .options(num_cpus=0)
        .remote(store_client=store, max_chunks=1000, max_reuse=1, max_staleness=100)
    )
    policy_fn = functools.partial(tk.TinyGRUPolicy, 3, 2)
    torch.manual_seed(0)
    behaviour = {k: v.numpy() for k, v in policy_fn().state_dict().items()}
    torch.manual_seed(1)
    reference = policy_fn()
    config = tk.rollout_config(num_envs=2, batch_size=2, fragment_length=4, to_send_queue_size=4, env_processes=False)
    worker = RolloutWorker(
        worker_id=0,
        config=config,
        policy_generator=policy_fn,
        env_generator=functools.partial(tk.counting, 0, 5),
        store_client=store,
        buffer=buffer,
    )
    try:
        worker.update_weights(
            [ray.put(behaviour), ray.put({k: v.numpy() for k, v in reference.state_dict().items()})], 1
        )
        deadline = time.monotonic() + 60
        while len(store.keys()) < 16 and time.monotonic() < deadline:
            time.sleep(0.05)
        worker.health()
    finally:
        worker.shutdown()
    keys = sorted(store.keys())
    frags = dict(zip(keys, store.get_many(keys)))
    for stream in ("0.0.0", "0.0.1"):
        chain = [frags[k] for k in keys if k.startswith(stream + ".")]
        assert [f[F.INDEX] for f in chain] == list(range(len(chain))) and len(chain) >= 2
        state = reference.initial_state(1)
        with torch.no_grad():
            for frag in chain:
                # At an episode start the state is reset to the initial one (the policy resets there anyway).
                expected = reference.initial_state(1) if frag[F.FIRST][0] else state
                np.testing.assert_allclose(frag[F.REF_STATE_IN][0], expected[0].numpy(), atol=1e-6)
                obs = {"obs": torch.as_tensor(tree_stack([frag[F.OBS]["obs"]]))}
                _, state = reference(input=obs, state_in=state, context={"first": torch.as_tensor(frag[F.FIRST])[None]})
        assert not np.allclose(chain[1][F.REF_STATE_IN][0], chain[1][F.STATE_IN][0])  # its own state, not the policy's


def test_minestudio_start_rolloutmanager_starts_the_run_and_claims_its_directory(local_ray, tmp_path) -> None:
    """The public entry point validates, writes the run directory, starts the logging actor and the
    manager, and holds the run directory: a second process starting the same run is refused."""
    ray = local_ray
    import json
    import subprocess
    import sys

    import mineonline_core
    from mineonline_core.rollout.manager import get_rollout_manager
    from mineonline_core.services.names import LOGGER_HUB, NAMESPACE, actor_name

    data = online_dict(tmp_path, num_rollout_workers=1)
    data["run_name"] = "public-entry"
    manager = mineonline_core.start_rolloutmanager(POLICY, ENV, data)
    hub = ray.get_actor(actor_name("public-entry", LOGGER_HUB), namespace=NAMESPACE)
    try:
        assert get_rollout_manager("public-entry") == manager
        assert (tmp_path / "public-entry" / "config.yaml").is_file()
        ray.get(manager.wait_ready.remote(120), timeout=150)
        second = subprocess.run(
            [
                sys.executable,
                "-c",
                "import json, sys\n"
                "from mineonline_core.config import load_config\n"
                "from mineonline_core.registry import get_plugin_manager\n"
                "from mineonline_core.driver.rundir import claim_run\n"
                "claim_run(load_config(json.loads(sys.argv[1])).config, get_plugin_manager())",
                json.dumps(data),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (
            second.returncode != 0
            and "RunInUseError" in second.stderr
            and "is in use by another mineonline run" in second.stderr
        )
    finally:
        ray.get(manager.shutdown.remote(), timeout=60)
        ray.kill(manager)
        ray.kill(hub)
