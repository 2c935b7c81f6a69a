"""The REINFORCE example (a Config and a loss, no loop code) on the core's loop with DDP: 2 Ray Train
ranks with gradient accumulation make the same update as 1 rank on the same global batch, and with
``use_amp`` they train too. The example is not installed: its directory is put on the rank processes'
path the way a user's own package would be installed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray
import torch

from mineonline_core.driver.localcluster import start_local_cluster
from mineonline_core.testing.kit import cartpole, chunks_of, ddp_fit, ddp_train_step, mlp_policy, rollout_fragments
from mineonline_core.trainer.batch import assemble_chunks, estimate_advantages

EXAMPLE_DIR = Path(__file__).resolve().parents[1] / "examples" / "custom_trainer"
TRAINER = "mineonline_reinforce:ReinforceTrainer"
COMMON = {
    "learning_rate": 1e-2,
    "adam_eps": 1.0,
    "max_grad_norm": 0.5,
    "batches_per_iteration": 2,
    "gradient_accumulation": 2,
    "context_length": 4,
    "epochs_per_iteration": 2,
    "entropy_coef": 0.01,
}


@pytest.fixture(scope="module")
def ray_with_example():
    previous = os.environ.get("PYTHONPATH")
    # A local cluster's processes inherit the driver's environment (driver/api.py, init_ray).
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXAMPLE_DIR), previous]))
    start_local_cluster(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()
    if previous is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = previous


def test_reinforce_example_trains_with_ddp_accumulation_and_amp(tmp_path, ray_with_example, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE_DIR))
    torch.manual_seed(0)
    policy = mlp_policy()
    streams = rollout_fragments(policy, lambda i: cartpole(12), num_envs=4, fragment_length=8, fragments_per_env=2)
    batch = estimate_advantages(
        policy, assemble_chunks(chunks_of(streams, 1)), version=0, context_length=8, discount=0.9, gae_lambda=0.95
    )
    batch_path = tmp_path / "batch.pt"
    torch.save(batch, batch_path)

    def online(per_rank: int, amp: bool = False) -> dict:
        return {
            "trainer_name": "ReinforceTrainer",
            "train_config": {**COMMON, "batch_size_per_gpu": per_rank, "use_amp": amp},
        }

    ddp_train_step(
        {
            "trainer_cls": TRAINER,
            "online": online(4),
            "batch_path": str(batch_path),
            "out_path": str(tmp_path / "one.pt"),
            "run_dir": str(tmp_path),
            "local": True,
        }
    )
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    two, _ = ddp_fit(
        trainer_cls=TRAINER, online=online(2), batch_path=str(batch_path), run_dir=str(tmp_path), tag="two"
    )
    initial = mlp_policy().state_dict()
    assert not torch.equal(one["actor.0.weight"], initial["actor.0.weight"])  # it did train
    for name in one:
        assert torch.allclose(one[name], two[name], atol=1e-6), (name, (one[name] - two[name]).abs().max())
    amp, _ = ddp_fit(
        trainer_cls=TRAINER, online=online(2, amp=True), batch_path=str(batch_path), run_dir=str(tmp_path), tag="amp"
    )
    assert all(torch.isfinite(v).all() for v in amp.values())
    assert not torch.equal(amp["actor.0.weight"], initial["actor.0.weight"])
