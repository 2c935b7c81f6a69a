"""After training: a checkpoint holds the resolved config and is enough to load and evaluate its policy.

Checkpoints here are written by the real trainer (``api._trainer`` + ``save_checkpoint``) from real
configs, without Ray: what ``mineonline run`` writes, minus the rollout.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import imageio_ffmpeg
import numpy as np
import pytest
import torch
import yaml

from mineonline_core.driver import api
from mineonline_core.config import load_config
from mineonline_core.errors import CheckpointError, ConfigError
from mineonline_core.driver.evaluate import evaluate, load_policy
from mineonline_core.registry import get_plugin_manager
from mineonline_core.driver.resolve import resolve

ROOT = Path(__file__).resolve().parents[1]

PY_CONFIG = """
import gymnasium as gym

from mineonline_core.contracts.envs import adapt_env
from mineonline_core.builtin.models import MLPPolicy


def env_generator():
    return adapt_env(gym.make("CartPole-v1", max_episode_steps=30))


def policy_generator():
    return MLPPolicy(obs_dim=4, num_actions=2, hidden_sizes=[16])


online_dict = {"train_config": {"learning_rate": 1e-3, "num_iterations": 5}, "logger_config": {"loggers": []},
               "rollout_config": {"replay_buffer_config": {"database_config": {"backend": "memory"}}}}
"""


def write_checkpoint(source, overrides, output_dir: Path, *, iteration: int = 3) -> Path:
    """What a run's trainer writes at ``iteration``: resolved config, source text, trained-looking weights."""
    resolved = resolve(load_config(source, [*overrides, f"output_dir={output_dir}"]), get_plugin_manager())
    api._prepare_run_dir(resolved)
    trainer = api._trainer(resolved, manager=None, hub=None)
    trainer.setup_rank(local=True)
    with torch.no_grad():
        for p in trainer.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))  # weights unlike a freshly built policy's
    trainer.iteration, trainer.version = iteration, iteration - 1
    return trainer.save_checkpoint()


def test_checkpoint_config_is_resolved_with_overrides(tmp_path: Path) -> None:
    path = write_checkpoint(
        ROOT / "examples" / "cartpole.yaml", ["run_name=lr", "train_config.learning_rate=0.5"], tmp_path
    )
    saved = yaml.safe_load((path / "config.yaml").read_text())
    assert saved["train_config"]["learning_rate"] == 0.5  # the override, not the file's 1.0e-3
    assert saved["rollout_config"]["worker_config"]["step_timeout"] == 60.0  # defaults included
    assert load_config(saved).config.to_dict() == saved  # it validates as it is
    assert "learning_rate: 1.0e-3" in (path / "source_config.txt").read_text()  # the file as written, beside it


def test_python_config_generators_are_named_and_survive_the_file(tmp_path: Path) -> None:
    config = tmp_path / "my_config.py"
    config.write_text(PY_CONFIG)
    path = write_checkpoint(config, ["run_name=py"], tmp_path / "runs")
    saved = yaml.safe_load((path / "config.yaml").read_text())
    assert (
        saved["policy_generator"] == f"{config}:policy_generator"
        and saved["env_generator"] == f"{config}:env_generator"
    )
    weights = torch.load(path / "model.pt", weights_only=True)
    config.unlink()  # the original file is gone: the checkpoint's copy of its text rebuilds the generators
    policy = load_policy(path)
    assert all(torch.equal(policy.policy.state_dict()[k], v) for k, v in weights.items())
    assert policy.iteration == 3 and policy.version == 2


def test_act_follows_the_policy_and_carries_state(tmp_path: Path) -> None:
    path = write_checkpoint(ROOT / "examples" / "cartpole.yaml", ["run_name=act"], tmp_path)
    policy = load_policy(tmp_path / "act")  # a run directory: its latest checkpoint
    assert policy.checkpoint == path
    env = policy.make_env()
    obs, _ = env.reset(seed=1)
    action, state = policy.act(obs, deterministic=True)
    logits = policy.policy(
        input={"obs": torch.as_tensor(obs["obs"])[None, None]},
        state_in=None,
        context={"first": torch.ones(1, 1, dtype=torch.bool)},
    )[0]["pi_logits"]
    assert int(action) == int(logits.argmax(-1))
    assert env.action_space.contains(np.int64(action))
    obs, *_ = env.step(action)
    action, state = policy.act(obs, state)
    assert env.action_space.contains(np.int64(action))


def test_recurrent_act_resets_only_at_episode_start(tmp_path: Path) -> None:
    config = {
        "env_config": {"name": "crafter", "length": 20},
        "policy_config": {"name": "cnn_gru", "hidden_size": 16, "channels": [4, 8, 8]},
        "logger_config": {"loggers": []},
        "run_name": "rec",
        "rollout_config": {"replay_buffer_config": {"database_config": {"backend": "memory"}}},
    }
    write_checkpoint(config, [], tmp_path)
    policy = load_policy(tmp_path / "rec")
    env = policy.make_env()
    obs, _ = env.reset()
    _, state0, _ = policy.step(obs)
    _, carried, value_carried = policy.step(obs, state0)
    _, _, value_fresh = policy.step(obs)
    assert not all(
        torch.equal(a, b)
        for a, b in zip(torch.utils._pytree.tree_leaves(state0), torch.utils._pytree.tree_leaves(carried))
    )
    assert value_carried != value_fresh  # the state passed back is used


def test_eval_command_writes_crafter_report_and_readable_videos(tmp_path: Path) -> None:
    config = {
        "env_config": {"name": "crafter", "length": 25},
        "policy_config": {"name": "cnn_gru", "hidden_size": 16, "channels": [4, 8, 8]},
        "logger_config": {"loggers": []},
        "run_name": "craft",
        "rollout_config": {"replay_buffer_config": {"database_config": {"backend": "memory"}}},
    }
    write_checkpoint(config, [], tmp_path)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mineonline_core.cli",
            "eval",
            str(tmp_path / "craft"),
            "--episodes",
            "2",
            "--video",
            "--no-progress",
            "env_config.length=15",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = tmp_path / "craft" / "eval" / "checkpoint_000003"
    result = json.loads((out / "eval.json").read_text())
    assert result["episodes"] == 2 and result["overrides"] == ["env_config.length=15"]
    assert [e["length"] for e in result["per_episode"]] == [15, 15]  # the override reached the env
    assert set(result["crafter"]["success_rates"]) >= {"collect_wood", "wake_up"} and result["crafter"]["score"] >= 0
    assert all("achievements" in e for e in result["per_episode"])
    reader = imageio_ffmpeg.read_frames(str(out / result["per_episode"][0]["video"]))
    width, height = next(reader)["size"]
    assert len(list(reader)) == 15 and min(width, height) >= 256  # Crafter's 64 px upscaled to be seen
    assert "2 episodes of" in done.stdout and "Crafter score" in done.stdout


def test_minestudio_reward_events_are_counted(tmp_path: Path) -> None:
    """MineStudio's real ``MinecraftSim`` (its callbacks and info) on the fake engine: a cow killed with
    a sword is counted as a ``kill_entity:cow`` event and paid by ``RewardsCallback``."""
    from minestudio.simulator import MinecraftSim
    from minestudio.simulator.callbacks import CommandsCallback, JudgeResetCallback, RewardsCallback, SummonMobsCallback

    from mineonline_core.contracts.envs import adapt_env
    from mineonline_core.services.episodes import run_episode, summarize
    from mineonline_core.testing.minecraft import fake_engine

    class Scripted:
        """Attacks at every step, looking straight ahead."""

        def step(self, obs, state, *, deterministic):
            return {"buttons": np.array([4]), "camera": np.array([60])}, state, 0.0

    callbacks = [
        JudgeResetCallback(4),
        SummonMobsCallback([{"name": "cow", "number": 1, "range_x": [0, 0], "range_z": [2, 2]}]),
        CommandsCallback(["/give @p minecraft:iron_sword 1"]),
        RewardsCallback(
            [{"event": "kill_entity", "objects": ["cow"], "reward": 1.0, "identity": "kill_cow", "max_reward_times": 5}]
        ),
    ]
    with fake_engine():
        env = adapt_env(MinecraftSim(obs_size=(32, 32), num_empty_frames=1, callbacks=callbacks))
    episode = run_episode(Scripted(), env, deterministic=False, seed=None, record=False)
    env.close()
    assert episode["return"] == 1.0 and episode["events"] == {"kill_entity:cow": 1.0}
    assert summarize([episode, {**episode, "events": {}}])["events_per_episode"] == {"kill_entity:cow": 0.5}


def test_bad_paths_and_configs_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        load_policy(tmp_path)
    path = write_checkpoint(ROOT / "examples" / "cartpole.yaml", ["run_name=bad"], tmp_path)
    with pytest.raises(ConfigError, match="env_config.idd"):
        load_policy(path, overrides=["env_config.idd=CartPole-v1"])
    with pytest.raises(ConfigError, match="at least one episode"):
        evaluate(path, episodes=0)
    copy = tmp_path / "moved"
    shutil.copytree(path, copy)
    (copy / "model.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="sha256"):
        load_policy(copy)


def test_eval_plays_as_evaluation_while_training_and_writes_beside_the_run(tmp_path: Path) -> None:
    """Unset, episodes, action choice and seeds are the run's evaluation's: the same returns as the
    Evaluator's for the same weights; a best checkpoint's results go under the run's eval/best/."""
    from mineonline_core.services.evaluator import Evaluator

    config = tmp_path / "cfg.py"
    config.write_text(PY_CONFIG)
    overrides = ["seed=7", "train_config.eval_episodes=3", "train_config.eval_deterministic=false"]
    checkpoint = write_checkpoint(str(config), [*overrides, "run_name=ev"], tmp_path)
    best = checkpoint.parent / "best" / checkpoint.name
    shutil.copytree(checkpoint, best)
    resolved = resolve(load_config(str(config), [*overrides, f"output_dir={tmp_path}"]), get_plugin_manager())
    evaluator = Evaluator(
        policy_generator=resolved.policy_generator, env_generator=resolved.env_generator, config=resolved.config
    )
    while_training = evaluator.evaluate(load_policy(best).policy.state_dict(), iteration=3, version=2, env_steps=0)
    result = evaluate(best, progress=False)
    assert result["episodes"] == 3 and result["deterministic"] is False and result["seed"] == 7 + 1_000_000
    assert result["return_mean"] == while_training["eval/return_mean"]
    assert result["return_std"] == while_training["eval/return_std"]
    assert Path(result["output"]) == (tmp_path / "ev" / "eval" / "best" / checkpoint.name).resolve()
    assert (Path(result["output"]) / "eval.json").is_file()


def test_predict_takes_raw_observations_batches_and_recurrent_state(tmp_path: Path) -> None:
    """As Stable-Baselines3's ``predict``: what ``gym.make`` returns, one or a batch, state in and out."""
    import gymnasium as gym

    write_checkpoint(ROOT / "examples" / "cartpole.yaml", ["run_name=pred"], tmp_path)
    policy = load_policy(tmp_path / "pred")
    env = gym.make("CartPole-v1")
    raw = np.stack([env.reset(seed=s)[0] for s in range(3)])  # float32 (3, 4), no dict
    action, _ = policy.act(raw[0], deterministic=True)
    assert env.action_space.contains(np.int64(action))
    actions, _ = policy.predict(raw, deterministic=True)
    assert actions.shape == (3,) and [int(a) for a in actions] == [
        int(policy.act(row, deterministic=True)[0]) for row in raw
    ]
    with pytest.raises(ConfigError, match=r"shape \(5,\); the policy takes \(4,\), or a batch of them \(N, 4\)"):
        policy.predict(np.zeros(5, np.float32))

    config = {
        "env_config": {"name": "crafter", "length": 20},
        "policy_config": {"name": "cnn_gru", "hidden_size": 16, "channels": [4, 8, 8]},
        "logger_config": {"loggers": []},
        "run_name": "predrec",
        "rollout_config": {"replay_buffer_config": {"database_config": {"backend": "memory"}}},
    }
    write_checkpoint(config, [], tmp_path)
    recurrent = load_policy(tmp_path / "predrec")
    frames = np.random.default_rng(0).integers(0, 256, (4, 2, 64, 64, 3), dtype=np.uint8)  # (T, N, H, W, C)
    starts = np.array([[True, True], [False, False], [False, True], [False, False]])
    batched, state = [], None
    for t in range(4):  # two envs stepped together; env 1 starts a new episode at t = 2
        actions, state = recurrent.predict(frames[t], state, episode_start=starts[t], deterministic=True)
        batched.append(actions)
    for env_index in range(2):  # each env alone, its state reset where its episode starts
        single = None
        for t in range(4):
            action, single = recurrent.act(
                frames[t, env_index], None if starts[t, env_index] else single, deterministic=True
            )
            assert int(action) == int(batched[t][env_index]), (t, env_index)
        # the state carried (batch-first [hidden]) is each env's own: reset where its episode started
        torch.testing.assert_close(state[0][env_index], single[0][0], rtol=1e-5, atol=1e-6)
