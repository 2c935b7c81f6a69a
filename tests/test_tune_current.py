"""Issue 35 item 3 and "a search algorithm beyond grid and random": ``mineonline tune`` run as a user runs it
(the command in a subprocess, its own local Ray) decides on the runs' current numbers, its table shows each
run's own last value, a trial the scheduler stops stops at once; what an Optuna sweep leaves is checked on
the sweep docs/many-runs.md shows (``tests/test_docs_newcomer.py``).

The ASHA sweep ranks its trials by ``trainer/learning_rate`` with linear annealing: no noise from short
CartPole runs, and different at every iteration, so a table holding a value Tune took iterations before the
run's last one shows. Which trials ASHA stops depends on when Tune sees their results; that some are stopped
does not (the 1e-4 trials start after the 1e-2 ones and trail them by far).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.test_tune import CARTPOLE, bare_trial

ASHA_ITERATIONS = 30


def _tune(tmp_path: Path, *args: str, iterations: int = 3) -> subprocess.CompletedProcess:
    (tmp_path / "cartpole.yaml").write_text(
        CARTPOLE.format(iterations=iterations, save=50).replace("anneal_lr_linearly: false", "anneal_lr_linearly: true")
    )
    done = subprocess.run(
        [sys.executable, "-m", "mineonline_core.cli", "tune", "cartpole.yaml", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=1400,
        cwd=tmp_path,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _table(exp_dir: Path) -> list[dict]:
    with (exp_dir / "results.csv").open() as handle:
        return list(csv.DictReader(handle))


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(1500)  # a loaded 2-core machine starts Ray and four trials slowly
def test_an_asha_sweeps_table_shows_each_runs_own_last_value(tmp_path: Path) -> None:
    done = _tune(
        tmp_path,
        "train_config.learning_rate=grid(1e-2,1e-4)",
        "--seeds",
        "0,1",
        "--name",
        "current",
        "--scheduler",
        "asha",
        "--metric",
        "trainer/learning_rate",
        "--grace-period",
        "1",
        # Long enough that a 1e-4 trial cannot end before ASHA, deciding on its first results, stops it (a
        # stopped trial runs 0-2 iterations past the last result Tune saw); the 1e-2 trials run them all.
        iterations=ASHA_ITERATIONS,
    )
    exp_dir = tmp_path / "runs" / "current"
    rows = _table(exp_dir)
    assert sorted(r["parameters"] for r in rows) == [
        f"train_config.learning_rate={lr} seed={s}" for lr in ("1e-2", "1e-4") for s in (0, 1)
    ]
    stopped = [r for r in rows if r["status"] == "stopped early (asha)"]
    assert stopped, rows  # the 1e-4 trials start once both 1e-2 trials ran: ASHA stops them at a rung
    for row in rows:
        run_dir = Path(row["run_dir"])
        lr, seed = (item.split("=")[1] for item in row["parameters"].split())
        assert run_dir.parent == exp_dir and run_dir.name.startswith("current-")
        assert run_dir.name.endswith(f"learningrate={lr}-seed={seed}") and run_dir.name in done.stdout
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert (saved["train_config"]["learning_rate"], saved["seed"], saved["run_name"]) == (
            float(lr),
            int(seed),
            run_dir.name,
        )
        summary = json.loads((run_dir / "summary.json").read_text())
        # The table shows the run's own last value, not the last one Tune took from it.
        assert float(row["metric"]) == float(f"{summary['trainer/learning_rate']:.4g}"), (row, summary)
        logged = [int(r["trainer/iteration"]) for r in _lines(run_dir / "metrics.jsonl") if "trainer/iteration" in r]
        assert (run_dir / "checkpoints").is_dir() and logged[0] == 1 and int(row["iterations"]) == max(logged)
        if row["status"] == "completed":
            assert row["iterations"] == str(ASHA_ITERATIONS), row
        else:  # stopped at a rung: the run finished its iteration and left a final checkpoint
            assert row["status"] == "stopped early (asha)" and 1 <= int(row["iterations"]) < ASHA_ITERATIONS, row
        assert lr == "1e-2" or row["status"] == "stopped early (asha)", row  # the low rate trails at every rung


def test_tune_takes_the_newest_result_not_a_queue_of_past_iterations() -> None:
    """The run logs iterations faster than Tune takes results (one per ``step``): ``step`` hands Tune the
    newest, so a scheduler decides on the run's current metric."""
    import queue
    import threading

    from mineonline_core.driver.trial import TrialRun

    trial = TrialRun.__new__(TrialRun)  # the trainable's step() alone: no Tune actor needed
    trial._events, trial._thread = queue.Queue(), threading.current_thread()
    for iteration in (1, 2, 3):
        trial._events.put(("result", {"trainer/iteration": float(iteration), "m": 10.0 * iteration}))
    assert trial.step() == {"trainer/iteration": 3.0, "m": 30.0}
    trial._events.put(("result", {"trainer/iteration": 4.0, "m": 40.0}))
    trial._events.put(("error", RuntimeError("the run failed")))
    try:
        trial.step()
    except RuntimeError as exc:  # an error behind queued results is not lost
        assert str(exc) == "the run failed"
    else:
        raise AssertionError("step() returned past the run's error")


def test_a_run_that_never_logged_the_metric_fails_its_trial_not_the_sweep(tmp_path: Path) -> None:
    """A run that ended before its first episode finished (a short trial, an env of long episodes) has no
    ``episode/return_mean`` to report: handed to Tune, its last result ended the whole sweep with Tune's
    strict metric check. The trial fails alone, with the cause and the fix; a run that logged it ends as usual."""
    import queue
    import threading
    from types import SimpleNamespace

    from mineonline_core.driver.trial import TrialRun
    from mineonline_core.errors import RunFailedError

    def trial(running: dict) -> TrialRun:
        made = TrialRun.__new__(TrialRun)  # the trainable's step() alone: no Tune actor needed
        made._events, made._thread, made._stop = queue.Queue(), threading.current_thread(), threading.Event()
        made.spec, made.name = SimpleNamespace(metric="episode/return_mean"), "short"
        made.run_dir, made._offset, made._reported, made._running = tmp_path, 0, 0.0, running
        made._events.put(("end", {"status": "completed", "iteration": 3, "summary": {"rollout/env_steps": 158.0}}))
        return made

    with pytest.raises(RunFailedError, match=r"run short ended after 3 iterations and 158 env steps without "):
        trial({"env_steps": 158.0}).step()
    ended = trial({"env_steps": 158.0, "episode/return_mean": 21.5}).step()
    assert ended["episode/return_mean"] == 21.5 and ended["done"] and ended["trainer/iteration"] == 3.0


def _rollout_manager(run_name: str) -> Any:
    """A named actor where the run's rollout manager would be, with what the trial calls on it: its stop flag."""
    import ray

    from mineonline_core.services.names import NAMESPACE, ROLLOUT_MANAGER, actor_name

    @ray.remote
    class Manager:
        def __init__(self) -> None:
            self.stop = False

        def request_stop(self) -> None:
            self.stop = True

        def stop_requested(self) -> bool:
            return self.stop

    return Manager.options(name=actor_name(run_name, ROLLOUT_MANAGER), namespace=NAMESPACE).remote()


def test_a_stopped_trial_tells_its_runs_monitor_and_manager_before_waiting_for_it(local_ray, tmp_path: Path) -> None:
    """Tune's stop (``cleanup``) of a running trial: the run's monitor answers stop at its next call, and the run's
    rollout manager has been asked to stop by the time ``cleanup`` returns, so the trial ends within the iteration
    it is in instead of training on to ``num_iterations``. The run here polls its monitor as the driver loop does."""
    import threading
    import time

    import ray

    trial = bare_trial(tmp_path / "e-stopped")
    manager = _rollout_manager(trial.name)
    ray.get(manager.stop_requested.remote())  # created before the trial's stop looks it up
    ended: list[str] = []
    stopping_at: list[float] = []

    def run() -> None:
        # The flag is set first thing in cleanup: 5 s after it was called, even a loaded machine has seen it.
        while not stopping_at or time.monotonic() < stopping_at[0] + 5:
            if trial._on_latest({}):
                ended.append("monitor")
                return
            time.sleep(0.01)
        ended.append("trained on")

    trial._thread = threading.Thread(target=run)
    trial._thread.start()
    stopping_at.append(time.monotonic())
    trial.cleanup()
    assert ended == ["monitor"]
    assert ray.get(manager.stop_requested.remote()), "the run's manager was left to the monitor's next call"


def test_a_stopped_trials_row_shows_its_runs_last_value_not_tunes_last_result(tmp_path: Path) -> None:
    """A trial the scheduler stops ends the iteration it is in and logs it after Tune took its last result: the
    table shows the run's own last value (its console logger's summary), with the run's last checkpoint."""
    import threading

    from ray.tune import Result

    from mineonline_core.builtin.console import ConsoleLogger
    from mineonline_core.driver.tune import _rows

    run_dir = tmp_path / "e-00000"
    trial = bare_trial(run_dir, metric="m")
    trial._thread = threading.current_thread()  # step() takes the monitor's results; no run thread
    logger = ConsoleLogger(run_dir=str(run_dir))
    for iteration in (1, 2):
        logger.log_metrics({"trainer/iteration": float(iteration), "m": 1.0 / iteration}, step=100 * iteration)
    trial._on_latest({})
    taken = trial.step()  # the last result Tune takes: the scheduler stops the trial on it
    logger.log_metrics({"trainer/iteration": 3.0, "m": 1.0 / 3}, step=300)  # the iteration the run was in
    logger.finish()
    (run_dir / "checkpoints" / "checkpoint_000003").mkdir(parents=True)
    (run_dir / "checkpoints" / "checkpoint_000003" / "manifest.json").write_text("{}")
    result = Result(metrics={**taken, "done": True}, checkpoint=None, error=None, path=str(run_dir))
    [row] = _rows([result], trial.spec, {"iterations": 8, "scheduler": "asha"})
    assert (taken["trainer/iteration"], taken["m"]) == (2.0, 0.5)
    assert (row["metric"], row["iterations"], row["status"]) == ("0.3333", 3, "stopped early (asha)"), row


def test_a_stopped_trial_asks_its_run_to_stop_at_once(local_ray) -> None:
    """Tune's stop (``cleanup``) asks the run's rollout manager to stop before waiting for the run, instead of
    leaving it to the run's monitor a second later (several CartPole iterations)."""
    import threading
    import time

    import ray

    from mineonline_core.driver.trial import TrialRun

    manager = _rollout_manager("trial-run")
    seen: list[bool] = []

    def run() -> None:  # the run's trainer: goes on until its manager says stop
        for _ in range(600):
            if ray.get(manager.stop_requested.remote()):
                seen.append(True)
                return
            time.sleep(0.05)

    trial = TrialRun.__new__(TrialRun)
    trial.name, trial._stop = "trial-run", threading.Event()
    trial._thread = threading.Thread(target=run)
    trial._thread.start()
    trial.cleanup()
    assert seen == [True] and trial._stop.is_set()


def check_optuna_sweep(exp_dir: Path, stdout: str, *, trials: int, iterations: int, low: float, high: float) -> None:
    """What an Optuna sweep leaves: its trials, each with its own value drawn in the range, and Optuna's state.
    Run on docs/many-runs.md's Optuna block by ``tests/test_docs_newcomer.py`` (the sweep a user copies)."""
    rows = _table(exp_dir)
    done = all(r["status"] == "completed" and r["iterations"] == str(iterations) for r in rows)
    assert len(rows) == trials and done, rows
    rates = [float(r["parameters"].split("=")[1]) for r in rows]
    assert len(set(rates)) == trials and all(low <= rate <= high for rate in rates), rates
    assert all(r["metric"] != "" for r in rows)  # episode/return_mean, the default metric, reached the table
    assert json.loads((exp_dir / "tune.json").read_text())["options"]["search"] == "optuna"
    # Tune saved a searcher's state (Optuna's study), not the grid/random generator's.
    assert list(exp_dir.glob("searcher-state-*.pkl")) and not list(exp_dir.glob("basic-variant-state-*"))
    assert "results: " in stdout


def test_optuna_refuses_grids_before_ray_starts(tmp_path: Path) -> None:
    from mineonline_core.cli import main

    (tmp_path / "cartpole.yaml").write_text(CARTPOLE.format(iterations=3, save=1))
    config, output = str(tmp_path / "cartpole.yaml"), f"output_dir={tmp_path / 'runs'}"
    assert main(["tune", config, output, "--search", "optuna", "--seeds", "0,1"]) == 2
    assert not (tmp_path / "runs").exists()


def test_an_optuna_sweep_hands_tune_optunas_seeded_search(tmp_path: Path) -> None:
    """``--search optuna`` gives Tune Optuna's searcher, seeded by the config's seed: its proposals stay in
    the space, the same seed proposes the same values, another seed others. ``--search random`` leaves
    Tune's own grid and random draws. The whole sweep runs in docs/many-runs.md's block."""
    from mineonline_core.driver.sweep import Space
    from mineonline_core.driver.tune import _plan, _search

    config = tmp_path / "cartpole.yaml"
    config.write_text(CARTPOLE.format(iterations=3, save=50))
    space = "train_config.learning_rate=loguniform(1e-4,3e-3)"
    rate = Space("train_config.learning_rate", "loguniform", ("1e-4", "3e-3"))

    def proposals(seed: int, name: str, search: str = "optuna") -> list[float] | None:
        common = {"seeds": None, "scheduler": "asha", "metric": "m", "mode": "max", "num_samples": 3}
        overrides = [space, f"seed={seed}", f"output_dir={tmp_path / 'runs'}"]
        _, _, options = _plan(
            str(config), overrides, name=name, **common, grace_period=None, perturbation_interval=None, search=search
        )
        searcher = _search(options)
        if searcher is None:
            return None
        assert searcher.set_search_properties("m", "max", {rate.key: rate.to_tune()})
        drawn = []
        for n in range(3):
            drawn.append(searcher.suggest(f"t{n}")[rate.key])
            searcher.on_trial_complete(f"t{n}", {"m": float(n), "trainer/iteration": 3.0})
        return drawn

    first = proposals(7, "a")
    assert first is not None, "--search optuna left Tune's random draws"
    assert len(set(first)) == 3 and all(1e-4 <= value <= 3e-3 for value in first), first
    assert proposals(7, "b") == first  # seeded by the config's seed
    assert proposals(8, "c") != first
    assert proposals(7, "d", search="random") is None
