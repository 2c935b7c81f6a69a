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
from pathlib import Path

import pytest

from mineonline_core.errors import MineOnlineError
from mineonline_core.lifecycle import stop_runs

ROOT = Path(__file__).resolve().parents[2]

DRIVER_1 = textwrap.dedent(
    """
    import sys, ray
    from mineonline_core.lifecycle import attach

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
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return _python("-m", "mineonline_core.cli", *args)


def _alive(run: str) -> set[str]:
    import ray

    return {e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
            if e["namespace"] == "mineonline" and e["name"].startswith(run + "/")}  # fmt: skip


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
    assert "workers=2" in lines[0] and "buffer=12" in lines[0] and "version=7" in lines[0] and "env_steps=4096" in lines[0]
    assert "logger_hub" in lines[0] and "rollout_manager" in lines[0]

    stop = _cli("stop", "alpha", "--address", ray_cluster)
    assert stop.returncode == 0, stop.stderr[-2000:]
    assert "alpha: stopped" in stop.stdout
    assert _alive("alpha") == set()
    assert _alive("beta") == {"beta/rollout_manager", "beta/logger_hub"}  # another run is untouched

    with pytest.raises(MineOnlineError, match=r"stop gamma: no run of that name.*alive runs: beta"):
        stop_runs("gamma", address=ray_cluster)  # this process is attached already: in-process is enough

    stop_all = _cli("stop", "--address", ray_cluster)
    assert stop_all.returncode == 0 and "beta: stopped" in stop_all.stdout
    assert _alive("beta") == set()


def test_auth_mode_is_set_only_when_a_token_exists(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from mineonline_core import lifecycle

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
