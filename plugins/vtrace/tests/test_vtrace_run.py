"""A short CartPole run through the whole loop (real Ray, rollout worker, memory store) with
``trainer_name: VTraceTrainer`` and rollout allowed to run four versions ahead."""

from __future__ import annotations

import json
import math

import pytest
import ray

from mineonline_core.driver.api import run
from mineonline_core.driver.localcluster import start_local_cluster

CONFIG = {
    "run_name": "vtrace",
    "trainer_name": "VTraceTrainer",
    "env_config": {"name": "gymnasium", "id": "CartPole-v1"},
    "policy_config": {"name": "mlp", "hidden_sizes": [32, 32]},
    "rollout_config": {
        "num_rollout_workers": 1,
        "num_cpus_per_worker": 0.5,
        "fragment_length": 32,
        "worker_config": {"num_envs": 2, "batch_size": 2},
        "replay_buffer_config": {
            "fragments_per_chunk": 2,
            "max_staleness": 4,
            "max_reuse": 1,
            "database_config": {"backend": "memory"},
        },
    },
    "train_config": {
        "num_workers": 1,
        "num_iterations": 6,
        "batch_size_per_gpu": 2,
        "batches_per_iteration": 2,
        "gradient_accumulation": 1,
        "context_length": 16,
        "save_interval": 3,
        "record_video_interval": 0,
        "learning_rate": 1e-3,
        "discount": 0.99,
        "rho_bar": 1.0,
        "c_bar": 1.0,
        "entropy_bonus_coef": 0.01,  # V-trace keys
    },
    "logger_config": {"loggers": []},
}


@pytest.fixture
def ray_local(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    start_local_cluster(num_cpus=2, include_dashboard=False, namespace="mineonline", log_to_driver=False)
    yield
    ray.shutdown()


def test_cartpole_iterations_through_the_real_loop(tmp_path, ray_local):
    result = run({**CONFIG, "output_dir": str(tmp_path)}, progress=False)
    assert result["status"] == "completed"
    records = [json.loads(line) for line in (tmp_path / "vtrace" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "trainer/iteration" in r]
    assert [r["trainer/iteration"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["trainer/version"] for r in train] == [1, 2, 3, 4, 5, 6]
    for r in train:
        assert all(math.isfinite(r[f"trainer/{k}"]) for k in ("policy_loss", "value_loss", "entropy", "grad_norm"))
        assert 0 < r["trainer/vtrace_rho_mean"] <= 1 and 0 <= r["trainer/staleness_mean"] <= 4
    assert result["summary"]["rollout/env_steps"] > 0
