"""B2: a resumed run's workers start new streams past every stream in the LMDB store, so no put
overwrites a stored fragment (which would mix two streams inside one servable chunk)."""

from __future__ import annotations

import functools
import time

import numpy as np

from mineonline_core.contracts import fragment as F
from mineonline_core.config import load_config
from mineonline_core.rollout.manager import first_free_incarnations, launch_rollout_manager
from mineonline_core.testing import kit as tk

pytest_plugins = ["mineonline_core.testing.fixtures"]

POLICY = functools.partial(tk.TinyMLPPolicy, 4, 2)
ENV = functools.partial(tk.cartpole, 50)


def online(tmp_path, run_name: str, resume: str | None) -> dict:
    return {
        "run_name": run_name, "output_dir": str(tmp_path), "seed": 1,
        "rollout_config": {
            "num_rollout_workers": 1, "num_cpus_per_worker": 0.5, "fragment_length": 8, "to_send_queue_size": 1,
            "worker_config": {"num_envs": 1, "batch_size": 1, "env_processes": False},
            "replay_buffer_config": {"max_chunks": 64, "max_reuse": 1, "max_staleness": 100, "fragments_per_chunk": 2,
                                     "database_config": {"backend": "lmdb", "path": str(tmp_path / "replay")}},
        },
        "train_config": {"num_cpus_per_worker": 0.5, "context_length": 8, "resume": resume},
        "logger_config": {"loggers": []},
    }  # fmt: skip


def weights(version: int) -> dict[str, np.ndarray]:
    return {k: (v + 0.01 * version).numpy() for k, v in POLICY().state_dict().items()}


def run_until(ray, tmp_path, run_name, resume, *, version: int, min_keys: int) -> dict[str, dict]:
    """Start a manager, publish ``version``, wait until the store holds ``min_keys`` fragments of it,
    stop; return every stored payload by key."""
    manager = launch_rollout_manager(policy_generator=POLICY, env_generator=ENV,
                                     config=load_config(online(tmp_path, run_name, resume)).config)
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
    assert {k.rsplit(".", 1)[0] for k in first} == {"0.0.0"}
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
