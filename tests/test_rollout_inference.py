"""Shared rollout inference (``rollout_config.inference: shared``) on a real local Ray cluster, on
the CPU fallback: the server's forward is the local one, it coalesces the requests of several
workers into one forward, the version recorded with each step is that of the weights that chose
it, and a whole run trains through it."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import torch

from mineonline_core.config import load_config
from mineonline_core.config.checks import required_resources
from mineonline_core.contracts import fragment as F
from mineonline_core.rollout.inference import InferenceServer
from mineonline_core.testing import kit as tk

GRU = functools.partial(tk.TinyGRUPolicy, 3, 2)
MLP = functools.partial(tk.TinyMLPPolicy, 4, 2)
ENV = functools.partial(tk.cartpole, 50)


def numpy_state(policy: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in policy.state_dict().items()}


def batch(seed: int, n: int = 2, values: int = 1) -> dict:
    """``n`` action rows (the first one starts an episode) and ``values`` value-only rows."""
    rng = np.random.default_rng(seed)
    rows = n + values
    return {"obs": {"obs": rng.normal(size=(rows, 1, 3)).astype(np.float32)},
            "state": [rng.normal(size=(rows, 8)).astype(np.float32)],
            "first": np.array([[i == 0] for i in range(rows)]), "n": n,
            "ref_state": [rng.normal(size=(n, 8)).astype(np.float32)]}  # fmt: skip


def test_server_coalesces_workers_and_reproduces_the_local_forward(local_ray) -> None:
    ray = local_ray
    torch.manual_seed(0)
    behaviour = GRU()
    torch.manual_seed(1)
    reference = GRU()
    config = tk.rollout_config(inference="shared", inference_wait_ms=60_000)
    server = ray.remote(InferenceServer).options(num_cpus=0, max_concurrency=8).remote(policy_generator=GRU, config=config)
    try:
        assert ray.get(server.wait_weights.remote(0.0, 2)) == (False, None)  # no weights yet
        server.update_weights.remote([ray.put(numpy_state(behaviour)), ray.put(numpy_state(reference))], 3)
        loaded, ref_init = ray.get(server.wait_weights.remote(60.0, 2))
        assert loaded and np.array_equal(ref_init[0], reference.initial_state(2)[0].numpy())

        ray.get(server.infer.remote(0, batch(10)))  # worker 0 is known now: the server waits for it
        assert ray.get(server.metrics.remote())["rollout/inference_multi_worker_forwards"] == 0
        batches = {1: batch(1), 0: batch(0)}
        replies = ray.get([server.infer.remote(w, b) for w, b in batches.items()])  # worker 1's may come first
        metrics = ray.get(server.metrics.remote())
        # Both requests ran in one forward of their 6 rows (the server waited for worker 0 to come back).
        assert metrics["rollout/inference_forwards"] == 2 and metrics["rollout/inference_multi_worker_forwards"] == 1
        assert metrics["rollout/inference_batch_mean"] == 6 and metrics["rollout/inference_requests_mean"] == 2

        with torch.no_grad():
            for b, reply in zip(batches.values(), replies):
                obs, first = {"obs": torch.as_tensor(b["obs"]["obs"])}, torch.as_tensor(b["first"])
                latents, state_out = behaviour(input=obs, state_in=[torch.as_tensor(b["state"][0])], context={"first": first})
                logprob = behaviour.pi_head.logprob(torch.as_tensor(reply["action"]), latents["pi_logits"]).reshape(-1)
                np.testing.assert_allclose(reply["logprob"], logprob.numpy(), atol=1e-6)
                np.testing.assert_allclose(reply["vpred"], latents["vpred"].reshape(-1).numpy(), atol=1e-6)
                np.testing.assert_allclose(reply["state_out"][0], state_out[0].numpy(), atol=1e-6)
                n = b["n"]
                _, ref_out = reference(input={"obs": obs["obs"][:n]}, state_in=[torch.as_tensor(b["ref_state"][0])],
                                       context={"first": first[:n]})  # fmt: skip
                np.testing.assert_allclose(reply["ref_state_out"][0], ref_out[0].numpy(), atol=1e-6)
                assert reply["version"] == 3 and reply["action"].shape == (3, 1)
    finally:
        ray.kill(server)


def online_dict(tmp_path, **rollout) -> dict:
    return {
        "run_name": "shared-inference", "output_dir": str(tmp_path), "seed": 1,
        "rollout_config": {
            "num_rollout_workers": 2, "num_cpus_per_worker": 0.5, "fragment_length": 16, "inference": "shared",
            "inference_wait_ms": 1000, "worker_config": {"num_envs": 2, "batch_size": 2, "env_processes": False},
            "replay_buffer_config": {"max_chunks": 10_000, "max_reuse": 1, "max_staleness": 100,
                                     "fragments_per_report": 10_000, "database_config": {"backend": "memory"}},
            **rollout,
        },
        "train_config": {"num_workers": 1, "num_cpus_per_worker": 0.5, "context_length": 16},
        "logger_config": {"loggers": []},
    }  # fmt: skip


def weights(version: int) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    return {k: (v + 0.1 * version).numpy() for k, v in MLP().state_dict().items()}


def test_each_step_records_the_version_of_the_weights_that_chose_it(local_ray, tmp_path) -> None:
    """2 workers x 2 envs through one server: every step's stored log-prob is its action's under
    the weights of the version stored with it, across a weight update; forwards mixed both workers."""
    ray = local_ray
    from mineonline_core.rollout.manager import launch_rollout_manager

    cfg = load_config(online_dict(tmp_path)).config
    manager = launch_rollout_manager(policy_generator=MLP, env_generator=ENV, config=cfg)
    try:
        ray.get(manager.wait_ready.remote(120), timeout=150)
        server, store = ray.get([manager.get_inference_server.remote(), manager.get_store_client.remote()])
        assert ray.get(manager.weight_receivers.remote()) == [server]  # the trainer broadcasts to the server
        manager.update_weights.remote([ray.put(weights(1))], 1)

        def wait_for_version(version: int) -> list[str]:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                keys = store.keys()
                if any(f[F.VERSION][-1] == version for f in store.get_many(keys)):
                    return keys
                ray.get(manager.health.remote())
                time.sleep(0.05)
            raise AssertionError(f"no fragment of version {version} within 120s")

        wait_for_version(1)
        manager.update_weights.remote([ray.put(weights(3))], 3)
        keys = wait_for_version(3)
        fragments = store.get_many(keys)
        ray.get(manager.health.remote())
        metrics = ray.get(server.metrics.remote())
    finally:
        ray.get(manager.shutdown.remote(), timeout=120)

    assert metrics["rollout/inference_multi_worker_forwards"] >= 1  # rows of both workers in one forward
    assert {k.rsplit(".", 1)[0] for k in keys} == {"0.0.0", "0.0.1", "1.0.0", "1.0.1"}
    policies = {}
    for version in (1, 3):
        policies[version] = MLP()
        policies[version].load_state_dict({k: torch.as_tensor(v) for k, v in weights(version).items()})
    seen = set()
    with torch.no_grad():
        for frag in fragments:
            for version in np.unique(frag[F.VERSION]):
                rows = frag[F.VERSION] == version
                policy = policies[int(version)]
                obs = torch.as_tensor(frag[F.OBS]["obs"][rows])[:, None]
                latents, _ = policy(input={"obs": obs}, state_in=None, context={})
                logprob = policy.pi_head.logprob(torch.as_tensor(frag[F.ACTION][rows])[:, None], latents["pi_logits"])
                np.testing.assert_allclose(frag[F.LOGPROB][rows], logprob.reshape(-1).numpy(), atol=1e-5)
                seen.add(int(version))
    assert seen == {1, 3}


def test_shared_inference_reserves_the_workers_gpus_once_and_one_more_cpu_share(tmp_path) -> None:
    local = load_config(online_dict(tmp_path, inference="local", num_gpus_per_worker=0.25)).config
    shared = load_config(online_dict(tmp_path, num_gpus_per_worker=0.75)).config
    assert required_resources(local) == {"CPU": 1.5, "GPU": 0.5}
    assert required_resources(shared) == {"CPU": 2.0, "GPU": 1.0}  # 2 x 0.75, at most one GPU


def test_unknown_inference_mode_is_refused(tmp_path) -> None:
    from mineonline_core.errors import ConfigError

    with pytest.raises(ConfigError, match="inference"):
        load_config(online_dict(tmp_path, inference="remote"))
