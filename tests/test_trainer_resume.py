"""Resume continuity: a run resumed from a checkpoint continues at the next iteration with the same
iteration, version, rho and learning-rate sequences, and the same parameters, as an uninterrupted run."""

from __future__ import annotations

import copy

import pytest
import torch

from mineonline_core.config import OnlineConfig
from mineonline_core.errors import CheckpointError
from mineonline_core.trainer import checkpoint as ckpt
from mineonline_core.testing.kit import cartpole, chunks_of, mlp_policy, rollout_fragments
from mineonline_core.trainer.batch import assemble_chunks, estimate_advantages
from mineonline_ppo import PPOTrainer
from mineonline_core.trainer.loop import TrainLoop


class _Remote:
    def __init__(self, sink: list) -> None:
        self.sink = sink

    def remote(self, *args, **kwargs):
        self.sink.append(args)


class RecordingManager:
    """Stands in for the RolloutManager handle: records weight broadcasts and video requests."""

    def __init__(self) -> None:
        self.broadcasts: list = []
        self.update_weights = _Remote(self.broadcasts)
        self.record_videos = _Remote([])


class FixedDataPPO(TrainLoop):
    """The loop around PPO, whose fetch returns the same chunks every iteration (advantages from the current model)."""

    chunks: list = []

    def _put_weights(self, weights):
        return weights  # no Ray here: the recording manager takes the state dict itself

    def fetch_fragments_and_estimate_advantages(self, num_chunks: int) -> dict:
        batch = assemble_chunks(copy.deepcopy(self.chunks[:num_chunks]))
        return estimate_advantages(
            self.model, batch, version=self.version, context_length=8, discount=0.9, gae_lambda=0.95
        )


@pytest.fixture(scope="module")
def chunks():
    streams = rollout_fragments(
        mlp_policy(), lambda i: cartpole(12), num_envs=4, fragment_length=8, fragments_per_env=1
    )
    return chunks_of(streams, 1)


def make(tmp_path, chunks, **train):
    train = {
        "num_iterations": 6,
        "vf_warmup": 1,
        "save_interval": 2,
        "keep_interval": 4,
        "batches_per_iteration": 2,
        "batch_size_per_gpu": 2,
        "gradient_accumulation": 1,
        "context_length": 8,
        "learning_rate": 1e-2,
        "anneal_lr_linearly": True,
        "kl_divergence_coef_rho": 0.3,
        "coef_rho_decay": 0.9,
        "save_path": "ckpt",
        "record_video_interval": 0,
        **train,
    }
    FixedDataPPO.chunks = chunks
    manager = RecordingManager()
    trainer = FixedDataPPO(
        algorithm=PPOTrainer,
        rollout_manager=manager,
        policy_generator=mlp_policy,
        env_generator=None,
        config=OnlineConfig(train_config=train),
        run_dir=str(tmp_path),
    )
    trainer.preflight()
    trainer.setup_rank(local=True)
    return trainer, manager


def run(trainer):
    seq = []
    for iteration in range(trainer.iteration + 1, trainer.train_config.num_iterations + 1):
        metrics = trainer.run_iteration(iteration)
        seq.append(
            (
                metrics["trainer/iteration"],
                metrics["trainer/version"],
                metrics["trainer/rho"],
                metrics["trainer/learning_rate"],
            )
        )
    trainer.flush_broadcast()  # as _train_func ends: the broadcast thread has sent the last version
    return seq


def test_resume_continues_every_sequence(tmp_path, chunks):
    full, manager = make(tmp_path / "a", chunks)
    seq = run(full)
    assert [s[0] for s in seq] == [1, 2, 3, 4, 5, 6]
    assert [s[1] for s in seq] == [0, 1, 2, 3, 4, 5]  # iteration 1 is value-only warm-up: no new version
    assert [v for _, v in manager.broadcasts] == [1, 2, 3, 4, 5]  # (the initial publish is _train_func's)
    assert set(manager.broadcasts[-1][0][0]) == set(full.policy.state_dict())
    assert seq[2][2] == pytest.approx(0.3 * 0.9**2) and seq[2][3] == pytest.approx(1e-2 * (1 - 2 / 6))
    assert [i for i, _ in ckpt.list_checkpoints(tmp_path / "a" / "ckpt")] == [4, 6]

    resumed, manager = make(tmp_path / "b", chunks, resume=str(tmp_path / "a" / "ckpt" / "checkpoint_000004"))
    assert (resumed.iteration, resumed.version) == (4, 3)
    assert run(resumed) == seq[4:]
    assert [v for _, v in manager.broadcasts] == [4, 5]
    assert not __import__("ray").is_initialized()
    for (name, a), (_, b) in zip(full.policy.state_dict().items(), resumed.policy.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert resumed.optimizer.state_dict()["state"][0]["step"] == full.optimizer.state_dict()["state"][0]["step"]


def test_bad_resume_fails_before_training(tmp_path, chunks):
    with pytest.raises(CheckpointError, match="does not exist"):
        make(tmp_path, chunks, resume=str(tmp_path / "missing"))
    full, _ = make(tmp_path / "a", chunks, num_iterations=2)
    run(full)
    with pytest.raises(CheckpointError, match="mis-shaped keys"):
        FixedDataPPO(
            algorithm=PPOTrainer,
            rollout_manager=None,
            policy_generator=lambda: mlp_policy(hidden=8),
            env_generator=None,
            config=OnlineConfig(train_config={"resume": str(tmp_path / "a" / "ckpt")}),
            run_dir=str(tmp_path),
        ).preflight()


def test_resume_applies_the_configs_optimiser_settings(tmp_path, chunks):
    """B5: the loaded optimiser state carries the checkpoint's hyperparameters; the config's win."""
    full, _ = make(tmp_path / "a", chunks, num_iterations=2, weight_decay=0.04, adam_eps=1e-8)
    run(full)
    resumed, _ = make(
        tmp_path / "b",
        chunks,
        num_iterations=4,
        resume=str(tmp_path / "a" / "ckpt"),
        weight_decay=0.1,
        adam_eps=1e-5,
        learning_rate=3e-3,
        anneal_lr_linearly=False,
    )
    (group,) = resumed.optimizer.param_groups
    assert (group["weight_decay"], group["eps"], group["lr"]) == (0.1, 1e-5, 3e-3)
    assert resumed.optimizer.state_dict()["state"][0]["step"] == full.optimizer.state_dict()["state"][0]["step"]
