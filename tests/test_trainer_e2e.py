"""Smoke run of the whole loop: 2 rollout workers, a few PPO iterations of CartPole through the memory
store, on each trainer path: 2 DDP ranks on Ray Train (gloo, fractional CPUs), and one rank in the
driver's process. Versions advance, staleness stays bounded, and the checkpoints exist."""

from __future__ import annotations

import json
import shutil

import pytest
import ray
import yaml

from mineonline_core.driver.api import run
from mineonline_core.driver.localcluster import start_local_cluster
from mineonline_core.trainer import checkpoint as ckpt

CONFIG = {
    "run_name": "e2e",
    "env_config": {"name": "gymnasium", "id": "CartPole-v1"},
    "policy_config": {"name": "mlp", "hidden_sizes": [32, 32]},
    "rollout_config": {
        "num_rollout_workers": 2,
        "num_cpus_per_worker": 0.25,
        "fragment_length": 32,
        "worker_config": {"num_envs": 2, "batch_size": 2},
        "replay_buffer_config": {
            "fragments_per_chunk": 1,
            "max_staleness": 3,
            "max_reuse": 2,
            "database_config": {"backend": "memory"},
        },
    },
    "train_config": {
        "num_workers": 2,
        "num_cpus_per_worker": 0.5,
        "num_iterations": 4,
        "vf_warmup": 1,
        "batch_size_per_gpu": 2,
        "batches_per_iteration": 2,
        "gradient_accumulation": 1,
        "context_length": 16,
        "save_interval": 2,
        "keep_interval": 2,
        "record_video_interval": 0,
        "learning_rate": 1e-3,
        "kl_divergence_coef_rho": 0.1,
    },
    "logger_config": {"loggers": []},
}


@pytest.fixture
def ray_local(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    start_local_cluster(num_cpus=2, include_dashboard=False, namespace="mineonline")
    yield
    ray.shutdown()


# (train_config overrides, whether the loop runs on Ray Train)
PATHS = {"ray_train_2_ranks": ({"num_workers": 2}, True), "in_process": ({"num_workers": 1}, False)}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_full_loop_smoke(tmp_path, ray_local, path):
    train, on_ray_train = PATHS[path]
    config = {**CONFIG, "output_dir": str(tmp_path), "train_config": {**CONFIG["train_config"], **train}}
    result = run(config, progress=False)
    assert result["status"] == "completed"
    assert (tmp_path / "e2e" / "ray_train").exists() == on_ray_train
    summary = result["summary"]
    # Iteration 1 is value-only warm-up, so 4 iterations make versions 1..3; the rollout follows.
    assert summary["trainer/iteration"] == 4 and summary["trainer/version"] == 3
    # The workers followed the broadcasts (their last report can come before they loaded the final
    # weights: the in-process trainer ends within a second of its last broadcast).
    assert 1 <= summary["rollout/model_version"] <= 3
    # Fragments were collected and sent. (Not "at least what the trainer consumed": max_reuse 2 lets a
    # chunk be trained on twice, and workers report their counts every 0.5 s, so the summary lags.)
    assert summary["rollout/env_steps"] > 0 and summary["rollout/fragments_sent"] > 0
    records = [json.loads(line) for line in (tmp_path / "e2e" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "trainer/iteration" in r]
    assert [r["trainer/iteration"] for r in train] == [1, 2, 3, 4]
    assert [r["trainer/version"] for r in train] == [0, 1, 2, 3]
    assert all(0 <= r["trainer/staleness_mean"] <= 3 for r in train)
    assert all(r["trainer/vf_warmup"] == (r["trainer/iteration"] == 1) for r in train)
    # KL on: broadcasts carry the reference too, and a worker that failed to load it fails the run.
    assert all(r["trainer/kl_ref"] >= -1e-6 for r in train)  # exact KL; float rounding near an identical reference
    saved = ckpt.list_checkpoints(tmp_path / "e2e" / "checkpoints")
    assert [i for i, _ in saved] == [2, 4]
    state = ckpt.load_checkpoint(saved[-1][1])
    assert state["trainer"]["version"] == 3 and "e2e" in state["config_yaml"]
    assert yaml.safe_load(state["config_yaml"]) == yaml.safe_load((tmp_path / "e2e" / "config.yaml").read_text())

    # A crash after iteration 4 was logged but before its checkpoint: resume from checkpoint 2.
    shutil.rmtree(saved[-1][1])
    steps_at_2 = int(ckpt.load_checkpoint(saved[0][1])["trainer"]["env_steps"])
    assert steps_at_2 == next(r["step"] for r in train if r["trainer/iteration"] == 2)  # the step its metrics carry
    # It stops at its env-step budget (already spent) long before num_iterations, with a final checkpoint.
    result = run(
        None,
        ["train_config.num_iterations=100", "train_config.max_env_steps=1"],
        resume=str(tmp_path / "e2e"),
        progress=False,
    )
    assert result["status"] == "completed" and result["iteration"] == 3
    assert [i for i, _ in ckpt.list_checkpoints(tmp_path / "e2e" / "checkpoints")] == [2, 3]
    records = [json.loads(line) for line in (tmp_path / "e2e" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "trainer/iteration" in r]
    assert [r["trainer/iteration"] for r in train] == [1, 2, 3]  # one record per iteration: 4 was dropped, 3 retrained
    steps = [r["step"] for r in records]
    assert steps == sorted(steps)  # one env-step axis: the resumed run continues it, never restarts at 0
    # The resumed iteration may be logged before a worker's first report of the new process: never below.
    assert train[2]["step"] >= steps_at_2
