"""Shared rollout inference (``rollout_config.inference: shared``) on a real local Ray cluster, on
the CPU fallback: the server's forward is the local one, it coalesces the requests of several
workers into one forward, the version recorded with each step is that of the weights that chose
it, and a whole run trains through it."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mineonline_core.config import load_config
from mineonline_core.config.checks import required_resources
from mineonline_core.contracts import fragment as F
from mineonline_core.rollout.inference import InferenceServer
from mineonline_core.rollout.stepping import StepRequest
from mineonline_core.testing import kit as tk

GRU = functools.partial(tk.TinyGRUPolicy, 3, 2)
RGRU = functools.partial(tk.TinyGRUPolicy, 4, 2)  # CartPole's observations
ENV = functools.partial(tk.cartpole, 50)
# Hang guards for a run's events: beside two CPU burners a worker's second life took past 120 s to send fragments.
WAIT_S = 360


def numpy_state(policy: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in policy.state_dict().items()}


def request(seed: int, worker: int, incarnation: int = 0, n: int = 2, values: int = 1) -> StepRequest:
    """``n`` action rows of envs 0.. (the first one starts an episode and a fragment) and ``values`` value-only
    rows of env 1: no recurrent state travels, the server keeps it."""
    rows = n + values
    return StepRequest(
        obs={"obs": np.random.default_rng(seed).normal(size=(rows, 1, 3)).astype(np.float32)},
        first=np.array([i == 0 for i in range(n)] + [False] * values),
        env_ids=np.array(list(range(n)) + [1] * values, np.int64),
        n=n,
        want=np.array([i == 0 for i in range(n)]),
        worker_id=worker,
        incarnation=incarnation,
    )


def test_server_coalesces_workers_and_reproduces_the_local_forward(local_ray) -> None:
    ray = local_ray
    torch.manual_seed(0)
    behaviour = GRU()
    torch.manual_seed(1)
    reference = GRU()
    config = tk.rollout_config(inference="shared", inference_wait_ms=60_000)
    server = (
        ray.remote(InferenceServer).options(num_cpus=0, max_concurrency=8).remote(policy_generator=GRU, config=config)
    )
    try:
        assert ray.get(server.wait_weights.remote(0.0)) is False  # no weights yet
        server.update_weights.remote([ray.put(numpy_state(behaviour)), ray.put(numpy_state(reference))], 3)
        assert ray.get(server.wait_weights.remote(60.0))

        ray.get(server.step.remote(request(10, 0)))  # worker 0 is known now: the server waits for it
        assert ray.get(server.metrics.remote())["rollout/inference_multi_worker_forwards"] == 0
        # Worker 0's next life: its slots start from initial states again, as worker 1's first ones do.
        requests = {1: request(1, 1), 0: request(0, 0, incarnation=1)}
        # Worker 1's request first, and worker 0's only once it is queued: a threaded actor may run
        # calls in any order, and worker 0's alone would not wait for worker 1 (not served yet).
        pending = [server.step.remote(requests[1])]
        deadline = time.monotonic() + 300
        while ray.get(server.metrics.remote())["rollout/inference_queued"] < 1:
            assert time.monotonic() < deadline, "worker 1's request never reached the server's queue"
            time.sleep(0.02)  # polling: unpaced, the calls took the server's threads and the CPU from the step
        pending.append(server.step.remote(requests[0]))
        replies = ray.get(pending)
        metrics = ray.get(server.metrics.remote())
        # Both requests ran in one forward of their 6 rows (the server waited for worker 0 to come back).
        assert metrics["rollout/inference_forwards"] == 2 and metrics["rollout/inference_multi_worker_forwards"] == 1
        assert metrics["rollout/inference_batch_mean"] == 6 and metrics["rollout/inference_requests_mean"] == 2

        with torch.no_grad():
            for r, reply in zip(requests.values(), replies):
                obs, first = {"obs": torch.as_tensor(r.obs["obs"])}, torch.as_tensor(r.first)[:, None]
                zeros = behaviour.initial_state(3)  # every slot of this life is still initial
                latents, _ = behaviour(input=obs, state_in=zeros, context={"first": first})
                logprob = behaviour.pi_head.logprob(torch.tensor(reply.action), latents["pi_logits"][:2]).reshape(-1)
                np.testing.assert_allclose(reply.logprob, logprob.numpy(), atol=1e-6)
                np.testing.assert_allclose(reply.vpred, latents["vpred"].reshape(-1).numpy(), atol=1e-6)
                # Only row 0 starts a fragment: its states (policy's and reference's) before the step come back.
                np.testing.assert_array_equal(reply.states[0], zeros[0][:1].numpy())
                np.testing.assert_array_equal(reply.ref_states[0], reference.initial_state(1)[0].numpy())
                assert reply.version == 3 and reply.action.shape == (2, 1) and reply.vpred.shape == (3,)
    finally:
        ray.kill(server)


def online_dict(tmp_path, **rollout) -> dict:
    return {
        "run_name": "shared-inference",
        "output_dir": str(tmp_path),
        "seed": 1,
        "rollout_config": {
            "num_rollout_workers": 2,
            "num_cpus_per_worker": 0.5,
            "fragment_length": 16,
            "inference": "shared",
            "inference_wait_ms": 1000,
            "worker_config": {"num_envs": 2, "batch_size": 2, "env_processes": False},
            "replay_buffer_config": {
                "max_chunks": 10_000,
                "max_reuse": 1,
                "max_staleness": 100,
                "fragments_per_report": 10_000,
                "database_config": {"backend": "memory"},
            },
            **rollout,
        },
        "train_config": {"num_workers": 1, "num_cpus_per_worker": 0.5, "context_length": 16},
        "logger_config": {"loggers": []},
    }


def weights(version: int) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    return {k: (v + 0.1 * version).numpy() for k, v in RGRU().state_dict().items()}


def test_each_step_records_the_version_and_states_that_chose_it(local_ray, tmp_path) -> None:
    """2 workers x 2 envs through one server, a recurrent policy and a KL reference: replaying each
    fragment from its stored ``state_in`` under the weights of each step's stored version gives its
    stored log-probs, across a weight update; each fragment's ``ref_state_in`` is the reference's
    state after the stream's previous fragment; and some forwards mixed both workers' rows."""
    ray = local_ray
    from mineonline_core.rollout.manager import launch_rollout_manager

    torch.manual_seed(1)
    reference = RGRU()
    ref_ref = ray.put(numpy_state(reference))
    cfg = load_config(online_dict(tmp_path)).config
    manager = launch_rollout_manager(policy_generator=RGRU, env_generator=ENV, config=cfg)
    try:
        ray.get(manager.wait_ready.remote(WAIT_S), timeout=WAIT_S + 30)
        server, store = ray.get([manager.get_inference_server.remote(), manager.get_store_client.remote()])
        assert ray.get(manager.weight_receivers.remote()) == [server]  # the trainer broadcasts to the server
        manager.update_weights.remote([ray.put(weights(1)), ref_ref], 1)

        def wait_for_version(version: int) -> list[str]:
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:
                keys = store.keys()
                if any(f[F.VERSION][-1] == version for f in store.get_many(keys)):
                    return keys
                ray.get(manager.health.remote())
                time.sleep(0.05)
            raise AssertionError(f"no fragment of version {version} within {WAIT_S}s")

        wait_for_version(1)
        manager.update_weights.remote([ray.put(weights(3)), ref_ref], 3)
        keys = sorted(wait_for_version(3), key=lambda k: [int(p) for p in k.split(".")])
        fragments = store.get_many(keys)
        ray.get(manager.health.remote())
        metrics = ray.get(server.metrics.remote())
    finally:
        ray.get(manager.shutdown.remote(), timeout=120)

    assert metrics["rollout/inference_multi_worker_forwards"] >= 1  # rows of both workers in one forward
    streams = {k.rsplit(".", 1)[0] for k in keys}
    assert streams == {"0.0.0", "0.0.1", "1.0.0", "1.0.1"}
    policies = {}
    for version in (1, 3):
        policies[version] = RGRU()
        policies[version].load_state_dict({k: torch.as_tensor(v) for k, v in weights(version).items()})
    versions, ref_state, carried = set(), {}, 0
    with torch.no_grad():
        for key, frag in zip(keys, fragments):
            obs, first = torch.tensor(frag[F.OBS]["obs"]), torch.tensor(frag[F.FIRST])
            h = [torch.as_tensor(frag[F.STATE_IN][0])]
            for t in range(len(first)):
                policy = policies[int(frag[F.VERSION][t])]
                latents, h = policy(
                    input={"obs": obs[t : t + 1, None]}, state_in=h, context={"first": first[t : t + 1, None]}
                )
                logprob = policy.pi_head.logprob(torch.as_tensor(frag[F.ACTION][t : t + 1, None]), latents["pi_logits"])
                np.testing.assert_allclose(frag[F.LOGPROB][t], float(logprob), atol=1e-5)
                versions.add(int(frag[F.VERSION][t]))
            stream = key.rsplit(".", 1)[0]
            expected = (
                reference.initial_state(1)[0] if frag[F.FIRST][0] or stream not in ref_state else ref_state[stream]
            )
            carried += not frag[F.FIRST][0] and stream in ref_state
            np.testing.assert_allclose(frag[F.REF_STATE_IN][0], expected.numpy(), atol=1e-6)
            _, (ref_state[stream],) = reference(
                input={"obs": obs[None]},
                state_in=[torch.as_tensor(frag[F.REF_STATE_IN][0])],
                context={"first": first[None]},
            )
    assert versions == {1, 3} and carried  # some reference state was carried across fragments


def test_killed_server_and_worker_restart_without_losing_states_or_weights(local_ray, tmp_path) -> None:
    """The server is restarted by Ray and asks the manager for the latest weights; it lost the envs' states,
    so the retried calls are answered ``lost`` and each env's memory restarts (``first``) at its next step:
    every step still replays from its fragment's ``STATE_IN``. A killed worker's new life starts from
    initial states."""
    ray = local_ray
    import os
    import signal

    from mineonline_core.rollout.manager import launch_rollout_manager

    cfg = load_config(online_dict(tmp_path)).config
    manager = launch_rollout_manager(policy_generator=RGRU, env_generator=ENV, config=cfg)
    try:
        ray.get(manager.wait_ready.remote(WAIT_S), timeout=WAIT_S + 30)
        server, store = ray.get([manager.get_inference_server.remote(), manager.get_store_client.remote()])
        manager.update_weights.remote([ray.put(weights(2))], 2)

        def wait(condition, what: str):
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline:
                ray.get(manager.health.remote())
                found = condition()
                if found:
                    return found
                time.sleep(0.1)
            raise AssertionError(f"not within {WAIT_S}s: {what}")

        wait(lambda: len(store.keys()) >= 4, "fragments before the kills")
        ray.kill(server, no_restart=False)  # a crash: Ray restarts it
        count = len(store.keys())
        wait(lambda: len(store.keys()) >= count + 8, "fragments after the server's restart")
        worker = ray.get(manager.get_workers.remote())[0]
        os.kill(ray.get(worker.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)
        wait(lambda: [k for k in store.keys() if k.startswith("0.1.")], "fragments of worker 0's second life")
        keys = sorted(store.keys(), key=lambda k: [int(p) for p in k.split(".")])
        fragments = store.get_many(keys)
        ray.get(manager.health.remote())
        # The server's crash cost no worker its life: only the killed worker restarted.
        assert ray.get(manager.status.remote(), timeout=30)["incarnations"] == {0: 1, 1: 0}
    finally:
        ray.get(manager.shutdown.remote(), timeout=120)

    assert all((f[F.VERSION] == 2).all() for f in fragments)  # the restarted server got version 2 again
    new_life = [f for k, f in zip(keys, fragments) if k.startswith("0.1.") and f[F.INDEX] == 0]
    assert new_life and all(f[F.FIRST][0] and not f[F.STATE_IN][0].any() for f in new_life)
    policy = RGRU()
    policy.load_state_dict({k: torch.as_tensor(v) for k, v in weights(2).items()})
    with torch.no_grad():  # every step still matches the state it was stored with (nothing lost or mixed)
        for frag in fragments:
            obs, first = torch.tensor(frag[F.OBS]["obs"]), torch.tensor(frag[F.FIRST])
            latents, _ = policy(
                input={"obs": obs[None]}, state_in=[torch.tensor(frag[F.STATE_IN][0])], context={"first": first[None]}
            )
            logprob = policy.pi_head.logprob(torch.tensor(frag[F.ACTION])[None], latents["pi_logits"]).reshape(-1)
            np.testing.assert_allclose(frag[F.LOGPROB], logprob.numpy(), atol=1e-5)


def test_shared_inference_reserves_the_workers_gpus_once_and_one_more_cpu_share(tmp_path) -> None:
    local = load_config(online_dict(tmp_path, inference="local", num_gpus_per_worker=0.25)).config
    shared = load_config(online_dict(tmp_path, num_gpus_per_worker=0.75)).config
    assert required_resources(local) == {"CPU": 1.5, "GPU": 0.5}
    assert required_resources(shared) == {"CPU": 2.0, "GPU": 1.0}  # 2 x 0.75, at most one GPU


def test_auto_inference_gives_one_process_the_gpu_the_workers_would_share(tmp_path) -> None:
    """Row 4: fractional GPU shares of several workers that fit one GPU resolve to one shared server; CPU
    rollout, a GPU per worker and shares over several GPUs stay local; an explicit choice stands."""

    def resolved(**rollout) -> str:
        return load_config(online_dict(tmp_path, **rollout)).config.rollout_config.inference

    assert resolved(inference="auto", num_gpus_per_worker=0.5) == "shared"  # 2 workers x 0.5
    assert resolved(inference="auto", num_gpus_per_worker=0) == "local"
    assert resolved(inference="auto", num_gpus_per_worker=1) == "local"
    assert resolved(inference="auto", num_gpus_per_worker=0.75) == "local"  # 1.5 GPUs: one server covers one
    assert resolved(inference="local", num_gpus_per_worker=0.5) == "local"
    flagship = load_config(
        Path(__file__).resolve().parents[1] / "examples" / "flagship_vpt2x.yaml",
        overrides=["rollout_config.inference=auto"],
    ).config
    assert flagship.rollout_config.inference == "shared"


def test_unknown_inference_mode_is_refused(tmp_path) -> None:
    from mineonline_core.errors import ConfigError

    with pytest.raises(ConfigError, match="inference"):
        load_config(online_dict(tmp_path, inference="remote"))


def test_a_run_trains_through_the_shared_inference_server(local_ray, tmp_path, monkeypatch) -> None:
    """CartPole, 2 rollout workers x 2 envs, KL-PPO in the driver's process: the server holds the
    policy and the KL reference, and the run trains its iterations with the server's versions."""
    from mineonline_core.driver.api import run

    monkeypatch.setenv("WANDB_MODE", "disabled")
    config = {
        "run_name": "shared-e2e",
        "output_dir": str(tmp_path),
        "env_config": {"name": "gymnasium", "id": "CartPole-v1"},
        "policy_config": {"name": "mlp", "hidden_sizes": [32, 32]},
        "rollout_config": {
            "num_rollout_workers": 2,
            "num_cpus_per_worker": 0.25,
            "fragment_length": 32,
            "inference": "shared",
            "worker_config": {"num_envs": 2, "batch_size": 2},
            "replay_buffer_config": {"max_staleness": 3, "max_reuse": 2, "database_config": {"backend": "memory"}},
        },
        "train_config": {
            "num_workers": 1,
            "num_cpus_per_worker": 0.5,
            "num_iterations": 3,
            "vf_warmup": 1,
            "batch_size_per_gpu": 2,
            "batches_per_iteration": 2,
            "gradient_accumulation": 1,
            "context_length": 16,
            "save_interval": 3,
            "record_video_interval": 0,
            "learning_rate": 1e-3,
            "kl_divergence_coef_rho": 0.1,
        },
        "logger_config": {"loggers": []},
    }
    result = run(config, progress=False)
    assert result["status"] == "completed"
    summary = result["summary"]
    assert summary["trainer/iteration"] == 3 and summary["trainer/version"] == 2
    # The mean over the workers of the version their latest replies carried: above 0 once any worker was
    # served a trained version (a worker whose last report came before its first such reply counts 0).
    assert 0 < summary["rollout/model_version"] <= 2
    assert summary["rollout/inference_forwards"] > 0 and summary["rollout/fragments_sent"] > 0
