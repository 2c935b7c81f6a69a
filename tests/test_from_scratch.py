"""Issue 35 item 8: a minimal config (an env and ``policy_config: {name: mlp}``) trains from scratch with
PPO's control-task defaults and learns CartPole; a fine-tuning config (MineStudio's ``online_dict`` with
its ``policy_generator``, or pretrained weights named) keeps MineStudio's defaults.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from mineonline_core.config import load_config
from mineonline_core.config.scratch import FROM_SCRATCH

ROOT = Path(__file__).resolve().parents[1]
MINIMAL = {"env_config": {"name": "gymnasium", "id": "CartPole-v1"}, "policy_config": {"name": "mlp"}}


def test_a_minimal_config_gets_from_scratch_defaults_and_the_users_keys_win() -> None:
    loaded = load_config(MINIMAL)
    cfg = loaded.config
    assert cfg.train_config.learning_rate == 3e-4 and cfg.train_config.discount == 0.99
    assert cfg.train_config.num_iterations == 300 and cfg.logger_config.loggers == []
    assert cfg.rollout_config.replay_buffer_config.database_config.backend == "memory"
    assert loaded.from_scratch.startswith("from-scratch defaults: train_config.learning_rate=0.0003")
    # A key the user sets keeps its value, and its group is not filled around it.
    mine = load_config(MINIMAL, ["train_config.gradient_accumulation=5", "train_config.discount=0.9"]).config
    assert mine.train_config.discount == 0.9 and mine.train_config.gradient_accumulation == 5
    assert mine.train_config.batches_per_iteration == 10  # the fine-tuning default, a multiple of 5
    assert mine.train_config.learning_rate == 3e-4  # other groups are filled
    # Saved and read back: every key explicit, nothing filled twice.
    again = load_config(yaml.safe_load(cfg.to_yaml()))
    assert again.from_scratch is None and again.config.to_dict() == cfg.to_dict()


def test_fine_tuning_configs_keep_minestudios_defaults(tmp_path: Path) -> None:
    defaults = load_config({}).config.to_dict()
    pretrained = {**MINIMAL, "policy_config": {"name": "vpt", "weights_path": "foundation-model-1x.weights"}}
    generator = {**MINIMAL, "policy_config": None, "policy_generator": "my_config:policy_generator"}
    for data in (pretrained, generator):
        loaded = load_config(data)
        assert loaded.from_scratch is None
        got = loaded.config.to_dict()
        for _, keys in FROM_SCRATCH:
            for path in keys:
                want, have = defaults, got
                for key in path:
                    want, have = want[key], have[key]
                assert have == want, path


def test_a_minimal_config_learns_cartpole_from_the_command_line(tmp_path: Path) -> None:
    (tmp_path / "minimal.yaml").write_text(yaml.safe_dump(MINIMAL))
    done = subprocess.run(
        [sys.executable, "-m", "mineonline_core.cli", "run", "minimal.yaml", "run_name=scratch", "--no-progress"]
        # A short budget: the run ends once the last 100 episodes average 100 (random play: about 22).
        + ["train_config.num_iterations=80", "train_config.stop_at_return=100"],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "from-scratch defaults: train_config.learning_rate=0.0003, train_config.discount=0.99," in output
    summary = json.loads((tmp_path / "runs" / "scratch" / "summary.json").read_text())
    assert summary["episode/return_mean"] >= 100, summary["episode/return_mean"]
    config = yaml.safe_load((tmp_path / "runs" / "scratch" / "config.yaml").read_text())
    assert config["train_config"]["learning_rate"] == 3e-4 and config["logger_config"]["loggers"] == []


def test_the_first_line_comes_before_anything_slow(tmp_path: Path) -> None:
    """A cold run is silent for most of a minute while torch and Ray load; its first line comes at once. Here
    the config fails its checks (an unknown trainer), so neither Ray nor a run starts, and the line is there."""
    (tmp_path / "minimal.yaml").write_text(yaml.safe_dump({**MINIMAL, "trainer_name": "SACTrainer"}))
    done = subprocess.run(
        [sys.executable, "-m", "mineonline_core.cli", "run", "minimal.yaml"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout.splitlines()[0].startswith("mineonline run: checking the config, then starting a local Ray")
    assert "SACTrainer" in done.stderr and "A2CTrainer" not in done.stderr  # no suggestion of an unrelated name


def test_the_defaults_filled_in_are_shown_at_start_and_not_in_the_quiet_mode(tmp_path: Path, capsys) -> None:
    """The from-scratch defaults are printed as the run starts, before its later checks and Ray: here an
    unknown trainer then stops it (exit 2). ``--quiet`` leaves them out (its one line is the last).
    The whole run that learns with them is ``test_a_minimal_config_learns_cartpole_from_the_command_line``."""
    from mineonline_core.cli import main

    (tmp_path / "minimal.yaml").write_text(yaml.safe_dump({**MINIMAL, "trainer_name": "SACTrainer"}))
    config = str(tmp_path / "minimal.yaml")
    assert main(["run", config, f"output_dir={tmp_path / 'runs'}", "--no-progress"]) == 2
    shown = capsys.readouterr()
    assert "from-scratch defaults: train_config.learning_rate=0.0003, train_config.discount=0.99," in shown.out
    assert "SACTrainer" in shown.err
    assert main(["run", config, f"output_dir={tmp_path / 'runs'}", "--quiet"]) == 2
    assert "from-scratch defaults" not in capsys.readouterr().out
    assert not (tmp_path / "runs").exists()
