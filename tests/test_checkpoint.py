"""Checkpoints: atomic layout, retention, verification errors, weights-only loading, RNG round trip."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from mineonline_core.errors import CheckpointError, ConfigError
from mineonline_core.trainer import checkpoint as ckpt
from mineonline_core.testing.kit import mlp_policy


def _save(root: Path, iteration: int, policy=None, keep: int | None = None) -> Path:
    policy = policy or mlp_policy()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    policy(input={"obs": torch.zeros(1, 1, 4)}, state_in=None, context={"first": torch.ones(1, 1, dtype=torch.bool)})[
        0
    ]["vpred"].sum().backward()
    opt.step()
    return ckpt.save_checkpoint(
        root,
        iteration=iteration,
        model_state=policy.state_dict(),
        optimizer_state=opt.state_dict(),
        scaler_state={},
        trainer_state={"version": iteration + 3, "rho": 0.5, "learning_rate": 1e-3, "extra": {}},
        config_yaml="train_config:\n  save_interval: 10\n",
        keep_interval=keep,
    )


def test_layout_manifest_and_weights_only_load(tmp_path):
    path = _save(tmp_path, 7)
    assert path.name == "checkpoint_000007"
    assert sorted(p.name for p in path.iterdir()) == [
        "config.yaml",
        "manifest.json",
        "model.pt",
        "optimizer.pt",
        "scaler.pt",
        "trainer.pt",
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"config.yaml", "model.pt", "optimizer.pt", "scaler.pt", "trainer.pt"}
    for name in ("model.pt", "optimizer.pt", "trainer.pt"):
        torch.load(path / name, weights_only=True)  # no pickled code anywhere
    state = ckpt.load_checkpoint(path)
    assert state["trainer"]["iteration"] == 7 and state["trainer"]["version"] == 10
    assert "value_head.normalizer.running_mean" in state["model"]
    assert state["optimizer"]["state"]  # Adam moments present
    assert ckpt.latest_checkpoint(tmp_path) == path


def test_retention_keeps_multiples_of_keep_interval_and_the_latest(tmp_path):
    policy = mlp_policy()
    for iteration in range(10, 101, 10):
        _save(tmp_path, iteration, policy, keep=40)
    assert [i for i, _ in ckpt.list_checkpoints(tmp_path)] == [40, 80, 100]
    for iteration in (110, 120):
        _save(tmp_path, iteration, policy, keep=40)
    assert [i for i, _ in ckpt.list_checkpoints(tmp_path)] == [40, 80, 120]


def test_interrupted_write_is_invisible(tmp_path):
    _save(tmp_path, 10)
    (tmp_path / ".checkpoint_000020.tmp-1").mkdir()  # a crash mid-write leaves only a hidden temp dir
    (tmp_path / "checkpoint_000030").mkdir()  # a directory without manifest is not a checkpoint
    assert ckpt.latest_checkpoint(tmp_path).name == "checkpoint_000010"
    assert ckpt.resolve_resume(tmp_path).name == "checkpoint_000010"


def test_missing_truncated_corrupted_incompatible(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt.load_checkpoint(tmp_path / "nope")
    path = _save(tmp_path, 10)
    model = path / "model.pt"
    data = model.read_bytes()
    model.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="sha256"):
        ckpt.load_checkpoint(path)
    model.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="sha256"):
        ckpt.load_checkpoint(path)
    model.write_bytes(data)
    (path / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match="optimizer.pt is missing"):
        ckpt.load_checkpoint(path)
    path = _save(tmp_path, 20)
    state = ckpt.load_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"mis-shaped keys: actor.0.weight"):
        ckpt.check_compatible(mlp_policy(hidden=16), state["model"], source=str(path))
    other = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="missing keys"):
        ckpt.check_compatible(other, state["model"], source=str(path))


def test_unwritable_save_path_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="train_config.save_path"):
        ckpt.check_writable(blocker / "checkpoints")


def test_rng_state_round_trip(tmp_path):
    path = _save(tmp_path, 1)
    state = ckpt.load_checkpoint(path)["trainer"]["rng"]
    ckpt.set_rng_state(state)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    ckpt.set_rng_state(state)
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]


def test_fit_rejects_unwritable_save_path_before_ray(tmp_path):
    from mineonline_core.config import OnlineConfig
    from mineonline_core.trainer import BaseTrainer

    blocker = tmp_path / "file"
    blocker.write_text("x")
    config = OnlineConfig(train_config={"save_path": str(blocker / "ckpt")})
    trainer = BaseTrainer(
        rollout_manager=None, policy_generator=mlp_policy, env_generator=None, config=config, run_dir=str(tmp_path)
    )
    with pytest.raises(ConfigError, match="train_config.save_path"):
        trainer.fit()
    relative = BaseTrainer(
        rollout_manager=None,
        policy_generator=mlp_policy,
        env_generator=None,
        config=OnlineConfig(train_config={"save_path": "ck"}),
        run_dir=str(tmp_path),
    )
    assert relative.save_dir == tmp_path.resolve() / "ck"
