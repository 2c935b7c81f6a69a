"""Stop criteria and the best checkpoint: max_env_steps, stop_at_return (a full window's mean), keep_best."""

from __future__ import annotations

import json

import pytest

from mineonline_core.config import OnlineConfig, load_config
from mineonline_core.driver.evaluate import load_policy
from mineonline_core.errors import ConfigError
from mineonline_core.trainer import checkpoint as ckpt
from mineonline_core.trainer.goals import Goals


def goals(**train) -> Goals:
    return Goals(OnlineConfig(train_config=train, rollout_config={"episode_statistics_config": {"window": 4}}))


def test_env_step_budget() -> None:
    g = goals(max_env_steps=1000)
    assert g.stop_reason({"env_steps": 999.0}) is None
    assert "max_env_steps=1000 reached (1000 env steps)" in g.stop_reason({"env_steps": 1000.0})


def test_target_return_needs_a_full_window() -> None:
    g = goals(stop_at_return=200.0)
    assert g.stop_reason({"episode/return_mean": 500.0, "episode/count": 3.0}) is None  # 3 lucky episodes of 4
    assert g.stop_reason({"episode/return_mean": 199.0, "episode/count": 40.0}) is None
    assert "stop_at_return=200 reached" in g.stop_reason({"episode/return_mean": 200.0, "episode/count": 4.0})
    assert goals().stop_reason({"episode/return_mean": 1e9, "episode/count": 1e9, "env_steps": 1e12}) is None


def test_best_improves_only_on_a_higher_full_window() -> None:
    g = goals(keep_best=True)
    assert g.improved({"episode/return_mean": 9.0, "episode/count": 2.0}) is None
    assert g.improved({"episode/return_mean": 5.0, "episode/count": 4.0}) == 5.0
    assert g.improved({"episode/return_mean": 4.0, "episode/count": 8.0}) is None
    assert g.improved({"episode/return_mean": 6.0, "episode/count": 9.0}) == 6.0
    assert goals(keep_best=False).improved({"episode/return_mean": 6.0, "episode/count": 9.0}) is None


def test_keep_best_writes_one_loadable_checkpoint_and_survives_resume(tmp_path) -> None:
    from mineonline_ppo import PPOTrainer

    from mineonline_core.testing.kit import local_loop

    def trainer(**train):
        config = OnlineConfig(
            train_config={"keep_best": True, "save_path": "ckpt", "keep_interval": 1, **train},
            rollout_config={"episode_statistics_config": {"window": 2}},
            env_config={"name": "gymnasium", "id": "CartPole-v1"},
            policy_config={"name": "mlp", "hidden_sizes": [32, 32]},
        )
        t = local_loop(PPOTrainer, config, run_dir=str(tmp_path))
        return t

    t = trainer()
    for iteration, value in ((1, 3.0), (2, 7.0), (3, 5.0)):
        t.iteration = iteration
        t.save_checkpoint()
        t._judge_goals({"episode/return_mean": value, "episode/count": 10.0})
    best_root = tmp_path / "ckpt" / "best"
    assert [path.name for _, path in ckpt.list_checkpoints(best_root)] == ["checkpoint_000002"]
    assert json.loads((best_root / "best.json").read_text())["episode/return_mean"] == 7.0
    assert [i for i, _ in ckpt.list_checkpoints(tmp_path / "ckpt")] == [1, 2, 3]  # regular ones untouched
    resumed = trainer(resume=str(tmp_path / "ckpt" / "checkpoint_000003"))
    assert resumed.goals.best_return == 7.0  # a resumed run does not take a worse return for its best
    resumed._judge_goals({"episode/return_mean": 6.0, "episode/count": 10.0})
    assert json.loads((best_root / "best.json").read_text())["iteration"] == 2
    assert load_policy(best_root).iteration == 2


def test_bad_values_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="max_env_steps"):
        load_config({"train_config": {"max_env_steps": 0}})
    with pytest.raises(ConfigError, match="stop_at_return"):
        load_config({"train_config": {"stop_at_return": "high"}})
