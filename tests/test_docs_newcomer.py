"""The docs' slow blocks (the README's newcomer path, the trainer tutorial's install and run) run in CI.

``tests/test_docs.py`` runs them only with ``MINEONLINE_DOCS_SLOW=1``, at full length. This test runs
every command of every ``runnable slow`` block, in order, as written, with changes that keep the
suite short and the checkout clean, each made by a shell function defined before the block:

- ``mineonline run`` gets overrides appended that shrink an iteration (two envs, one minibatch of two
  16-step chunks, one epoch), never the number of iterations, so a resume still continues from where the
  first run stopped; ``make demo`` gets the same through ``DEMO_OVERRIDES``, and uses the Python
  that runs this test (``-o install``: the environment is already installed).
- ``mineonline tune`` gets the same overrides and three iterations per trial: what a sweep block shows
  (trials, the table, the searcher) does not depend on its length, and its four trials of twenty
  iterations were the suite's slowest test (518 s beside three other workers).
- ``pip install`` installs into a throwaway venv layered over this one (a ``.pth`` adds its
  site-packages), offline, so the example plugin never lands in the shared environment, and the
  ``mineonline`` that follows runs from that venv, so it sees the plugin.
- The blocks run in a temporary directory holding links to the checkout's ``Makefile`` and
  ``examples/``, so their ``runs/`` never touch the checkout's.

A failure prints the block's output with the command that failed (``bash -x``).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.test_docs import ROOT, RUNNABLE, Block, _env
from tests.test_tune_current import check_optuna_sweep

SLOW_BLOCKS = [block for block in RUNNABLE if block.slow]
# Smaller iterations, same count: enough to train, checkpoint, resume and evaluate for real.
SHRINK = [
    "rollout_config.worker_config.num_envs=2",
    "rollout_config.worker_config.batch_size=2",
    "train_config.batch_size_per_gpu=2",
    "train_config.batches_per_iteration=1",
    "train_config.epochs_per_iteration=1",
    "rollout_config.fragment_length=16",
    "train_config.context_length=16",
]


def _overlay_venv(where: Path) -> Path:
    """A venv whose interpreter also sees this environment's packages; what pip installs lands in it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(where), "platbase": str(where)}))
    (purelib / "_mineonline_overlay.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n"
    )
    return where


def _demo_overrides() -> str:
    """The Makefile's own ``DEMO_OVERRIDES``, so the demo trains what ``make demo`` trains."""
    found = re.search(r"^DEMO_OVERRIDES \?= (.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found, "the Makefile no longer sets DEMO_OVERRIDES"
    return found[1]


def _prelude(venv: Path) -> str:
    shrink = " ".join(SHRINK)
    python = shlex.quote(str(venv / "bin" / "python"))
    return f"""
mineonline() {{
  case "$1" in
    run) {python} -m mineonline_core.cli "$@" {shrink} ;;
    tune) {python} -m mineonline_core.cli "$@" {shrink} train_config.num_iterations=3 ;;
    *) {python} -m mineonline_core.cli "$@" ;;
  esac
}}
pip() {{ {python} -m pip "$@" --no-build-isolation --no-deps --no-index --quiet; }}
make() {{
  command make -o install VENV={shlex.quote(sys.prefix)} \\
    DEMO_OVERRIDES={shlex.quote(_demo_overrides() + " " + shrink)} "$@"
}}
PS4='+ [${{SECONDS}}s] '
set -x
"""


def _check_optuna(work: Path, stdout: str) -> None:
    check_optuna_sweep(work / "runs" / "lr-tpe", stdout, trials=3, iterations=3, low=1e-4, high=3e-3)


# What a block's run must leave beyond its exit status, by a phrase of the block.
CHECKS = {"--name lr-tpe --search optuna": _check_optuna}


def _block_id(block: Block) -> str:
    """``path:name``, from the block's first ``--name`` or ``run_name=``, so that an id outlives edits above it."""
    named = re.search(r"(?:--name |\brun_name=)([\w.-]+)", block.code)
    return f"{block.path.relative_to(ROOT)}:{named[1]}" if named else block.id


def _commands(block: str) -> list[str]:
    """The block's lines with continuation lines joined: one command a line."""
    return block.replace("\\\n", " ").splitlines()


def _run_names(block: str) -> set[str]:
    """The runs a block leaves under ``runs/``: each ``run_name=`` of a command that sets no ``output_dir``."""
    return {
        name
        for command in _commands(block)
        if "output_dir=" not in command
        for name in re.findall(r"\brun_name=([\w.-]+)", command)
    }


# Each block alone, so that pytest's workers share them out: together they took 258 s beside three other
# workers on a quiet 2-core machine and past 600 s beside two CPU burners.
@pytest.mark.parametrize("block", SLOW_BLOCKS, ids=[_block_id(block) for block in SLOW_BLOCKS])
@pytest.mark.timeout(1800)  # a hang guard: the README's block took past 850 s beside two CPU burners
def test_each_slow_docs_block_runs_with_short_iterations(block, tmp_path: Path) -> None:
    work = tmp_path / "checkout"
    work.mkdir()
    for name in ("Makefile", "examples"):
        (work / name).symlink_to(ROOT / name)
    venv = _overlay_venv(tmp_path / "venv")
    env = _env()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", _prelude(venv) + block.code],
        check=False,
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert done.returncode == 0, (
        f"{block.id} exited with {done.returncode}\n--- stdout ---\n{done.stdout[-4000:]}\n"
        f"--- stderr ---\n{done.stderr[-6000:]}"
    )
    shown = [c for c in _commands(block.code) if " run " in c and "--no-progress" in c and ">" not in c.split("#")[0]]
    if shown:  # its help promises plain log lines, not silence until the summary
        assert "| ETA " in done.stdout, done.stdout[-4000:]
    left = {p.name for p in (work / "runs").iterdir()} if (work / "runs").is_dir() else set()
    assert _run_names(block.code) <= left, (_run_names(block.code), left)
    for phrase, check in CHECKS.items():
        if phrase in block.code:
            check(work, done.stdout)


def test_every_check_finds_its_block() -> None:
    assert all(any(phrase in block.code for block in SLOW_BLOCKS) for phrase in CHECKS), list(CHECKS)


def test_the_newcomers_runs_are_named_in_the_blocks() -> None:
    """The run directories the blocks must leave are the ones the README and the trainer tutorial promise."""
    named = set().union(*(_run_names(block.code) for block in SLOW_BLOCKS))
    assert {"demo-lr", "my-reinforce", "a2c-tutorial"} <= named, named
