"""mineonline-wandb-logger: an offline run directory holds the metrics, the config and a video."""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

try:
    import mineonline_wandb
except ImportError:  # the plugin is not pip-installed: import it from its source folder
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import mineonline_wandb

from mineonline_wandb import WandbLogger, WandbOptions, has_api_key, resolve_mode, scrub_secrets

from mineonline_core.builtin.console import ConsoleLogger, ConsoleOptions
from mineonline_core.driver.localcluster import start_local_cluster
from mineonline_core.services.loggerhub import LoggerHub
from mineonline_core.services.video import encode_episode_video

wandb = pytest.importorskip("wandb")


@pytest.fixture
def offline_env(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path


def offline_run_dir(run_dir: Path) -> Path:
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    return runs[0]


def run_file_bytes(offline_run: Path) -> bytes:
    (records,) = list(offline_run.glob("run-*.wandb"))
    return records.read_bytes()


def test_offline_run_holds_metrics_histograms_video_and_scrubbed_config(offline_env):
    run_dir = offline_env / "run"
    config = {
        "seed": 7,
        "train_config": {"learning_rate": 3e-4},
        "logger_config": {"project": "p", "loggers": ["wandb"], "wandb_api_key": "hunter2-secret-value"},
        "my_token": "tok-should-not-leak",
    }
    hub = LoggerHub(
        run_dir=str(run_dir),
        loggers=[
            (ConsoleLogger, ConsoleOptions()),
            (WandbLogger, WandbOptions(project="mineonline-test", tags=["ci"])),
        ],
        config=config,
        num_iterations=5,
        video_dir="videos",
    )
    names = ["trainer/policy_loss", "trainer/value_loss", "episode/return_mean", "rollout/env_steps_per_s"]
    for it in range(1, 6):
        hub.add_env_steps(256)
        hub.log_metrics({name: float(it * (i + 1)) for i, name in enumerate(names)})
        hub.log_histogram("trainer/advantages", np.random.default_rng(it).standard_normal(500))
    frames = [np.full((32, 32, 3), 10 * t, np.uint8) for t in range(8)]
    hub.log_video("video/worker_0", encode_episode_video(frames, fps=4, returns=list(range(8))))
    summary = hub.finish()
    assert summary["logger/errors"] == 0.0, hub.errors()

    offline_run = offline_run_dir(run_dir)
    data = run_file_bytes(offline_run)
    for name in [*names, "trainer/advantages", "env_steps", "video/worker_0"]:
        assert name.encode() in data, name
    assert b"learning_rate" in data and b"logger_config" in data  # the resolved config is stored
    assert b"hunter2-secret-value" not in data and b"tok-should-not-leak" not in data
    videos = list((offline_run / "files" / "media" / "videos").rglob("*.mp4"))
    assert len(videos) == 1 and videos[0].stat().st_size > 500
    assert (run_dir / "videos" / "video_worker_0_step000001280.mp4").exists()
    # The console JSONL carries the same metric names on the same env-step axis.
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    jsonl_names = set().union(*records) - {"step", "time", "video", "path"}
    assert set(names) <= jsonl_names
    assert [r["step"] for r in records if "trainer/policy_loss" in r] == [256, 512, 768, 1024, 1280]


def test_failure_surfaces_and_disables_only_wandb(offline_env):
    run_dir = offline_env / "run2"
    hub = LoggerHub(
        run_dir=str(run_dir),
        loggers=[(ConsoleLogger, ConsoleOptions()), (WandbLogger, WandbOptions())],
        config={},
        num_iterations=1,
        video_dir="videos",
    )
    wandb_logger = next(lg for lg in hub._loggers if isinstance(lg, WandbLogger))
    # A video wandb cannot open fails inside the logger; the hub disables wandb alone and counts it.
    hub._call(wandb_logger, "log_video", "video/x", str(run_dir / "does-not-exist.mp4"), 1)
    for i in range(200):
        hub.log_metrics({"a": float(i)})
    summary = hub.finish()
    assert summary["logger/errors"] == 1.0
    assert any(e.startswith("wandb.") for e in hub.errors())
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 200  # console unaffected


def test_mode_resolution(tmp_path):
    no_key = {"NETRC": str(tmp_path / "missing-netrc")}
    assert resolve_mode(None, no_key) == "offline"
    assert resolve_mode("disabled", no_key) == "disabled"
    assert resolve_mode(None, {**no_key, "WANDB_MODE": "disabled"}) == "disabled"
    assert resolve_mode(None, {**no_key, "WANDB_MODE": "dryrun"}) == "offline"
    assert resolve_mode("online", no_key) == "offline"  # online without a key: offline, with a warning
    with_key = {**no_key, "WANDB_API_KEY": "x" * 40}
    assert has_api_key(with_key) and not has_api_key(no_key)
    assert resolve_mode("online", with_key) == "online"
    assert resolve_mode(None, {**with_key, "WANDB_MODE": "online"}) == "online"
    assert resolve_mode(None, with_key) == "offline"  # a key alone does not switch a run online


def test_scrub_secrets():
    tree = {
        "a": 1,
        "API_KEY": "x",
        "nested": [{"token": 1, "b": 2}],
        "db_password": "p",
        "keep": {"secret_sauce": 1, "c": (1, 2)},
    }
    assert scrub_secrets(tree) == {"a": 1, "nested": [{"b": 2}], "keep": {"c": (1, 2)}}


def test_every_option_is_a_wandb_init_argument():
    params = inspect.signature(wandb.init).parameters
    for field in WandbOptions.model_fields:
        assert field in params, field
        assert WandbOptions.model_fields[field].description, field


def test_registers_as_wandb():
    registered = []
    mineonline_wandb.mineonline_register_loggers(registered.append)
    assert registered == [WandbLogger] and WandbLogger.name == "wandb"
    import subprocess

    # Importing the plugin (as plugin discovery does) must not import wandb.
    code = "import sys, mineonline_wandb; print('wandb' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONPATH": ":".join(sys.path)}
    ).stdout.strip()
    assert out == "False"


def test_items_of_one_step_merge_into_one_row():
    class Run:  # records what would reach wandb
        rows: list = []

        def log(self, row):
            self.rows.append(row)

        def finish(self):
            pass

    logger = WandbLogger.__new__(WandbLogger)  # the merging needs only the wandb module and a run
    logger._wandb, logger._row, logger.run = wandb, {}, Run()
    logger.log_metrics({"a": 1.0, "b": 2.0}, 10)
    logger.log_histogram("h", np.arange(100.0), 10)
    logger.log_metrics({"c": 3.0}, 10)
    logger.log_metrics({"a": 4.0}, 10)  # same key, same step (a second producer): a new row keeps both
    logger.log_histogram("empty", np.array([np.nan]), 20)
    logger.log_metrics({"a": 5.0}, 20)
    assert len(logger.run.rows) == 2  # a row goes out as soon as the next item cannot join it
    logger.finish()
    rows = logger.run.rows
    assert [sorted(r) for r in rows] == [["a", "b", "c", "env_steps", "h"], ["a", "env_steps"], ["a", "env_steps"]]
    assert [r["env_steps"] for r in rows] == [10, 10, 20]
    assert [r["a"] for r in rows] == [1.0, 4.0, 5.0]
    assert isinstance(rows[0]["h"], wandb.Histogram)


def test_short_run_through_the_ray_hub_leaves_metrics_video_and_report(offline_env, monkeypatch):
    """The "done when" check: hub actor + console + wandb, a video, then the report."""
    ray = pytest.importorskip("ray")
    from mineonline_core.driver.report import write_report
    from mineonline_core.services.loggerhub import start_logger_hub

    plugin_dir = str(Path(mineonline_wandb.__file__).resolve().parent)
    root = str(Path(__file__).resolve().parents[3])
    # Ray workers inherit the driver's environment: let the hub import the plugin from source.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [plugin_dir, root, os.environ.get("PYTHONPATH")])))
    run_dir = offline_env / "ray-run"
    start_local_cluster(num_cpus=2, include_dashboard=False, namespace="mineonline")
    try:
        hub = start_logger_hub(
            run_name="wandb-e2e",
            run_dir=str(run_dir),
            loggers=[(ConsoleLogger, ConsoleOptions()), (WandbLogger, WandbOptions(project="mineonline-test"))],
            config={"trainer_name": "PPOTrainer"},
            num_iterations=3,
            video_dir="videos",
        )
        for it in range(1, 4):
            hub.add_env_steps.remote(1000)
            hub.log_batch.remote(
                {
                    "trainer/iteration": it,
                    "trainer/policy_loss": 1.0 / it,
                    "episode/return_mean": float(it),
                    "rollout/env_steps_per_s": 500.0,
                },
                {"trainer/advantages": np.linspace(-1, 1, 64)},
            )
        frames = [np.full((16, 16, 3), 20 * t, np.uint8) for t in range(6)]
        hub.log_video.remote("video/worker_0", encode_episode_video(frames, fps=3, returns=[0.0] * 6, upscale=2))
        summary = ray.get(hub.finish.remote())
        assert summary["logger/errors"] == 0.0 and summary["env_steps"] == 3000.0
    finally:
        ray.shutdown()
    offline_run = offline_run_dir(run_dir)
    data = run_file_bytes(offline_run)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    jsonl_names = set().union(*records) - {"step", "time", "video", "path"}
    for name in jsonl_names - {"trainer/advantages/mean", "trainer/advantages/std"}:
        assert name.encode() in data, name  # the same metric names in wandb and in the JSONL
    assert list((offline_run / "files" / "media" / "videos").rglob("*.mp4"))
    assert (run_dir / "videos" / "video_worker_0_step000003000.mp4").stat().st_size > 200
    assert {p.name for p in write_report(run_dir)} >= {
        "report_learning_curve.png",
        "report_losses.png",
        "report_throughput.png",
    }


def test_a_resumed_run_reopens_its_wandb_run(offline_env):
    """The run id is stored in the run directory; a run resumed from a checkpoint logs to the same run."""
    run_dir = offline_env / "run"
    first = WandbLogger(
        run_dir=str(run_dir), options=WandbOptions(project="p"), config={"train_config": {"resume": None}}
    )
    first.log_metrics({"episode/return_mean": 1.0}, 100)
    first.finish()
    resumed = WandbLogger(
        run_dir=str(run_dir),
        options=WandbOptions(project="p"),
        config={"train_config": {"resume": str(run_dir / "checkpoints" / "checkpoint_000002")}},
    )
    resumed.log_metrics({"episode/return_mean": 2.0}, 200)
    resumed.finish()
    assert resumed.run.id == first.run.id
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(p.name.split("-")[3] == first.run.id for p in offline)  # `wandb sync` merges them
    fresh = WandbLogger(run_dir=str(run_dir), options=WandbOptions(project="p"), config={"train_config": {}})
    fresh.finish()
    assert fresh.run.id != first.run.id  # only a resume reopens the stored run
