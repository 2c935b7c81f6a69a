"""``mineonline status`` / ``mineonline stop`` from a second driver, with Ray token auth on.

Driver 1 (a subprocess) starts a detached run's actors and exits, like ``mineonline run`` with
``detach_rollout_manager``; driver 2 is the real CLI in another subprocess; this process checks.
Neither subprocess inherits ``RAY_AUTH_MODE``: attaching with the cluster's token is the CLI's job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mineonline_core.driver.lifecycle import stop_runs
from mineonline_core.errors import MineOnlineError
from mineonline_core.testing.envs import PACED_CARTPOLE

ROOT = Path(__file__).resolve().parents[2]

DRIVER_1 = textwrap.dedent(
    """
    import sys, ray
    from mineonline_core.driver.lifecycle import attach

    assert attach(sys.argv[1])

    @ray.remote(num_cpus=0)
    class FakeManager:
        def __init__(self):
            self.stop = False
        def status(self):
            return {"run_name": "?", "version": 7, "env_steps": 4096, "buffer_size": 12,
                    "workers": [{"id": 0}, {"id": 1}]}
        def request_stop(self):
            self.stop = True
        def stop_requested(self):
            return self.stop
        def shutdown(self):
            return None

    @ray.remote(num_cpus=0)
    class FakeHub:
        def latest(self):
            return {}

    for run in sys.argv[2:]:
        m = FakeManager.options(name=run + "/rollout_manager", lifetime="detached").remote()
        h = FakeHub.options(name=run + "/logger_hub", lifetime="detached").remote()
        ray.get([m.status.remote(), h.latest.remote()])
        print("started", run)
    """
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def _cli(*args: str) -> subprocess.CompletedProcess:
    return _python("-m", "mineonline_core.cli", *args)


def _alive(run: str) -> set[str]:
    import ray

    return {
        e["name"]
        for e in ray.util.list_named_actors(all_namespaces=True)
        if e["namespace"] == "mineonline" and e["name"].startswith(run + "/")
    }


def test_no_cluster_gives_a_message_not_a_hang(unused_port: int, capsys: pytest.CaptureFixture) -> None:
    # Runs before the module's cluster starts (file order), so this process is not connected yet.
    address = f"127.0.0.1:{unused_port}"
    status = _cli("status", "--address", address)
    assert status.returncode == 0 and "no Ray cluster is running" in status.stdout
    assert "Traceback" not in status.stderr
    assert stop_runs(None, address=address) == 2
    assert "nothing to stop" in capsys.readouterr().err


def test_second_driver_sees_and_stops_detached_run(ray_cluster: str) -> None:
    started = _python("-c", DRIVER_1, ray_cluster, "alpha", "beta")
    assert started.returncode == 0, started.stderr[-2000:]
    assert _alive("alpha") == {"alpha/rollout_manager", "alpha/logger_hub"}

    status = _cli("status", "--address", ray_cluster)
    assert status.returncode == 0, status.stderr[-2000:]
    lines = [line for line in status.stdout.splitlines() if line.startswith(("alpha", "beta"))]
    assert len(lines) == 2, status.stdout
    assert (
        "workers=2" in lines[0] and "buffer=12" in lines[0] and "version=7" in lines[0] and "env_steps=4096" in lines[0]
    )
    assert "logger_hub" in lines[0] and "rollout_manager" in lines[0]

    stop = _cli("stop", "alpha", "--address", ray_cluster)
    assert stop.returncode == 0, stop.stderr[-2000:]
    assert "alpha: stopped" in stop.stdout
    assert _alive("alpha") == set()
    assert _alive("beta") == {"beta/rollout_manager", "beta/logger_hub"}  # another run is untouched

    with pytest.raises(MineOnlineError, match=r"stop gamma: no run of that name.*alive runs: beta"):
        stop_runs("gamma", address=ray_cluster)  # this process is attached already: in-process is enough

    # Two alive runs and no name: refused, naming both, nothing stopped; --all stops both.
    assert _python("-c", DRIVER_1, ray_cluster, "delta").returncode == 0
    refused = _cli("stop", "--address", ray_cluster)
    assert refused.returncode != 0 and "2 runs are alive on this cluster (beta, delta)" in refused.stderr, (
        refused.stderr[-2000:]
    )
    assert _alive("beta") and _alive("delta")
    stop_all = _cli("stop", "--all", "--address", ray_cluster)
    assert stop_all.returncode == 0 and "beta: stopped" in stop_all.stdout and "delta: stopped" in stop_all.stdout
    assert _alive("beta") == set() and _alive("delta") == set()


def test_auth_mode_is_set_only_when_a_token_exists(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from mineonline_core.driver import lifecycle

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    lifecycle.prepare_auth_env()
    assert "RAY_AUTH_MODE" not in os.environ
    (tmp_path / "token").write_text("a" * 32)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
    lifecycle.prepare_auth_env()
    assert os.environ["RAY_AUTH_MODE"] == "token"
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # an explicit choice is never changed
    lifecycle.prepare_auth_env()
    assert os.environ["RAY_AUTH_MODE"] == "token"


@pytest.fixture
def unused_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


REAL_RUN = {
    "run_name": "stop-me",
    "seed": 0,
    "detach_rollout_manager": True,
    "env_config": {"name": "gymnasium", "id": PACED_CARTPOLE},
    "policy_config": {"name": "mlp"},
    "logger_config": {"loggers": []},
    "rollout_config": {
        "num_rollout_workers": 1,
        "num_cpus_per_worker": 0.25,
        "fragment_length": 16,
        "worker_config": {"num_envs": 2, "batch_size": 2},
        "replay_buffer_config": {"max_chunks": 64, "fragments_per_chunk": 1},
    },
    "train_config": {
        "num_workers": 1,
        "num_cpus_per_worker": 0.25,
        # Stopped by the tests, never completed: beside two CPU burners a run of 1,000 iterations finished in
        # 69 s, before the `status` and `stop` CLI calls, each paying its imports on the busy machine, reached it.
        "num_iterations": 100_000,
        "batches_per_iteration": 1,
        "gradient_accumulation": 1,
        "batch_size_per_gpu": 2,
        "context_length": 16,
        "epochs_per_iteration": 1,
        "save_interval": 1000,
        "keep_interval": 1000,
    },
}


def test_stop_a_real_run_from_a_second_driver(ray_cluster: str, tmp_path: Path) -> None:
    """A real ``mineonline run --address`` joins the cluster; ``status`` shows it; ``stop`` makes its
    trainer write a final checkpoint at the current iteration and its driver end every actor."""
    import yaml

    from mineonline_core.trainer.checkpoint import list_checkpoints

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**REAL_RUN, "output_dir": str(tmp_path / "runs")}))
    run_dir = tmp_path / "runs" / "stop-me"
    log = open(tmp_path / "driver.log", "w")
    driver = subprocess.Popen(
        [sys.executable, "-m", "mineonline_core.cli", "run", str(config), "--address", ray_cluster, "--no-progress"],
        cwd=ROOT,
        env={**_env(), "WANDB_MODE": "disabled"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        line, version_seen = "", 0
        end = time.monotonic() + 400
        # version=0 is the initial weights, listed before the first update: wait for a trained version.
        while version_seen < 1 and time.monotonic() < end:
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            status = _cli("status", "--address", ray_cluster)
            line = next((x for x in status.stdout.splitlines() if x.startswith("stop-me")), "")
            if "rollout_worker_0" in line and "version=" in line:
                version_seen = int(line.split("version=")[1].split()[0])
            if version_seen < 1:
                time.sleep(1.0)  # polling the run's progress
        assert "workers=1" in line and "rollout_worker_0" in line and "logger_hub" in line, line
        assert version_seen >= 1, line

        stopped = _cli("stop", "stop-me", "--address", ray_cluster, "--grace", "90")
        assert stopped.returncode == 0, stopped.stderr[-2000:]
        assert "stop-me: stopped by its driver (final checkpoint written)" in stopped.stdout, stopped.stdout
        assert driver.wait(timeout=120) == 130  # stopped with a final checkpoint: not a completed run
    finally:
        if driver.poll() is None:
            driver.kill()
        log.close()
    assert "run stop-me interrupted" in (tmp_path / "driver.log").read_text()
    assert _alive("stop-me") == set()
    (iteration, _), *_ = reversed(list_checkpoints(run_dir / "checkpoints"))
    assert iteration >= version_seen  # the final checkpoint holds the iteration the run had reached
    print(
        f"FIGURE stop from a second driver: run at version >= {version_seen}, "
        f"final checkpoint {iteration}, 0 actors left"
    )


def test_a_run_directory_names_its_run_and_the_cluster_it_recorded(tmp_path: Path, monkeypatch) -> None:
    """What `status RUN_DIR` and `stop RUN_DIR` mean (``run_target``): the run named in its run.json, on the cluster
    the run recorded there (``record_cluster``, as `run` does once Ray is up), never the one `auto` picks; an
    --address given wins; a bare name is looked for under runs/; a run that recorded none, or no run, means `auto`.
    The whole path, a run on its own cluster stopped by its directory, is the test below."""
    import json

    from mineonline_core.driver.lifecycle import run_target
    from mineonline_core.driver.rundir import RUN_FILE, record_cluster

    run_dir = tmp_path / "runs" / "alone"
    run_dir.mkdir(parents=True)
    (run_dir / RUN_FILE).write_text(json.dumps({"run_name": "alone", "source_path": None, "overrides": []}))
    assert run_target(str(run_dir), None) == ("alone", "auto")  # started, not yet on a cluster
    record_cluster(run_dir, "127.0.0.1:6390")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6391")  # where `auto` would look
    assert run_target(str(run_dir), None) == ("alone", "127.0.0.1:6390")
    assert run_target("alone", None) == ("alone", "127.0.0.1:6390")  # runs/alone
    assert run_target(str(run_dir), "10.0.0.2:6379") == ("alone", "10.0.0.2:6379")
    assert run_target("other", None) == ("other", "auto")


def test_a_run_on_its_own_cluster_is_found_by_its_directory_and_stops_cleanly(tmp_path: Path, unused_port: int) -> None:
    """`mineonline run` without --address starts a cluster of its own, and records its address in run.json;
    `status RUN_DIR` and `stop RUN_DIR` reach that cluster, not the one `auto` picks (here RAY_ADDRESS
    names another, as in a shell set up for another project). Stop returns as the run ends its actors and its cluster, exit 0 (was: a minute
    waiting for the gone GCS, then exit 1 with "Failed to connect to GCS"); the run exits 130."""
    import json

    import yaml

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**REAL_RUN, "run_name": "alone", "output_dir": str(tmp_path / "runs")}))
    run_dir = tmp_path / "runs" / "alone"
    log = open(tmp_path / "driver.log", "w")
    driver = subprocess.Popen(
        [sys.executable, "-m", "mineonline_core.cli", "run", str(config), "--no-progress"],
        cwd=ROOT,
        env={**_env(), "WANDB_MODE": "disabled"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        end = time.monotonic() + 400
        while (
            not (run_dir / "metrics.jsonl").is_file()
            or '"trainer/iteration"' not in (run_dir / "metrics.jsonl").read_text()
        ):
            assert driver.poll() is None and time.monotonic() < end, (tmp_path / "driver.log").read_text()[-3000:]
            time.sleep(1.0)  # polling the run's progress
        recorded = json.loads((run_dir / "run.json").read_text())["ray_address"]
        elsewhere = {**_env(), "RAY_ADDRESS": f"127.0.0.1:{unused_port}"}  # where `auto` would look

        def cli(*args: str) -> subprocess.CompletedProcess:
            command = [sys.executable, "-m", "mineonline_core.cli", *args]
            return subprocess.run(command, cwd=ROOT, env=elsewhere, capture_output=True, text=True, timeout=150)

        status = cli("status", str(run_dir))
        assert status.returncode == 0 and status.stdout.startswith("alone "), status.stdout + status.stderr[-2000:]
        stopped = cli("stop", str(run_dir), "--grace", "90")
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr[-2000:]
        assert "alone: stopped by its driver (final checkpoint written)" in stopped.stdout, stopped.stdout
        assert "GCS" not in stopped.stderr, stopped.stderr[-2000:]
        assert driver.wait(timeout=120) == 130
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, 9)  # the session this test started
        log.close()
    gone = _cli("stop", str(run_dir))
    assert gone.returncode == 2 and f"no Ray cluster is running at {recorded!r}" in gone.stderr, gone.stderr


_EXIT_AFTER_STOP = """
import atexit, sys, time
# Stands for Ray's teardown at exit waiting on the GCS of a cluster that went away with the stopped run.
atexit.register(time.sleep, 600)
sys.argv = ["mineonline", "stop", "--grace", "-1"]
from mineonline_core.cli import entry
entry()
"""


def test_stop_exits_without_the_interpreters_teardown_and_its_output_flushed() -> None:
    """The cluster `stop` attached to often ends with the run it stopped: Ray's teardown at exit then waits a
    minute for the gone GCS and ends the process with exit 1, its printed result unflushed (beside two CPU
    burners). `stop` exits as `run` does, after flushing, without the teardown."""
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_AFTER_STOP], check=False, capture_output=True, text=True, timeout=90, env=_env()
    )  # 90 s: a hang guard for this check, which takes a second; the teardown it replaces waits 600
    assert done.returncode == 2 and "--grace=-1.0 is negative" in done.stderr, done.stderr[-2000:]


def test_stop_returns_when_the_cluster_goes_away_during_its_actor_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stopped run's driver ends its own cluster while `stop` is reading the actor list: that call to the
    gone GCS never answers (Ray's client gives up after a minute and ends the process with exit 1, as in a CI
    run), so the wait must see the GCS port close and return. A real listening socket stands for the GCS."""
    import socket
    import threading
    from types import SimpleNamespace

    import ray

    from mineonline_core.driver import lifecycle

    gcs = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{gcs.getsockname()[1]}"
    called, never = threading.Event(), threading.Event()

    def frozen_list(**_: object) -> list:
        called.set()
        never.wait()  # the call in flight when the GCS went away
        return []

    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address=address))
    monkeypatch.setattr(ray.util, "list_named_actors", frozen_list)
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(lifecycle._wait_gone(["mineonline/r/x"], 120)), daemon=True)
    waiter.start()
    try:
        assert called.wait(60)
        gcs.close()
        waiter.join(30)
        assert result == [True], "stop kept waiting on a call to the gone GCS"
    finally:
        never.set()


@pytest.mark.parametrize("command", ["status", "stop", "run"])
def test_a_wrong_token_is_named_with_where_it_was_read_from(ray_cluster: str, tmp_path: Path, command: str) -> None:
    """The cluster rejects the driver's token: one line saying so and where the token came from, no C++
    warnings (Ray's client retried for 20 s, one each second), no traceback, not "no cluster runs"."""
    env = {**_env(), "RAY_AUTH_TOKEN": "0" * 64}
    args = {
        "status": ["status"],
        "stop": ["stop"],
        "run": ["run", str(ROOT / "examples" / "cartpole.yaml"), f"output_dir={tmp_path}", "--no-progress"],
    }[command]
    done = subprocess.run(
        [sys.executable, "-m", "mineonline_core.cli", *args, "--address", ray_cluster],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    message, *rest = done.stderr.strip().splitlines()
    assert message == (
        f"error: the cluster at {ray_cluster} rejected this token (read from the RAY_AUTH_TOKEN environment variable). "
        "Fix: give this driver the token of the cluster's head node (its ~/.ray/auth_token): copy the file here, point "
        "RAY_AUTH_TOKEN_PATH at it, or set RAY_AUTH_TOKEN."
    )
    assert rest == ([] if command != "run" else [f"(full log: {next(tmp_path.glob('run-*'))}/run.log)"])
    assert "no Ray cluster is running" not in done.stdout
