"""The docs' slow blocks (the README's newcomer path, the plugin page's trainer switch) run in CI.

``tests/test_docs.py`` runs them only with ``MINEONLINE_DOCS_SLOW=1``, at full length. This test runs
every command of every ``runnable slow`` block, in order, as written, with three changes that keep the
suite short and the checkout clean, each made by a shell function defined before the block:

- ``mineonline run`` gets overrides appended that shrink an iteration (two envs, one minibatch of two
  16-step chunks, one epoch), never the number of iterations, so a resume still continues from where the
  first run stopped; ``make demo`` gets the same through ``DEMO_OVERRIDES``, and uses the Python
  that runs this test (``-o install``: the environment is already installed).
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

from tests.test_docs import ROOT, RUNNABLE, _env

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
  if [ "$1" = run ]; then {python} -m mineonline_core.cli "$@" {shrink}; else {python} -m mineonline_core.cli "$@"; fi
}}
pip() {{ {python} -m pip "$@" --no-build-isolation --no-deps --no-index --quiet; }}
make() {{
  command make -o install VENV={shlex.quote(sys.prefix)} \\
    DEMO_OVERRIDES={shlex.quote(_demo_overrides() + " " + shrink)} "$@"
}}
PS4='+ [${{SECONDS}}s] '
set -x
"""


@pytest.mark.skipif(not SLOW_BLOCKS, reason="no slow documentation block")
# Every slow block in turn (several real runs, a plugin install): 258 s beside three other pytest workers on a
# quiet 2-core machine, past the suite's 600 s beside two CPU burners.
@pytest.mark.timeout(1800)
def test_every_slow_docs_block_runs_with_short_iterations(tmp_path: Path) -> None:
    work = tmp_path / "checkout"
    work.mkdir()
    for name in ("Makefile", "examples"):
        (work / name).symlink_to(ROOT / name)
    venv = _overlay_venv(tmp_path / "venv")
    env = _env()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    for block in SLOW_BLOCKS:
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", _prelude(venv) + block.code],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, (
            f"{block.id} exited with {done.returncode}\n--- stdout ---\n{done.stdout[-4000:]}\n"
            f"--- stderr ---\n{done.stderr[-6000:]}"
        )
        commands = block.code.replace("\\\n", " ").splitlines()  # continuation lines joined
        shown = [c for c in commands if " run " in c and "--no-progress" in c and ">" not in c.split("#")[0]]
        if shown:  # its help promises plain log lines, not silence until the summary
            assert "| ETA " in done.stdout, done.stdout[-4000:]
    assert {"demo-lr", "my-reinforce", "reinforce-demo"} <= {p.name for p in (work / "runs").iterdir()}
