"""Ray restarts a run's bookkeeping actors in place when their process dies, and each restart is counted where
the run's metrics go: the episode statistics actor, the logging actor and the shared inference server, each
SIGKILLed on a local cluster.

The same deaths inside a whole CLI run, four kills in one run, are ``tests/faults/test_actor_deaths.py``; these
take seconds, so the mutation check runs them first for the defects both catch. The store host's restart is in
``tests/test_unreadable_records.py``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import ray

from mineonline_core.rollout.inference import InferenceServer
from mineonline_core.rollout.stats import ACTOR_OPTIONS, RESTARTS_METRIC, EpisodeStatistics
from mineonline_core.services import loggerhub, names
from mineonline_core.testing import kit as tk


@ray.remote(num_cpus=0)
class Recorder:
    """A logging actor's one method the statistics actor calls, recording what it was given."""

    def __init__(self) -> None:
        self.records: list[dict[str, float]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append(dict(metrics))

    def seen(self) -> list[dict[str, float]]:
        return self.records


@ray.remote(num_cpus=0)
class HeldHub:
    """A logging actor that takes its time: each call returns once the file ``release`` exists."""

    def __init__(self, release: str) -> None:
        self.release, self.records = release, []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        while not os.path.exists(self.release):
            time.sleep(0.05)  # held until the test lets it go
        self.records.append(dict(metrics))

    def log_histogram(self, key: str, values: Any, step: int | None = None) -> None:
        self.log_metrics({f"{key}/size": float(len(values))})

    def seen(self) -> list[dict[str, float]]:
        return self.records


def _sigkill(handle: Any) -> int:
    pid = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    return pid


def _within(seconds: float, done: Callable[[], bool], what: str) -> None:
    """Polls ``done`` until it holds: the restarted actor's record comes from its own process, in no
    order with this process's calls."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_killed_statistics_actor_is_restarted_and_counts_it(local_ray) -> None:
    recorder = Recorder.remote()
    stats = (
        ray.remote(EpisodeStatistics)
        .options(**ACTOR_OPTIONS, name="restarts-test/episode_statistics")
        .remote(logger_hub=recorder, window=4)
    )
    pid = _sigkill(stats)
    assert ray.get(stats.__ray_call__.remote(lambda self: os.getpid())) != pid  # restarted, same handle
    assert ray.get(stats.summary.remote()) == {"episode/count": 0.0}  # it serves calls; its window died with it
    # Asked by the restarted actor itself, the recorder has the record already: Ray runs one caller's calls to an
    # actor in the order they were made, and the restarted constructor made its call first. No wait to run out.
    seen_by_stats = ray.get(stats.__ray_call__.remote(lambda self: ray.get(self.logger_hub.seen.remote())))
    assert {RESTARTS_METRIC: 1.0} in seen_by_stats, f"the restarted statistics actor logged no restart: {seen_by_stats}"
    _within(60, lambda: {RESTARTS_METRIC: 1.0} in ray.get(recorder.seen.remote()), "no stats/restarts record")


def test_a_killed_logging_actor_is_restarted_counts_it_and_keeps_the_step_axis(local_ray, tmp_path) -> None:
    hub = loggerhub.start_logger_hub(
        run_name="restarts-test", run_dir=str(tmp_path), loggers=[], config={}, num_iterations=2, video_dir="videos"
    )
    ray.get(hub.add_env_steps.remote(100))
    assert ray.get(hub.log_metrics.remote({"rollout/env_steps": 100.0})) == 100
    pid = _sigkill(hub)
    assert ray.get(hub.__ray_call__.remote(lambda self: os.getpid())) != pid
    # The step axis goes on from where the dead hub left it: a record of the restarted hub is never stamped
    # below one the loggers already have.
    assert ray.get(hub.env_steps.remote()) == 100
    assert ray.get(hub.latest.remote())[loggerhub.RESTARTS_METRIC] == 1.0


def test_a_killed_inference_server_is_restarted_and_counts_it(local_ray) -> None:
    # Restarted in place as the run starts it (rollout/startup.py): named, max_restarts=-1.
    server = (
        ray.remote(InferenceServer)
        .options(
            name=names.actor_name("restarts-test", names.INFERENCE_SERVER),
            num_cpus=0,
            max_concurrency=4,
            max_restarts=-1,
            max_task_retries=-1,
        )
        .remote(policy_generator=tk.TinyGRUPolicy, config=tk.rollout_config(inference="shared"))
    )
    assert ray.get(server.metrics.remote())["rollout/inference_restarts"] == 0.0
    first_life = ray.get(server.__ray_call__.remote(lambda self: self.server_id))
    pid = _sigkill(server)
    assert ray.get(server.__ray_call__.remote(lambda self: os.getpid())) != pid
    # A new life: the envs' states kept by the old one are gone, and the metric the run reports says so.
    assert ray.get(server.__ray_call__.remote(lambda self: self.server_id)) != first_life
    assert ray.get(server.metrics.remote())["rollout/inference_restarts"] == 1.0


def test_the_last_episode_report_returns_once_the_logging_actor_has_logged_it(local_ray, tmp_path) -> None:
    """The rollout manager's report at shutdown: the episodes since the last ``report_every``-th reach the
    metrics. The driver finishes the logging actor right after, and Ray orders only one caller's calls, so a
    report pushed without waiting could land after the finish: a short run (a sweep's trial beside two CPU
    burners) ended with no ``episode/*`` metric at all, and Tune ended the whole sweep for the missing metric."""
    release = tmp_path / "release"
    hub = HeldHub.remote(str(release))
    stats = ray.remote(EpisodeStatistics).options(**ACTOR_OPTIONS).remote(logger_hub=hub, window=4, report_every=10)
    ray.get(
        stats.add_episodes.remote([{"return": r, "discounted_return": r, "length": 5} for r in (1.0, 2.0, 3.0)])
    )  # none pushed yet
    last = stats.report.remote()  # as the manager calls it
    ready, _ = ray.wait([last], timeout=5)
    assert not ready, "the last report returned while the logging actor still held its records"
    release.touch()
    summary = ray.get(last, timeout=60)
    assert summary["episode/count"] == 3.0 and summary["episode/return_mean"] == 2.0
    assert ray.get(hub.seen.remote()) == [summary, {"episode/return/size": 3.0}]
