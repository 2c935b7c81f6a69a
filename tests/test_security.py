"""Security meta-tests over the repository's own files, plus the two runtime promises that are cheap
to check without a cluster: the dashboard binds to localhost, and no secret reaches the run directory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cartpole_config

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".venv-bench", ".venv", ".git", "runs", "build", "dist", "__pycache__", "node_modules", ".hypothesis"}
THIS = Path(__file__).resolve()
# Patterns are assembled from pieces so that this file does not match itself.
PICKLE_LOAD = re.compile(r"(?<![\w.])pickle\.load" + r"s?\(")
UNPICKLER_SUBCLASS = re.compile(r"class\s+\w+\(\s*(?:pickle\.)?Unpick" + r"ler\s*\)")
TORCH_LOAD = re.compile(r"\btorch\.lo" + r"ad\(")
KILL_BY_NAME = re.compile(r"\b(?:pk" + r"ill|kill" + r"all)\b")
DEBUGGER = re.compile(r"\bbreak" + r"point\(\)|\bimport\s+p" + r"db\b|\bp" + r"db\.set_trace\(")
AUTH_OFF = re.compile(r"RAY_AUTH_MODE['\"]?\s*[\]:=,]\s*['\"]?dis" + r"abled")


def _project_files() -> list[Path]:
    """The project's own files: what git tracks or would track (ignored venvs and runs are not ours)."""
    try:
        listed = (
            subprocess.run(
                ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                cwd=ROOT,
                capture_output=True,
                check=True,
                timeout=60,
            )
            .stdout.decode()
            .split("\0")
        )
        paths = [ROOT / name for name in listed if name]
    except (OSError, subprocess.SubprocessError):
        paths = list(ROOT.rglob("*"))
    return [
        p
        for p in paths
        if not any(part in SKIP_DIRS or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)
    ]


def _files(*suffixes: str, names: tuple[str, ...] = ()) -> list[Path]:
    return sorted(p for p in FILES if p.is_file() and p.resolve() != THIS and (p.suffix in suffixes or p.name in names))


FILES = _project_files()
PY = _files(".py")
# Code that runs in a user's process (tests may round-trip their own objects through pickle).
RUNTIME = [p for p in PY if "tests" not in p.relative_to(ROOT).parts and not p.name.startswith("test_")]
CODE = _files(".py", ".sh", ".toml", ".yaml", ".yml", ".cfg", names=("Makefile",))


def _hits(pattern: re.Pattern, files: list[Path]) -> list[str]:
    hits = []
    for path in files:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line) and not line.lstrip().startswith("#"):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return hits


def _call_text(source: str, start: int) -> str:
    """The text of the call whose '(' is at or after ``start``, up to its matching ')'."""
    depth, i = 0, source.index("(", start)
    for j in range(i, len(source)):
        depth += {"(": 1, ")": -1}.get(source[j], 0)
        if depth == 0:
            return source[start : j + 1]
    return source[start:]


def test_the_scan_sees_the_project() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PY}
    assert "mineonline_core/driver/api.py" in names and "mineonline_core/driver/lifecycle.py" in names
    assert len(PY) >= 40


def test_no_pickle_load_in_runtime_code() -> None:
    assert len(RUNTIME) >= 30
    assert _hits(PICKLE_LOAD, RUNTIME) == []


def test_only_the_vpt_restricted_unpickler_subclasses_unpickler() -> None:
    hits = _hits(UNPICKLER_SUBCLASS, RUNTIME)
    assert all(h.startswith("plugins/vpt_policy/") for h in hits), hits
    assert len(hits) <= 1, hits


def test_every_torch_load_is_weights_only() -> None:
    bad = []
    for path in PY:
        source = path.read_text(errors="replace")
        for match in TORCH_LOAD.finditer(source):
            call = _call_text(source, match.start())
            # A test that shows what a malicious file would do loads it unsafely on purpose, and says so.
            deliberate = (
                "tests" in path.relative_to(ROOT).parts
                and "# unsafe on purpose" in source[match.start() : match.start() + len(call) + 40]
            )
            if not re.search(r"weights_only\s*=\s*True", call) and not deliberate:
                line = source.count("\n", 0, match.start()) + 1
                bad.append(f"{path.relative_to(ROOT)}:{line}: {call[:120]}")
    assert bad == []


def test_no_process_killing_by_name() -> None:
    assert _hits(KILL_BY_NAME, CODE) == []


def test_no_debugger_traps() -> None:
    assert _hits(DEBUGGER, PY) == []


def test_ray_token_authentication_is_never_turned_off() -> None:
    assert _hits(AUTH_OFF, CODE) == []


def test_dashboard_binds_to_localhost(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from mineonline_core.driver import api

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    api.init_ray(None, num_cpus=1)
    (kwargs,) = calls
    assert kwargs["address"] == "local"
    assert kwargs.get("include_dashboard") is False or kwargs.get("dashboard_host") == "127.0.0.1"
    assert kwargs.get("dashboard_host", "127.0.0.1") == "127.0.0.1"
    assert _hits(re.compile(r"dashboard_host\s*=\s*['\"]0\.0\.0\.0"), PY) == []


SECRET = "sk-0123456789abcdef-DO-NOT-LEAK"
OTHER_SECRET = "hunter2-DO-NOT-LEAK"


def _vault_logger() -> type:
    """A third-party logger whose options include a credential, registered like any plugin."""
    from pydantic import BaseModel, ConfigDict

    from mineonline_core.contracts.logger import Logger

    class VaultOptions(BaseModel):
        model_config = ConfigDict(extra="ignore")
        api_token: str | None = None

    return type(
        "VaultLogger", (Logger,), {"name": "vault", "Config": VaultOptions, "log_metrics": lambda self, m, s: None}
    )


@pytest.fixture
def vault_pm():
    from mineonline_core import hookimpl
    from mineonline_core.registry import get_plugin_manager
    from mineonline_core.testing.fixtures import registered

    class Plugin:
        @hookimpl
        def mineonline_register_loggers(self, register):
            register(_vault_logger())

    pm = get_plugin_manager()
    with registered(pm, Plugin()):
        yield pm


def test_no_secret_reaches_the_run_directory(tmp_path: Path, vault_pm) -> None:
    import yaml

    from mineonline_core.driver import api
    from mineonline_core.config import load_config
    from mineonline_core.config.secrets import public_config
    from mineonline_core.driver.resolve import resolve

    source = tmp_path / "cfg.yaml"
    source.write_text(
        yaml.safe_dump(
            cartpole_config(
                run_name="secret-run",
                output_dir=str(tmp_path / "runs"),
                logger_config={"loggers": ["vault"], "project": "p", "api_token": SECRET},
            )
        )
    )
    override = f"logger_config.api_token={OTHER_SECRET}"
    resolved = resolve(load_config(source, [override]), vault_pm)
    assert resolved.loggers[-1][1].api_token == OTHER_SECRET  # the run itself gets the value
    public = public_config(resolved.config)
    assert public["logger_config"]["api_token"] == "<redacted>"
    run_dir = api._prepare_run_dir(resolved, overrides=[override])
    written = {p.name: p.read_text() for p in run_dir.rglob("*") if p.is_file()}
    assert {"config.yaml", "run.json", "source_config.txt"} <= set(written)
    leaked = [name for name, text in written.items() if SECRET in text or OTHER_SECRET in text]
    assert leaked == [], f"a secret was written to {leaked}"
    assert json.loads(written["run.json"])["overrides"] == ["logger_config.api_token=<redacted>"]


def test_no_secret_reaches_checkpoints(tmp_path: Path, vault_pm) -> None:
    """Checkpoints keep the resolved config and the config file as written: both scrubbed."""
    import yaml

    from mineonline_core.driver import api
    from mineonline_core.config import load_config
    from mineonline_core.driver.resolve import resolve
    from mineonline_core.trainer import checkpoint as ckpt
    from mineonline_ppo import PPOTrainer
    from mineonline_core.trainer.loop import TrainLoop

    data = cartpole_config(logger_config={"loggers": ["vault"], "api_token": SECRET})
    resolved = resolve(load_config(data), vault_pm, probe=False)
    assert resolved.source_text is None and api._public_source(resolved) is None
    resolved.source_text = f'online_dict = {{"logger_config": {{"api_token": "{SECRET}"}}}}\n'
    text = api._public_source(resolved)
    assert SECRET not in text and '"api_token": "<redacted>"' in text
    trainer = TrainLoop(
        algorithm=PPOTrainer,
        rollout_manager=None,
        policy_generator=resolved.policy_generator,
        env_generator=resolved.env_generator,
        config=resolved.config,
        run_dir=str(tmp_path),
        whole_config=resolved.source_text,
    )
    saved = ckpt.save_checkpoint(
        tmp_path / "ck",
        iteration=1,
        model_state={},
        optimizer_state={},
        scaler_state=None,
        trainer_state={"version": 0},
        config_yaml=yaml.safe_dump(trainer.saved_config),
        source_text=trainer.whole_config,
    )
    files = {p.name: p.read_bytes() for p in saved.iterdir()}
    assert "source_config.txt" in files and "config.yaml" in files
    assert [name for name, raw in files.items() if SECRET.encode() in raw] == []
    assert ckpt.verify_checkpoint(saved) == saved


def test_environment_variables_are_saved_as_the_expression(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``${oc.env:X}`` is resolved for the run but written as the expression: config.yaml, checkpoints and
    ``mineonline check``'s output never copy the environment."""
    import yaml

    from mineonline_core.driver import api
    from mineonline_core.config import load_config
    from mineonline_core.config.secrets import public_config
    from mineonline_core.registry import get_plugin_manager
    from mineonline_core.driver.resolve import resolve

    monkeypatch.setenv("MINEONLINE_TEST_PRIVATE", "private-value-from-env")
    source = tmp_path / "cfg.yaml"
    source.write_text(
        "run_name: env-run\n"
        f"output_dir: {tmp_path / 'runs'}\n"
        "env_config: {name: gymnasium, id: CartPole-v1}\n"
        "policy_config: {name: mlp}\n"
        "logger_config: {loggers: [], project: '${oc.env:MINEONLINE_TEST_PRIVATE}'}\n"
    )
    loaded = load_config(source, ["train_config.save_path=${oc.env:MINEONLINE_TEST_PRIVATE}"])
    assert loaded.config.logger_config.project == "private-value-from-env"  # the run uses the value
    assert loaded.config.train_config.save_path == "private-value-from-env"
    public = public_config(loaded.config)
    assert public["logger_config"]["project"] == "${oc.env:MINEONLINE_TEST_PRIVATE}"
    assert public["train_config"]["save_path"] == "${oc.env:MINEONLINE_TEST_PRIVATE}"
    run_dir = api._prepare_run_dir(resolve(loaded, get_plugin_manager()))
    text = (run_dir / "config.yaml").read_text()
    assert "private-value-from-env" not in text and yaml.safe_load(text)["logger_config"]["project"].startswith(
        "${oc.env:"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "mineonline_core.cli", "check", str(source)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "${oc.env:MINEONLINE_TEST_PRIVATE}" in result.stdout
    assert "private-value-from-env" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "override",
    [
        f"api_key={SECRET}",
        f"logger_config.api_key={SECRET}",
        f"train_config.token={SECRET}",
        f"logger_config.settings.api_key={SECRET}",
        f"logger_config.settings={{api_key: {SECRET}}}",
    ],
)
def test_config_errors_never_echo_a_secret(override: str) -> None:
    from mineonline_core.config import load_config
    from mineonline_core.errors import ConfigError
    from mineonline_core.registry import get_plugin_manager
    from mineonline_core.driver.resolve import resolve

    data = {
        "env_config": {"name": "gymnasium", "id": "CartPole-v1"},
        "policy_config": {"name": "mlp"},
        "logger_config": {"loggers": ["wandb"]},
    }
    with pytest.raises(ConfigError) as info:
        resolve(load_config(data, [override]), get_plugin_manager(), probe=False)
    assert SECRET not in str(info.value) and "<redacted>" in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "override",
    [
        f"logger_config.api_token={SECRET}",
        f"logger_config.settings={{api_key: {SECRET}}}",
        f"logger_config.settings={{console: wrap, auth: {{password: '{SECRET}'}}}}",
        f"env_config.kwargs=[{{token: {SECRET}}}]",
    ],
)
def test_run_json_never_records_a_secret_override(override: str) -> None:
    """The key names the secret, or a mapping in the value does (flow style): either way the override is
    recorded as ``key=<redacted>``, which ``--resume`` asks the user to give again."""
    from mineonline_core.config.secrets import is_redacted_override, redact_override

    recorded = redact_override(override)
    assert SECRET not in recorded and is_redacted_override(recorded)
    assert recorded.split("=", 1)[0] == override.split("=", 1)[0]


@pytest.mark.parametrize("override", ["logger_config.settings={console: wrap}", "a.b=[1, {c: d}]", "x={unclosed"])
def test_other_overrides_are_recorded_as_given(override: str) -> None:
    from mineonline_core.config.secrets import redact_override

    assert redact_override(override) == override


@pytest.mark.parametrize("key", ["base_url", "api_key", "http_proxy", "root_dir", "app_url_override"])
def test_wandb_settings_are_an_allow_list(key: str) -> None:
    """A shared YAML must not redirect where wandb sends the run, nor with which credentials."""
    from mineonline_core.config import load_config
    from mineonline_core.errors import ConfigError
    from mineonline_core.registry import get_plugin_manager
    from mineonline_core.driver.resolve import resolve

    data = {
        "env_config": {"name": "gymnasium", "id": "CartPole-v1"},
        "policy_config": {"name": "mlp"},
        "logger_config": {"loggers": ["wandb"], "settings": {"console": "wrap", key: "https://attacker.example"}},
    }
    with pytest.raises(ConfigError) as info:
        resolve(load_config(data), get_plugin_manager(), probe=False)
    message = str(info.value)
    assert f"settings {key} cannot be set from a config" in message and "WANDB_BASE_URL" in message
    data["logger_config"]["settings"] = {"console": "wrap", "quiet": True}
    resolve(load_config(data), get_plugin_manager(), probe=False)  # display settings stay allowed


def test_a_secret_override_is_not_replayed_by_resume(
    tmp_path: Path, vault_pm, caplog: pytest.LogCaptureFixture
) -> None:
    """run.json keeps ``key=<redacted>``; ``--resume`` drops it with a warning instead of setting the
    credential to the placeholder."""
    from mineonline_core.driver import api
    from mineonline_core.config import load_config
    from mineonline_core.driver.resolve import resolve
    from mineonline_core.driver.resume import plan_resume
    from mineonline_core.trainer import checkpoint as ckpt

    data = {
        "run_name": "r",
        "output_dir": str(tmp_path),
        "env_config": {"name": "gymnasium", "id": "CartPole-v1"},
        "policy_config": {"name": "mlp"},
        "logger_config": {"loggers": ["vault"]},
    }
    overrides = [f"logger_config.api_token={SECRET}", "train_config.learning_rate=1e-3"]
    run_dir = api._prepare_run_dir(resolve(load_config(data, overrides), vault_pm, probe=False), overrides=overrides)
    ckpt.save_checkpoint(
        run_dir / "checkpoints",
        iteration=1,
        model_state={},
        optimizer_state={},
        scaler_state=None,
        trainer_state={},
        config_yaml=(run_dir / "config.yaml").read_text(),
    )
    with caplog.at_level("WARNING", logger="mineonline"):
        plan = plan_resume(str(run_dir), [])
    assert plan.recorded == ["train_config.learning_rate=1e-3"]
    assert any("logger_config.api_token" in r.message and "give it again" in r.message for r in caplog.records)


def test_joining_a_cluster_presents_the_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``mineonline run --address host:port``: Ray itself turns token mode on only for "auto"."""
    import ray

    from mineonline_core.driver import api, lifecycle

    (tmp_path / "token").write_text("t" * 32)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append((kwargs, os.environ.get("RAY_AUTH_MODE"))))
    monkeypatch.setattr(lifecycle, "check_token", lambda address: None)  # no cluster at that address to ask
    api.init_ray("10.0.0.1:6379")
    ((kwargs, mode),) = calls
    assert kwargs["address"] == "10.0.0.1:6379" and mode == "token"
