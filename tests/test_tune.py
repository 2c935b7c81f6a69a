"""``mineonline tune``: a sweep whose trials are real CartPole runs on a local Ray cluster of this machine.

The ASHA test is made deterministic by its metric: ``trainer/learning_rate`` (any logged metric is
accepted) ranks the trials by their learning rate, whatever the noise of short CartPole runs. Two trials
fit on the 2 CPUs at once (0.5 + 0.25 each), so both 1e-2 trials have reported every iteration before
a 1e-4 trial starts, and ASHA stops each 1e-4 trial at its first rung.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mineonline_core.cli import main
from mineonline_core.driver.tune import RESULTS_FILE

CARTPOLE = """
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
  num_iterations: {iterations}
  batch_size_per_gpu: 2
  batches_per_iteration: 1
  gradient_accumulation: 1
  context_length: 16
  anneal_lr_linearly: false
  save_interval: {save}
logger_config: {{loggers: []}}
"""


def _config(tmp_path: Path, *, iterations: int, save: int) -> Path:
    path = tmp_path / "cartpole.yaml"
    path.write_text(CARTPOLE.format(iterations=iterations, save=save))
    return path


def _table(exp_dir: Path) -> list[dict]:
    with (exp_dir / RESULTS_FILE).open() as handle:
        return list(csv.DictReader(handle))


def _iterations(run_dir: Path) -> list[int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [int(r["trainer/iteration"]) for r in records if "trainer/iteration" in r]


def bare_trial(run_dir: Path, metric: str = "trainer/learning_rate") -> Any:
    """A ``TrialRun`` as ``setup`` leaves it, without Tune's actor: its monitor, ``step`` and ``cleanup`` run as in a
    trial whose run directory is ``run_dir``."""
    import queue
    import threading

    from mineonline_core.driver.sweep import TrialSpec
    from mineonline_core.driver.trial import TrialRun

    spec = TrialSpec(
        source=None, fixed=(), keys=(), experiment="e", experiment_dir=str(run_dir.parent), metric=metric, cwd="."
    )
    trial = TrialRun.__new__(TrialRun)
    trial.spec, trial.name, trial.run_dir = spec, run_dir.name, run_dir
    trial._events, trial._stop, trial._thread, trial._restore_from = queue.Queue(), threading.Event(), None, None
    trial._reported, trial._offset, trial._running = 0.0, 0, {}
    return trial


def test_bad_search_space_fails_before_ray_starts(tmp_path, capsys):
    import ray

    config = _config(tmp_path, iterations=4, save=2)
    assert main(["tune", str(config), "train_config.learning_rate=logunifrom(1e-5,1e-3)"]) == 2
    assert "unknown function 'logunifrom'. Fix: write loguniform(...)" in capsys.readouterr().err
    assert main(["tune", str(config), "train_config.learning_rate=loguniform(0,1e-3)"]) == 2
    assert "loguniform needs a positive low bound" in capsys.readouterr().err
    # Every value of a grid is validated as a config: the bad one is named, with the key.
    assert main(["tune", str(config), "train_config.learning_rate=grid(1e-3,fast)"]) == 2
    err = capsys.readouterr().err
    assert "train_config.learning_rate" in err and "fast" in err
    assert main(["tune", str(config), "--seeds", "0,x"]) == 2
    assert "--seeds" in capsys.readouterr().err
    assert not ray.is_initialized()
    assert not (tmp_path / "runs").exists()


def test_an_interrupted_experiment_resumes(tmp_path):
    # Interrupted at its first checkpoint (iteration 2), far from its end; the resume trains the rest.
    config = _config(tmp_path, iterations=40, save=2)
    env = {**os.environ, "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "mineonline_core.cli", "tune", str(config), "--seeds", "0", "--name", "exp"]
    exp_dir = tmp_path / "runs" / "exp"
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # A hang guard: the first checkpoint came past 240 s beside the suite and two CPU burners.
        deadline = time.monotonic() + 600
        while not list(exp_dir.glob("exp-*/checkpoints/checkpoint_*/manifest.json")):
            assert proc.poll() is None, "the experiment ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 600 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # the tune process we started, by its pid
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    [row] = _table(exp_dir)
    assert row["status"] == "interrupted" and int(row["iterations"]) < 40, out[-3000:]
    assert proc.returncode == 130, out[-3000:]  # stopped, not finished
    assert f"Continue it with: mineonline tune --resume {exp_dir}" in out and "Tuner.restore" not in out, out[-3000:]
    stopped_at = int(row["iterations"])

    resumed = subprocess.run(
        [sys.executable, "-m", "mineonline_core.cli", "tune", "--resume", str(exp_dir)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    [row] = _table(exp_dir)
    assert (row["status"], row["iterations"]) == ("completed", "40")
    # The same run continued from its checkpoint: each iteration is in its metrics once, in order.
    iterations = _iterations(Path(row["run_dir"]))
    assert iterations == list(range(1, 41)) and stopped_at in iterations


def test_the_table_reports_each_trials_end_and_a_failures_root_cause(tmp_path):
    from ray.exceptions import RayTaskError
    from ray.tune import Result

    from mineonline_core.errors import RunFailedError
    from mineonline_core.driver.sweep import TrialSpec
    from mineonline_core.driver.tune import _rows, format_table

    spec = TrialSpec(
        source="c.yaml", fixed=(), keys=("seed",), experiment="e", experiment_dir=str(tmp_path), metric="m", cwd="."
    )
    cause = RunFailedError("ValueError: env id 'Nope-v0' is not registered")
    error = RayTaskError(
        "TrialRun.train",
        f'Traceback (most recent call last):\n  File "x.py", line 1\nmineonline_core.errors.RunFailedError: {cause}',
        cause,
    )
    for name, iterations in (("e-00000-seed=0", 8), ("e-00001-seed=1", 3)):
        (tmp_path / name / "checkpoints" / f"checkpoint_{iterations:06d}").mkdir(parents=True)
        (tmp_path / name / "checkpoints" / f"checkpoint_{iterations:06d}" / "manifest.json").write_text("{}")
    results = [
        Result(
            metrics={"m": 2.0, "trainer/iteration": 8.0, "done": True, "config": {"seed": "0"}},
            checkpoint=None,
            error=None,
            path=str(tmp_path / "e-00000-seed=0"),
        ),
        Result(
            metrics={"m": 1.0, "trainer/iteration": 2.0, "done": True, "config": {"seed": "1"}},
            checkpoint=None,
            error=None,
            path=str(tmp_path / "e-00001-seed=1"),
        ),
        Result(metrics={"config": {"seed": "2"}}, checkpoint=None, error=error, path=str(tmp_path / "e-00002-seed=2")),
        # Pending when the sweep was interrupted: it never reported, Tune gives no config.
        Result(metrics={}, checkpoint=None, error=None, path=str(tmp_path / "e-00003")),
    ]
    rows = _rows(results, spec, {"iterations": 8, "scheduler": "asha"})
    assert [(r["parameters"], r["metric"], r["iterations"], r["status"]) for r in rows] == [
        ("seed=0", "2", 8, "completed"),
        ("seed=1", "1", 3, "stopped early (asha)"),  # the run's own last checkpoint, past the stop
        ("seed=2", "", 0, "failed: ValueError: env id 'Nope-v0' is not registered"),
        ("seed=?", "", 0, "not started"),
    ]
    assert format_table(rows).splitlines()[0].split() == [
        "trial",
        "parameters",
        "metric",
        "iterations",
        "status",
        "run_dir",
    ]


def test_a_trial_restarted_by_resume_continues_its_runs_checkpoint(tmp_path, monkeypatch):
    """``mineonline tune --resume`` restarts an unfinished trial in a new actor: its run continues from the run
    directory's latest checkpoint (``run(resume=...)``), never a fresh run of the trial's config over it.
    The whole interruption and resume runs in ``test_an_interrupted_experiment_resumes``."""
    from mineonline_core.driver import api

    calls: list[dict] = []

    def run(source, overrides=(), **options):  # records what the trial asks of the driver
        calls.append({"source": source, "overrides": list(overrides), **options})
        return {"status": "completed", "iteration": 40, "summary": {}}

    monkeypatch.setattr(api, "run", run)
    trial = bare_trial(tmp_path / "exp" / "exp-00000-seed=0")
    trial.config = {}
    (trial.run_dir / "checkpoints" / "checkpoint_000002").mkdir(parents=True)
    trial._run()
    [call] = calls
    assert (call["source"], call["overrides"], call.get("resume")) == (None, [], str(trial.run_dir)), call
    assert trial._events.get_nowait()[0] == "end"


def test_an_interrupted_sweeps_warning_names_mineonlines_resume_not_rays_api(tmp_path):
    """While the experiment runs, Tune's interruption warning (``ray.tune.tune``'s logger, the words Ray writes)
    reads as the command that continues it; outside the experiment Tune's logger is left as it was.
    The real Ctrl-C of a sweep is in ``test_an_interrupted_experiment_resumes``."""
    import logging

    from mineonline_core.driver.tune import resume_hint

    seen: list[str] = []

    class Console(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    tune_log, console = logging.getLogger("ray.tune.tune"), Console(level=logging.WARNING)
    interrupted = (
        "Experiment has been interrupted, but the most recent state was saved.\n"
        f'Resume experiment with: Tuner.restore(path="{tmp_path}", trainable=...)'
    )
    tune_log.addHandler(console)
    try:
        with resume_hint(tmp_path):
            tune_log.warning(interrupted)
        tune_log.warning(interrupted)
    finally:
        tune_log.removeHandler(console)
    during, after = seen
    assert f"Continue it with: mineonline tune --resume {tmp_path}" in during and "Tuner.restore" not in during
    assert after == interrupted
