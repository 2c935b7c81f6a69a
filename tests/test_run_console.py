"""What ``mineonline run`` prints, as a user sees it: the real command in a subprocess with its own
local Ray cluster. A healthy run's console carries no Ray or library noise (it all goes to the run
directory's ``run.log``); a failing run ends with the root cause from the process where it happened."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mineonline_core.services.runlog import LOG_FILE, MARK, RunLog

# The noise of issue 16, seen on the console of healthy runs before: Ray Train's controller and
# placement-group cleaner, C++ log lines of actor processes, Ray's prefix of streamed actor output.
NOISE = (
    "PlacementGroupCleaner",
    "GetTimeoutError",
    "core_worker.cc",
    "TrainController",
    "pid=",
    "Traceback",
    "authentication_token_setup",
    "Started a local Ray instance",
)

CARTPOLE = """
run_name: {name}
output_dir: {out}
env_config: {{name: gymnasium, id: CartPole-v1}}
policy_config: {{name: mlp, hidden_sizes: [16]}}
rollout_config:
  num_rollout_workers: 1
  num_cpus_per_worker: 0.25
  fragment_length: 16
  worker_config: {{num_envs: 2, batch_size: 2}}
  replay_buffer_config: {{fragments_per_chunk: 1, database_config: {{backend: memory}}}}
train_config:
  num_workers: 1
  num_cpus_per_worker: 0.5
  num_iterations: 3
  batch_size_per_gpu: 2
  batches_per_iteration: 1
  gradient_accumulation: 1
  context_length: 16
logger_config: {{loggers: []}}
"""


def _mineonline(*args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "mineonline_core.cli", "run", *args, "--no-progress"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def test_healthy_run_prints_no_ray_noise(tmp_path):
    config = tmp_path / "cartpole.yaml"
    config.write_text(CARTPOLE.format(name="quiet", out=tmp_path / "runs"))
    # The Ray Train path: its controller is where most of the noise came from.
    proc = _mineonline(str(config), "train_config.use_ray_train=true", cwd=tmp_path)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-3000:]
    noisy = [line for line in console.splitlines() if any(marker in line for marker in NOISE)]
    assert noisy == [], noisy
    assert proc.stdout.strip().splitlines()[-1].startswith("run quiet completed")
    # The noise still exists; it is in the run's log file, with the driver's and Ray's messages.
    log = (tmp_path / "runs" / "quiet" / LOG_FILE).read_text()
    assert "Started a local Ray instance" in log
    assert "(TrainController pid=" in log


FAILING_CONFIG = '''
import gymnasium as gym


class BrokenEnv(gym.Wrapper):
    """Takes one step (the pre-Ray probe's), then fails at every step: the failure is a worker's."""

    steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps > 1:
            raise ValueError("level 42 has no spawn point")
        return super().step(action)


def env_generator():
    from mineonline_core.contracts.envs import DictObservation

    return DictObservation(BrokenEnv(gym.make("CartPole-v1")))


online_dict = {online}
'''


def test_failing_run_ends_with_the_root_cause(tmp_path):
    import yaml

    online = yaml.safe_load(CARTPOLE.format(name="broken", out=tmp_path / "runs"))
    online.pop("env_config")
    online["rollout_config"]["worker_config"]["max_env_restarts"] = 0
    config = tmp_path / "broken.py"
    config.write_text(textwrap.dedent(FAILING_CONFIG).format(online=repr(online)))
    proc = _mineonline(str(config), cwd=tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last == "root cause: ValueError: level 42 has no spawn point", proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr  # it is in run.log
    assert "level 42 has no spawn point" in (tmp_path / "runs" / "broken" / LOG_FILE).read_text()


class _Printer:
    def __init__(self) -> None:
        self.batches: list[dict] = []

    def __call__(self, data: dict) -> None:
        self.batches.append(data)


def test_actor_output_goes_to_the_file_and_marked_lines_to_the_console(tmp_path, capsys):
    batch = {
        "pid": 7,
        "actor_name": "RolloutManager",
        "lines": [
            f"{MARK}WARNING: rollout worker 0 restarted",
            "[2026-11-24 06:19:48 E 7 7] core_worker.cc:2465: constructor arguments",
        ],
    }
    for verbose in (False, True):
        printer = _Printer()
        with RunLog(tmp_path, verbose=verbose) as run_log:
            run_log._ray_printer = printer  # what attach_actor_output takes from Ray
            run_log._on_actor_output(batch)
            run_log._ray_printer = None
        err = capsys.readouterr().err
        if verbose:
            assert printer.batches == [batch] and err == ""  # Ray prints everything, as it would
        else:
            assert printer.batches == [] and err == "WARNING: rollout worker 0 restarted (RolloutManager)\n"
    log = (tmp_path / LOG_FILE).read_text()
    assert log.count("(RolloutManager pid=7) [2026-11-24 06:19:48 E 7 7] core_worker.cc") == 2


NAN_CONFIG = '''
import gymnasium as gym


class OneNaNReward(gym.Wrapper):
    """Its fifth step (a rollout worker's, after the pre-Ray probe's one) returns a NaN reward."""

    steps = 0

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        self.steps += 1
        return obs, float("nan") if self.steps == 5 else reward, terminated, truncated, info


def env_generator():
    from mineonline_core.contracts.envs import DictObservation

    return DictObservation(OneNaNReward(gym.make("CartPole-v1")))


online_dict = {online}
'''


def test_an_actors_warning_reaches_the_console_as_one_line(tmp_path):
    """A warning logged inside a rollout worker (an actor process of the local cluster, which runs no
    job-level setup hook) is printed once, marked with the actor, and the run still completes."""
    import yaml

    online = yaml.safe_load(CARTPOLE.format(name="nan", out=tmp_path / "runs"))
    online.pop("env_config")
    online["rollout_config"]["worker_config"]["num_envs"] = online["rollout_config"]["worker_config"]["batch_size"] = 1
    config = tmp_path / "nan.py"
    config.write_text(textwrap.dedent(NAN_CONFIG).format(online=repr(online)))
    proc = _mineonline(str(config), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "the step counts as failed" in line]
    assert (
        len(warnings) == 1
        and warnings[0].startswith("WARNING: worker 0 env 0: ")
        and warnings[0].endswith("(RolloutWorker)")
    ), proc.stderr[-3000:]
    assert "reward" in warnings[0]


def test_a_user_error_raised_in_an_actor_is_said_once():
    """A mineonline error crossing an actor (a damaged replay store, issue 28) is the console's
    message and its root cause at once: said once, not repeated as a ``root cause:`` line."""
    import traceback

    from ray.exceptions import RayTaskError

    from mineonline_core.errors import MineOnlineError, find_user_error
    from mineonline_core.services.runlog import console_error

    message = "The replay store under database_config.path='/r' is damaged: remove '/r/shard-000'."
    try:
        raise MineOnlineError(message)  # as the store's StoreDamagedError, a MineOnlineError
    except MineOnlineError as exc:
        wrapped = RayTaskError("RolloutManager.health", traceback.format_exc(), exc).as_instanceof_cause()
    text = console_error(find_user_error(wrapped))
    assert text == message, text


@pytest.mark.parametrize("status, code", [("completed", 0), ("interrupted", 130), ("failed", 1)])
def test_the_exit_status_tells_a_stopped_run_from_a_finished_one(monkeypatch, status, code) -> None:
    """What `mineonline run` exits with for each outcome of the run (the fault tests signal real CLI runs)."""
    from mineonline_core import cli
    from mineonline_core.driver import api

    monkeypatch.setattr(api, "run", lambda *args, **kwargs: {"status": status})
    assert cli.main(["run", "config.yaml", "--no-progress"]) == code


def test_quiet_prints_the_last_line_alone(tmp_path) -> None:
    """`--quiet`: no progress lines, no summary table: warnings (a loaded machine may give some), errors and
    the run's last line."""
    config = tmp_path / "cartpole.yaml"
    config.write_text(CARTPOLE.format(name="hush", out=tmp_path / "runs"))
    proc = _mineonline(str(config), "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    # Warnings go to stderr, so a loaded machine's "waited 30s" line may follow the last line of stdout.
    assert proc.stdout.strip().splitlines()[-1] == f"run hush completed: {tmp_path / 'runs' / 'hush'}"
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert not [line for line in lines if "elapsed" in line or "│" in line or "ETA" in line], lines
    # A run shorter than a few report intervals still ends on its rollout rate, not 0: the rollout side's
    # last report (after its workers stopped) carries the run's mean.
    records = (tmp_path / "runs" / "hush" / "metrics.jsonl").read_text().splitlines()
    last = [r for r in map(json.loads, records) if "rollout/worker_restarts" in r][-1]
    assert last.get("rollout/env_steps_per_s", 0) > 0 and last["rollout/env_steps"] > 0, last
    summary = json.loads((tmp_path / "runs" / "hush" / "summary.json").read_text())
    assert summary["rollout/env_steps_per_s"] == last["rollout/env_steps_per_s"]


@pytest.mark.parametrize("quiet", [True, False])
def test_quiet_leaves_out_the_summary_table_and_the_progress(tmp_path, monkeypatch, capsys, quiet: bool) -> None:
    """What the driver prints around the run (``api.run``, every check before Ray included) with and without
    ``quiet``; the run itself (Ray, actors, training) stands in as its outcome, a completed run's summary.
    The real quiet run is ``test_quiet_prints_the_last_line_alone``."""
    import yaml

    from mineonline_core.driver import api

    launched: list[bool | None] = []

    def launch(resolved, pm, run_dir, *, progress, **_) -> tuple[str, dict]:
        launched.append(progress)
        return "completed", {"summary": {"env_steps": 4096, "episode/return_mean": 21.5, "trainer/iteration": 3}}

    monkeypatch.setattr(api, "_launch", launch)
    config = yaml.safe_load(CARTPOLE.format(name="hush", out=tmp_path / "runs"))
    result = api.run(config, progress=False, quiet=quiet)
    out = capsys.readouterr().out
    assert result["status"] == "completed" and launched == [None if quiet else False]
    last = f"run hush completed: {tmp_path / 'runs' / 'hush'}"
    if quiet:
        assert out.strip().splitlines() == [last], out
    else:
        assert "return_mean" in out and "21.5" in out and out.strip().splitlines()[-1] == last, out


@pytest.mark.parametrize("progress", [None, False])
def test_the_watch_loop_prints_plain_progress_lines_and_none_when_quiet(local_ray, tmp_path, capsys, progress) -> None:
    """The driver's watch loop (``training.train_with_progress``, real logging actor): ``--no-progress``
    (``progress=False``) prints plain lines, ``--quiet`` (``None``, what ``run`` passes) prints none."""
    from mineonline_core.driver.training import train_with_progress
    from tests.faults.test_driver_faults import BlockingTrainer, _actors, _config

    run = "watch-quiet" if progress is None else "watch-plain"
    hub, manager = _actors(local_ray, run, tmp_path)
    trainer = BlockingTrainer()
    trainer.release.set()  # one pass of the loop: a line, then the last one as the display closes
    result = train_with_progress(trainer, manager, hub, _config(run), progress=progress)
    out = capsys.readouterr().out
    assert result["status"] == "completed"
    if progress is None:
        assert out == "", out
    else:
        assert out.splitlines() and all(line.startswith("iter ") and "elapsed" in line for line in out.splitlines())
