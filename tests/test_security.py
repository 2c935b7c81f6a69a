"""Security meta-tests over the repository's own files, plus the two runtime promises that are cheap
to check without a cluster: the dashboard binds to localhost, and no secret reaches the run directory.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

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
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                                capture_output=True, check=True, timeout=60).stdout.decode().split("\0")  # fmt: skip
        paths = [ROOT / name for name in listed if name]
    except (OSError, subprocess.SubprocessError):
        paths = list(ROOT.rglob("*"))
    return [p for p in paths if not any(part in SKIP_DIRS or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)]


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
    assert "mineonline_core/api.py" in names and "mineonline_core/lifecycle.py" in names
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
            if not re.search(r"weights_only\s*=\s*True", call):
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

    from mineonline_core import api

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


def test_no_secret_reaches_the_run_directory(tmp_path: Path) -> None:
    import yaml

    from mineonline_core import api
    from mineonline_core.config import load_config
    from mineonline_core.plugins import get_plugin_manager
    from mineonline_core.resolve import resolve

    source = tmp_path / "cfg.yaml"
    source.write_text(yaml.safe_dump({
        "run_name": "secret-run", "output_dir": str(tmp_path / "runs"),
        "env_config": {"name": "gymnasium", "id": "CartPole-v1"}, "policy_config": {"name": "mlp"},
        "logger_config": {"loggers": ["wandb"], "project": "p", "settings": {"api_key": SECRET}},
    }))  # fmt: skip
    resolved = resolve(load_config(source), get_plugin_manager())
    public = api._public_config(resolved.config)
    assert public["logger_config"]["settings"]["api_key"] == "<redacted>"
    assert SECRET not in repr(public)
    run_dir = api._prepare_run_dir(resolved)
    written = {p.name: p.read_text() for p in run_dir.rglob("*") if p.is_file()}
    assert "config.yaml" in written
    leaked = [name for name, text in written.items() if SECRET in text]
    assert leaked == [], f"the secret was written to {leaked}"


def test_no_secret_reaches_checkpoints() -> None:
    """Checkpoints store the resolved config and the config file's text (``whole_config``): both scrubbed."""
    from mineonline_core import api
    from mineonline_core.config import load_config
    from mineonline_core.plugins import get_plugin_manager
    from mineonline_core.resolve import resolve

    data = {"env_config": {"name": "gymnasium", "id": "CartPole-v1"}, "policy_config": {"name": "mlp"},
            "logger_config": {"loggers": ["wandb"], "settings": {"api_key": SECRET}}}  # fmt: skip
    resolved = resolve(load_config(data), get_plugin_manager(), probe=False)
    assert resolved.source_text is None and api._public_source(resolved) is None
    trainer = api._trainer(resolved, manager=None, hub=None)
    assert SECRET not in repr(trainer.saved_config) and trainer.whole_config is None
    resolved.source_text = f'online_dict = {{"logger_config": {{"settings": {{"api_key": "{SECRET}"}}}}}}\n'
    text = api._public_source(resolved)
    assert SECRET not in text and '"api_key": "<redacted>"' in text


def test_joining_a_cluster_presents_the_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``mineonline run --address host:port``: Ray itself turns token mode on only for "auto"."""
    import ray

    from mineonline_core import api

    (tmp_path / "token").write_text("t" * 32)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append((kwargs, os.environ.get("RAY_AUTH_MODE"))))
    api.init_ray("10.0.0.1:6379")
    (kwargs, mode), = calls
    assert kwargs["address"] == "10.0.0.1:6379" and mode == "token"
