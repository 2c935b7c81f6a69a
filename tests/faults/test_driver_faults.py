"""The driver's watch loop (``training.train_with_progress``) with real actors: a dead logging actor,
a dead rollout manager, a manager reporting a failure, and a trainer thread that raises all end the
run loudly, with the cause, within seconds, while training would otherwise go on for minutes.
"""

from __future__ import annotations

import threading
import time

import pytest

from mineonline_core.errors import MineOnlineError, RunFailedError
from mineonline_core.services.names import NAMESPACE, ROLLOUT_MANAGER, actor_name


class BlockingTrainer:
    """Stands in for the trainer: ``fit`` blocks (as a long run would) until released, or raises."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.release, self.error = threading.Event(), error

    def fit(self) -> dict:
        if self.error is not None:
            raise self.error
        self.release.wait(timeout=300)
        return {"status": "completed", "iteration": 1, "version": 1}


def _actors(ray, run: str, tmp_path):
    from mineonline_core.builtin.console import ConsoleLogger
    from mineonline_core.services.loggerhub import start_logger_hub

    @ray.remote(num_cpus=0)
    class Manager:
        def __init__(self):
            self.error = None

        def health(self):
            if self.error:
                raise RunFailedError(self.error)

        def fail(self, message):
            self.error = message

        def request_stop(self):
            pass

        def diagnose(self):
            return [
                "rollout worker 0: life 3, 0 env steps; last error: env 0: injected reset fault",
                "replay buffer: 0 of the 2 chunks asked for are eligible at model version 0",
            ]

    hub = start_logger_hub(
        run_name=run,
        run_dir=str(tmp_path / run),
        loggers=[(ConsoleLogger, ConsoleLogger.Config())],
        config={},
        num_iterations=10,
        video_dir=str(tmp_path / run / "videos"),
    )
    manager = Manager.options(name=actor_name(run, ROLLOUT_MANAGER), namespace=NAMESPACE).remote()
    ray.get(manager.health.remote())
    return hub, manager


def _config(run: str, progress_timeout: float = 900.0):
    from mineonline_core.config import load_config

    return load_config(
        {
            "run_name": run,
            "env_config": {"name": "gymnasium", "id": "CartPole-v1"},
            "policy_config": {"name": "mlp"},
            "logger_config": {"loggers": []},
            "train_config": {"num_iterations": 10},
            "progress_timeout": progress_timeout,
        }
    ).config


@pytest.mark.parametrize(
    "fault", ["kill_logger_hub", "kill_manager", "manager_reports_failure", "trainer_raises", "stalled"]
)
def test_driver_fails_loudly(ray_cluster, tmp_path, fault: str) -> None:
    import ray

    from mineonline_core.driver.training import train_with_progress

    run = f"driver-{fault.replace('_', '-')}"
    hub, manager = _actors(ray, run, tmp_path)
    trainer = BlockingTrainer(ValueError("loss is NaN at iteration 3") if fault == "trainer_raises" else None)
    expected = {
        "kill_logger_hub": "LoggerHub",
        "kill_manager": "Manager",
        "manager_reports_failure": "buffer actor died",
        "trainer_raises": "ValueError: loss is NaN",
        "stalled": "no new training iteration for",
    }[fault]
    outcome: dict = {}

    def watch() -> None:
        try:
            train_with_progress(
                trainer, manager, hub, _config(run, 3.0 if fault == "stalled" else 900.0), progress=False
            )
        except BaseException as exc:  # noqa: BLE001 - the failure under test
            outcome["error"] = exc
        outcome["at"] = time.monotonic()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        injected_at = time.monotonic()
        if fault == "kill_logger_hub":
            ray.kill(hub, no_restart=True)
        elif fault == "kill_manager":
            ray.kill(manager, no_restart=True)
        elif fault == "manager_reports_failure":
            ray.get(manager.fail.remote("the replay buffer actor died"))
        # Generous for a loaded machine, and still far short of the 900 s progress_timeout the other
        # faults run with: the driver notices each fault itself, the watchdog does not.
        watcher.join(timeout=240)
        assert not watcher.is_alive(), f"the driver still waits 240 s after {fault}"
    finally:
        trainer.release.set()
    error = outcome.get("error")
    assert error is not None, f"{fault} did not fail the run"
    detected_s = outcome["at"] - injected_at
    assert expected in f"{type(error).__name__}: {error}", error
    if fault in ("manager_reports_failure", "trainer_raises", "stalled"):
        assert isinstance(error, MineOnlineError)  # the CLI prints its message without a traceback
    if fault == "stalled":  # the run says why: every actor's last error and the buffer's reason
        assert (
            "progress_timeout=3" in str(error)
            and "injected reset fault" in str(error)
            and "0 of the 2 chunks" in str(error)
        )
    first_line = str(error).splitlines()[0][:160]
    print(f"FIGURE driver {fault}: run failed after {detected_s:.1f}s with {type(error).__name__}: {first_line}")
    for actor in (hub, manager):
        ray.kill(actor, no_restart=True)
