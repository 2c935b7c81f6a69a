"""Packaging as users get it: a wheel of every distribution, installed (not editable) into a fresh venv.

Everything else in the suite runs against the editable installs of ``make install``, which see every
file of the checkout whether a distribution ships it or not. Here each distribution is built into a
wheel from a copy of its own folder, the wheels go into a new virtual environment with their declared
dependencies only (torch first, the CPU build from the local wheel, so nothing pulls CUDA; pip's cache
makes the rest quick), and, from a directory outside the checkout, ``mineonline plugins`` must list
every component and a two-iteration CartPole run through the LMDB store must complete and evaluate.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml"))
EXAMPLES = [ROOT / "examples" / "custom_trainer"]
CORE_FILES = ("pyproject.toml", "README.md", "mineonline_core")
TORCH = "torch==2.13.0"  # the Makefile's pin: the CPU wheel on this machine's local index


def _run(command: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{' '.join(map(str, command))} exited with {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


def _copy_sources(dest: Path) -> list[Path]:
    """Each distribution's own folder, copied: a wheel must not depend on the rest of the checkout."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "tests")
    core = dest / "mineonline-core"
    core.mkdir(parents=True)
    for name in CORE_FILES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, core / name, ignore=ignore)
        else:
            shutil.copy2(source, core / name)
    copies = [core]
    for folder in [*PLUGINS, *EXAMPLES]:
        copies.append(dest / folder.name)
        shutil.copytree(folder, copies[-1], ignore=ignore)
    return copies


def test_wheels_install_into_a_fresh_venv_and_train(tmp_path: Path) -> None:
    started = time.monotonic()
    wheels = tmp_path / "wheels"
    sources = _copy_sources(tmp_path / "src")
    # The build backend (setuptools) comes from this venv: no download, no isolated build env.
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            *map(str, sources),
        ],
        cwd=tmp_path,
    )
    built = sorted(p.name.split("-")[0] for p in wheels.glob("*.whl"))
    assert len(built) == len(sources), built
    built_s = time.monotonic() - started

    venv = tmp_path / "venv"
    base_python = getattr(sys, "_base_executable", sys.executable)
    _run([base_python, "-m", "venv", str(venv)], cwd=tmp_path)
    # No byte-compiling: torch and ray hold thousands of modules, and only a few run here.
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check"]
    _run([*pip, TORCH], cwd=tmp_path)
    _run([*pip, "torch>=2.3", *map(str, sorted(wheels.glob("*.whl")))], cwd=tmp_path)
    installed_s = time.monotonic() - started - built_s

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", WANDB_MODE="disabled")
    work = tmp_path / "user"  # outside the checkout: only what the wheels installed can be imported
    work.mkdir()
    where = _run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import mineonline_core, mineonline_ppo; print(mineonline_core.__file__); print(mineonline_ppo.__file__)",
        ],
        cwd=work,
        env=env,
    )
    assert all(line.startswith(str(venv)) for line in where.split()), where
    listing = _run([str(venv / "bin" / "mineonline"), "plugins"], cwd=work, env=env)
    for component in (
        "PPOTrainer",
        "VTraceTrainer",
        "ReinforceTrainer",
        "lmdb",
        "memory",
        "wandb",
        "vpt",
        "cnn_gru",
        "crafter",
        "gymnasium",
    ):
        assert component in listing, listing
    assert "failed to load" not in listing, listing
    assert "mineonline-ppo 0.1.0" in listing and "mineonline-lmdb-buffer 0.1.0" in listing

    shutil.copy2(ROOT / "examples" / "cartpole.yaml", work / "cartpole.yaml")
    overrides = [
        "run_name=wheel",
        "train_config.num_iterations=2",
        "train_config.save_interval=2",
        "rollout_config.replay_buffer_config.database_config.backend=lmdb",
    ]
    out = _run(
        [str(venv / "bin" / "mineonline"), "run", "cartpole.yaml", *overrides, "--no-progress"], cwd=work, env=env
    )
    assert "run wheel completed" in out, out[-2000:]
    assert (work / "runs" / "wheel" / "checkpoints" / "checkpoint_000002" / "manifest.json").is_file()
    assert (work / "runs" / "wheel" / "replay_buffer" / "mineonline-store.json").is_file()
    out = _run(
        [str(venv / "bin" / "mineonline"), "eval", "runs/wheel", "--episodes", "2", "--no-progress"], cwd=work, env=env
    )
    assert "2 episodes of" in out
    print(
        f"FIGURE wheels built in {built_s:.0f}s, fresh venv installed in {installed_s:.0f}s, "
        f"whole test {time.monotonic() - started:.0f}s"
    )
