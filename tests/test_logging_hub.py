"""LoggerHub: ordering, latest values, the env-step axis, failing loggers, videos, and the Ray actor."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from mineonline_core.builtin.console import ConsoleLogger, ConsoleOptions
from mineonline_core.contracts.logger import Logger, LoggerOptions
from mineonline_core.services.loggerhub import LoggerHub, video_filename


class RecordingLogger(Logger):
    name = "recording"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls: list[tuple] = []
        self.finished = 0

    def log_metrics(self, metrics, step):
        self.calls.append(("metrics", dict(metrics), step))

    def log_histogram(self, key, values, step):
        self.calls.append(("histogram", key, np.asarray(values).copy(), step))

    def log_video(self, key, path, step):
        self.calls.append(("video", key, path, step))

    def finish(self):
        self.finished += 1


class ExplodingLogger(Logger):
    name = "exploding"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0

    def log_metrics(self, metrics, step):
        self.calls += 1
        if self.calls == 3:
            raise ZeroDivisionError("boom in log_metrics")


class BrokenAtStart(Logger):
    name = "broken_at_start"

    def __init__(self, **kwargs):
        raise RuntimeError("cannot start")

    def log_metrics(self, metrics, step):  # pragma: no cover - never built
        pass


def make_hub(tmp_path, loggers, **kw):
    return LoggerHub(
        run_dir=str(tmp_path),
        loggers=[(cls, LoggerOptions()) for cls in loggers],
        config={"seed": 1},
        num_iterations=10,
        video_dir="videos",
        **kw,
    )


def recorder(hub) -> RecordingLogger:
    return next(lg for lg in hub._loggers if isinstance(lg, RecordingLogger))


def test_order_latest_and_env_step_axis(tmp_path):
    hub = make_hub(tmp_path, [RecordingLogger])
    rec = recorder(hub)
    hub.log_metrics({"trainer/policy_loss": 1.0})  # no step: stamped with env steps (0)
    hub.add_env_steps(128)
    hub.add_env_steps(72)
    hub.log_metrics({"trainer/policy_loss": 0.5, "episode/return_mean": np.float32(2.5)})
    hub.log_metrics({"rollout/env_steps_per_s": 10}, step=7)  # an explicit step is kept
    hub.log_histogram("trainer/advantages", np.arange(6.0))
    for i in range(100):
        hub.log_metrics({"seq": i})
    assert hub.flush(timeout=30)
    assert hub.env_steps() == 200
    latest = hub.latest()
    assert latest["trainer/policy_loss"] == 0.5
    assert latest["episode/return_mean"] == 2.5
    assert latest["seq"] == 99.0
    assert latest["env_steps"] == 200.0
    assert latest["logger/errors"] == 0.0
    metric_calls = [c for c in rec.calls if c[0] == "metrics"]
    assert [c[2] for c in metric_calls[:3]] == [0, 200, 7]
    assert metric_calls[0][1] == {"trainer/policy_loss": 1.0}
    assert [c[1]["seq"] for c in metric_calls[3:]] == list(range(100))  # arrival order preserved
    hist = [c for c in rec.calls if c[0] == "histogram"]
    assert hist[0][1] == "trainer/advantages" and hist[0][3] == 200
    np.testing.assert_array_equal(hist[0][2], np.arange(6.0))
    summary = hub.finish()
    assert rec.finished == 1
    assert summary["trainer/policy_loss"] == 0.5 and summary["env_steps"] == 200.0
    assert hub.finish() == summary  # idempotent, loggers finished once
    assert rec.finished == 1
    hub.log_metrics({"late": 1.0})  # after finish: ignored, no crash
    assert "late" not in hub.latest()


def test_log_batch_is_metrics_plus_histograms_at_one_step(tmp_path):
    hub = make_hub(tmp_path, [RecordingLogger])
    hub.add_env_steps(64)
    hub.log_batch({"trainer/policy_loss": 0.1}, {"trainer/advantages": np.ones(3), "trainer/values": np.zeros(2)})
    hub.log_batch(histograms={"trainer/staleness": np.arange(4)}, step=5)
    hub.finish()
    calls = recorder(hub).calls
    assert [(c[0], c[1] if c[0] == "histogram" else c[1], c[-1]) for c in calls] == [
        ("metrics", {"trainer/policy_loss": 0.1}, 64),
        ("histogram", "trainer/advantages", 64),
        ("histogram", "trainer/values", 64),
        ("histogram", "trainer/staleness", 5),
    ]
    assert hub.latest()["trainer/policy_loss"] == 0.1


def test_non_numeric_values_are_dropped_not_fatal(tmp_path):
    hub = make_hub(tmp_path, [RecordingLogger])
    hub.log_metrics({"ok": 1, "bad": "text", "none": None})
    hub.finish()
    assert recorder(hub).calls[0][1] == {"ok": 1.0}


def test_raising_logger_is_disabled_and_reported(tmp_path, caplog):
    hub = make_hub(tmp_path, [ExplodingLogger, RecordingLogger, BrokenAtStart])
    rec = recorder(hub)
    for i in range(10):
        hub.log_metrics({"i": i})
    assert hub.flush(timeout=30)
    exploding = [lg for lg in hub._loggers if isinstance(lg, ExplodingLogger)]
    assert exploding == []  # disabled after its failure
    assert len(rec.calls) == 10  # the healthy logger got everything
    errors = hub.errors()
    assert len(errors) == 2
    assert any("exploding.log_metrics" in e and "ZeroDivisionError: boom in log_metrics" in e for e in errors)
    assert any("broken_at_start.start" in e and "cannot start" in e for e in errors)
    assert hub.latest()["logger/errors"] == 2.0
    assert "boom in log_metrics" in caplog.text and "Traceback" in caplog.text  # never silent
    assert hub.finish()["logger/errors"] == 2.0


def test_video_written_and_forwarded(tmp_path):
    hub = make_hub(tmp_path, [RecordingLogger])
    hub.add_env_steps(1234)
    hub.log_video("video/worker_0", b"not really an mp4")
    hub.log_video("video/worker_1", b"x", step=5, filename="../escape.mp4")
    hub.log_video("video/worker_0", b"second video at the same step")
    hub.finish()
    videos = [c for c in recorder(hub).calls if c[0] == "video"]
    expected = tmp_path / "videos" / "video_worker_0_step000001234.mp4"
    assert video_filename("video/worker_0", 1234) == expected.name
    assert videos[0] == ("video", "video/worker_0", str(expected), 1234)
    assert expected.read_bytes() == b"not really an mp4"
    assert videos[1][2] == str(tmp_path / "videos" / "escape.mp4")  # no path traversal out of the video dir
    assert not list((tmp_path / "videos").glob("*.tmp"))
    # Another worker's video at the same step gets its own file.
    assert videos[2][2] == str(tmp_path / "videos" / "video_worker_0_step000001234_1.mp4")
    assert expected.read_bytes() == b"not really an mp4"
    assert (tmp_path / "videos" / "video_worker_0_step000001234_1.mp4").read_bytes() == b"second video at the same step"


def test_hub_without_videos_finishes(tmp_path):
    # record_video_interval: 0 means no video ever reaches the hub; the run still ends cleanly.
    hub = LoggerHub(
        run_dir=str(tmp_path),
        loggers=[(ConsoleLogger, ConsoleOptions())],
        config={},
        num_iterations=3,
        video_dir="videos",
    )
    for it in range(1, 4):
        hub.add_env_steps(100)
        hub.log_metrics({"trainer/iteration": it, "trainer/policy_loss": 1.0 / it})
    summary = hub.finish()
    assert summary["trainer/iteration"] == 3.0 and summary["logger/errors"] == 0.0
    assert not (tmp_path / "videos").exists()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [100, 200, 300]


def test_hub_as_named_ray_actor(tmp_path, local_ray):
    ray = local_ray
    from mineonline_core.services.loggerhub import get_logger_hub, start_logger_hub

    hub = start_logger_hub(
        run_name="hubtest",
        run_dir=str(tmp_path),
        loggers=[(ConsoleLogger, ConsoleOptions())],
        config={"x": 1},
        num_iterations=2,
        video_dir="videos",
    )
    assert get_logger_hub("hubtest")._actor_id == hub._actor_id
    for i in range(50):  # fire-and-forget, as producers do
        hub.add_env_steps.remote(10)
        hub.log_metrics.remote({"rollout/env_steps_per_s": float(i)})
        assert i % 10 or ray.get(hub.latest.remote())["logger/errors"] == 0.0  # queries interleave
    hub.log_histogram.remote("trainer/values", np.ones(100))
    assert ray.get(hub.flush.remote(30))
    latest = ray.get(hub.latest.remote())
    assert latest["rollout/env_steps_per_s"] == 49.0
    assert latest["env_steps"] == 500.0
    summary = ray.get(hub.finish.remote())
    assert summary["env_steps"] == 500.0
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 51
    # one producer's calls arrive in order, each stamped with the env steps added before it
    assert [x["rollout/env_steps_per_s"] for x in lines[:50]] == [float(i) for i in range(50)]
    assert [x["step"] for x in lines[:50]] == [10 * (i + 1) for i in range(50)]
    assert lines[-1]["trainer/values/mean"] == 1.0
    assert os.path.exists(tmp_path / "summary.json")
    _trainer_records_never_go_back(ray, tmp_path / "interleaved")


class InterleavingHub(LoggerHub):
    """A rollout record and its steps land between the trainer's call and the hub's handling of it, as
    they do on a busy machine (another producer's task is not ordered against the trainer's)."""

    def log_batch(self, metrics=None, histograms=None, step=None):
        self.add_env_steps(301)
        self.log_metrics({"rollout/env_steps_per_s": 1.0})
        return super().log_batch(metrics, histograms, step)


def _trainer_records_never_go_back(ray, run_dir):
    """The trainer's iteration record is stamped by the hub, and the checkpoint keeps that step."""
    from types import SimpleNamespace

    import torch

    from mineonline_core.contracts import fragment as F
    from mineonline_core.services.loggerhub import ACTOR_OPTIONS
    from mineonline_core.trainer.publish import Publishing

    run_dir.mkdir()
    # Shipped by value: Ray's workers cannot import this test module.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    hub = ray.remote(**ACTOR_OPTIONS)(InterleavingHub).remote(
        run_dir=str(run_dir),
        loggers=[(ConsoleLogger, ConsoleOptions())],
        config={},
        num_iterations=1,
        video_dir="videos",
    )
    ray.get(hub.set_env_steps.remote(737))  # a resumed run's axis
    trainer = SimpleNamespace(logger_hub=hub, env_steps=737)
    batch = {c: torch.ones(2, 3) for c in (F.ADVANTAGE, F.VALUE, F.STALENESS)}
    Publishing._log(trainer, {"trainer/iteration": 3.0}, batch)
    assert trainer.env_steps == 1038  # what this iteration's checkpoint records
    Publishing._log(trainer, {"trainer/iteration": 4.0}, batch)
    # A rank dies after iteration 4; rank 0 of the next attempt resumes from iteration 3's checkpoint.
    for rank, restarts in ((0, 0), (1, 1)):  # a first attempt's rank 0, another rank: nothing to drop
        Publishing.rewind_logs(SimpleNamespace(rank=rank, restarts=restarts, logger_hub=hub, iteration=3))
    assert ray.get(hub.flush.remote(30))
    assert '"trainer/iteration": 4.0' in (run_dir / "metrics.jsonl").read_text()
    Publishing.rewind_logs(SimpleNamespace(rank=0, restarts=1, logger_hub=hub, iteration=3))
    ray.get(hub.finish.remote())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps == sorted(steps) and steps[-1] == 1339
    assert [r["trainer/iteration"] for r in records if "trainer/iteration" in r] == [3]


def test_a_restarted_trainer_leaves_one_record_per_iteration(tmp_path):
    """A rank died after logging iterations 3 and 4 (checkpoint at 2): its replacement resumes from 2 and
    the loggers drop what the dead attempt logged of 3 and 4; rollout's records stay."""
    hub = make_hub(tmp_path, [ConsoleLogger])

    def iteration(i: int, step: int) -> None:
        hub.log_batch({"trainer/iteration": float(i), "trainer/restarts": float(i > 4)}, {"trainer/values": [i]}, step)
        hub.log_metrics({"rollout/env_steps_per_s": float(i)}, step + 1)

    for i in range(1, 5):
        iteration(i, 10 * i)
    hub.rewind(2)
    for i in range(3, 6):
        iteration(i, 100 + 10 * i)
    hub.finish()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["trainer/iteration"] for r in records if "trainer/iteration" in r] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in records if "trainer/values/mean" in r] == [10, 20, 130, 140, 150]
    assert len([r for r in records if "rollout/env_steps_per_s" in r]) == 4 + 3  # rollout's points all stay


class _RunIdLogger(Logger):
    """Reports the run id it would continue, as the wandb logger does at start."""

    name = "runid"
    seen: list[str | None] = []

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        _RunIdLogger.seen.append(self.resumed_run_id())

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass


def test_a_restarted_hubs_loggers_continue_the_runs_own_records(tmp_path, monkeypatch) -> None:
    """Ray restarts a dead hub in place; its loggers must reopen the run they kept the id of (one wandb run),
    not start a second one: the hub hands them the config of a resumed run."""
    import mineonline_core.services.loggerhub as hub_module

    _RunIdLogger(run_dir=str(tmp_path), options=LoggerOptions(), config={}).keep_run_id("run-abc")
    _RunIdLogger.seen.clear()
    args = dict(run_dir=str(tmp_path), loggers=[(_RunIdLogger, LoggerOptions())], num_iterations=2, video_dir="videos")
    LoggerHub(config={"train_config": {"resume": None}}, **args).finish()
    monkeypatch.setattr(hub_module, "actor_restart", lambda name: (1, "run/logger_hub"))
    monkeypatch.setattr(hub_module, "recall", lambda name: 100)
    LoggerHub(config={"train_config": {"resume": None}}, **args).finish()
    assert _RunIdLogger.seen == [None, "run-abc"]


def test_a_record_of_the_env_step_count_shows_the_count_it_is_stamped_with(tmp_path):
    """The rollout manager reads the count, then logs its report without a step: workers' steps that arrive in
    between must not leave the report saying 194 at step 280."""
    hub = make_hub(tmp_path, [RecordingLogger])
    rec = recorder(hub)
    hub.add_env_steps(194)
    read = float(hub.env_steps())
    hub.add_env_steps(86)  # another worker's report lands between the read and the log
    assert hub.log_metrics({"rollout/env_steps": read, "rollout/worker_restarts": 0.0}) == 280
    hub.log_metrics({"rollout/env_steps": 5.0}, step=5)  # an explicit step keeps the producer's value
    assert hub.flush(timeout=30)
    metric_calls = [c for c in rec.calls if c[0] == "metrics"]
    assert [(c[1]["rollout/env_steps"], c[2]) for c in metric_calls] == [(280.0, 280), (5.0, 5)]
    hub.finish()
