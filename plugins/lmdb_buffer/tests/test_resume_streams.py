"""B2: a resumed run's workers start new streams past every stream in the LMDB store, so no put
overwrites a stored fragment (which would mix two streams inside one servable chunk).

Issue 28: a run resumed on a damaged store (a shard truncated to 8 KB, which kills whatever maps it
with SIGBUS) fails its start at once with the store's own error naming the shard, and leaves no
rollout manager behind; before, the manager's constructor raised and the driver waited forever."""

from __future__ import annotations

import functools
import os
import threading
import time

import numpy as np

from mineonline_core.contracts import fragment as F
from mineonline_core.config import load_config
from mineonline_core.errors import find_user_error
from mineonline_core.rollout.manager import launch_rollout_manager
from mineonline_core.rollout.startup import first_free_incarnations
from mineonline_core.services.names import NAMESPACE, ROLLOUT_MANAGER, actor_name
from mineonline_core.testing import kit as tk
from mineonline_core.testing.store_conformance import sample_payload
from mineonline_lmdb import LMDBStore, StoreDamagedError

pytest_plugins = ["mineonline_core.testing.fixtures"]

POLICY = functools.partial(tk.TinyMLPPolicy, 4, 2)
ENV = functools.partial(tk.cartpole, 50)


def online(tmp_path, run_name: str, resume: str | None) -> dict:
    return {
        "run_name": run_name,
        "output_dir": str(tmp_path),
        "seed": 1,
        "rollout_config": {
            "num_rollout_workers": 1,
            "num_cpus_per_worker": 0.5,
            "fragment_length": 8,
            "to_send_queue_size": 1,
            "worker_config": {"num_envs": 1, "batch_size": 1, "env_processes": False},
            "replay_buffer_config": {
                "max_chunks": 64,
                "max_reuse": 1,
                "max_staleness": 100,
                "fragments_per_chunk": 2,
                "database_config": {"backend": "lmdb", "path": str(tmp_path / "replay")},
            },
        },
        "train_config": {"num_cpus_per_worker": 0.5, "context_length": 8, "resume": resume},
        "logger_config": {"loggers": []},
    }


def weights(version: int) -> dict[str, np.ndarray]:
    return {k: (v + 0.01 * version).numpy() for k, v in POLICY().state_dict().items()}


def run_until(ray, tmp_path, run_name, resume, *, version: int, min_keys: int) -> dict[str, dict]:
    """Start a manager, publish ``version``, wait until the store holds ``min_keys`` fragments of it,
    stop; return every stored payload by key."""
    manager = launch_rollout_manager(
        policy_generator=POLICY, env_generator=ENV, config=load_config(online(tmp_path, run_name, resume)).config
    )
    try:
        ray.get(manager.wait_ready.remote(120), timeout=150)
        store = ray.get(manager.get_store_client.remote())
        manager.update_weights.remote([ray.put(weights(version))], version)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            payloads = dict(zip(keys := store.keys(), store.get_many(keys)))
            if sum(1 for p in payloads.values() if (p[F.VERSION] == version).all()) >= min_keys:
                break
            time.sleep(0.1)
        ray.get(manager.health.remote())  # a worker failure is the cause, not a timeout
    finally:
        ray.get(manager.shutdown.remote(), timeout=120)
    return payloads


def test_resumed_streams_never_reuse_stored_keys(local_ray, tmp_path):
    ray = local_ray
    first = run_until(ray, tmp_path, "streams-a", None, version=3, min_keys=4)
    assert {F.parse_fragment_key(k)[0] for k in first} == {F.stream_name(0, 0, 0)}
    second = run_until(ray, tmp_path, "streams-b", str(tmp_path / "ckpt"), version=5, min_keys=4)
    new = {k: p for k, p in second.items() if (p[F.VERSION] == 5).all()}
    assert new and all(k.startswith("0.1.0.") for k in new), sorted(new)
    # Every fragment of the first run that is still stored is unchanged.
    for key, payload in second.items():
        if key in first:
            assert (payload[F.VERSION] == 3).all() and np.array_equal(payload[F.LOGPROB], first[key][F.LOGPROB])


def test_first_free_incarnations():
    keys = ["0.0.1.000000004", "0.2.0.000000001", "3.0.0.000000000", "unrelated", "1.x.0.000000000"]
    assert first_free_incarnations(keys) == {0: 3, 3: 1}


def test_a_resume_on_a_truncated_shard_fails_the_start_naming_it(local_ray, tmp_path):
    ray = local_ray
    path = str(tmp_path / "replay")
    store = LMDBStore(path=path, num_shards=8, resume=False)  # the config's default shard count
    store.put_many((F.fragment_key(F.stream_name(0, 0, i % 2), i), sample_payload(i)) for i in range(24))
    store.close()
    shard = os.path.join(path, "shard-000")
    os.truncate(os.path.join(shard, "data.mdb"), 8192)

    outcome: dict = {}

    def start() -> None:
        try:
            outcome["manager"] = launch_rollout_manager(
                policy_generator=POLICY,
                env_generator=ENV,
                config=load_config(online(tmp_path, "damaged", str(tmp_path / "ckpt"))).config,
            )
        except BaseException as exc:  # noqa: BLE001 - the failure this test waits for
            outcome["error"] = exc

    # A thread, so that a start that never returns fails this test instead of hanging the suite.
    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(timeout=300)
    assert not thread.is_alive(), "launch_rollout_manager never returned on a damaged store"
    assert "manager" not in outcome, "the manager started on a damaged store"
    error = find_user_error(outcome["error"])
    assert isinstance(error, StoreDamagedError), repr(outcome["error"])[:2000]
    assert f"shard {shard}: data.mdb is 8192 bytes" in str(error) and f"rm -r '{shard}'" in str(error)
    # Nothing is left running under the run's name: the failed manager was ended with its actors.
    try:
        ray.get_actor(actor_name("damaged", ROLLOUT_MANAGER), namespace=NAMESPACE)
        left = True
    except ValueError:
        left = False
    assert not left, "the failed rollout manager is still alive"
