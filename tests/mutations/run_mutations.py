"""Mutation check: reintroduce each known defect and assert that the tests guarding it fail.

The defects are listed in the ``*.yaml`` files beside this file (``mutations.yaml``, and one file per
area such as ``oracle_*.yaml``; each entry: name, what, path, old snippet, new code, tests, and an
optional ``timeout`` in seconds for a defect that makes its test hang). Each mutation replaces one exact
snippet of the source by the defective code, in a temporary copy of the checkout (``mineonline_core``,
``plugins``, ``tests``; put first on the import path so the copy shadows the editable installs), and runs
only the tests named for it. A mutation whose tests still pass is a guarantee nothing checks: the script
prints it and exits 1. A snippet that is no longer in the source is an error too, so the list cannot
silently go stale.

Each mutation's pytest runs in a child forked from this process after it has imported the heavy
third-party packages (torch, Ray, gymnasium, pytest) and nothing of the project: the child imports the
project from its copy alone, and the check does not pay an interpreter start and a torch import per
defect (about 2 s each, 220 times). The parent stays single-threaded so that forking is safe.

Run: ``python tests/mutations/run_mutations.py [name ...]`` (``make test`` runs all of them).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COPY = ("mineonline_core", "plugins", "tests", "examples", "benchmarks", "docs", "conftest.py", "pyproject.toml")
COPY += ("README.md", "Makefile")  # the docs tests run their blocks


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    timeout: float | None = None


def load_mutations() -> tuple[Mutation, ...]:
    entries = [
        entry
        for path in sorted(Path(__file__).parent.glob("*.yaml"))
        for entry in yaml.safe_load(path.read_text(encoding="utf-8")) or ()
    ]
    names = [entry["name"] for entry in entries]
    if len(set(names)) != len(names):
        raise SystemExit(f"duplicate mutation names: {sorted({n for n in names if names.count(n) > 1})}")
    return tuple(Mutation(**{**entry, "tests": tuple(entry["tests"])}) for entry in entries)


MUTATIONS = load_mutations()


def copy_checkout(dest: Path) -> None:
    # Compiled files come along: they are checked against their source's mtime and size, which copy2
    # keeps, so only the mutated module is compiled again.
    ignore = shutil.ignore_patterns("*.egg-info", ".venv")
    for name in COPY:
        src = ROOT / name
        (shutil.copytree(src, dest / name, ignore=ignore) if src.is_dir() else shutil.copy2(src, dest / name))


def shadowing_env(dest: Path) -> dict[str, str]:
    """The environment in which ``dest``'s copy of the core and plugins is imported before the installed ones."""
    paths = [dest, *(p for p in (dest / "plugins").iterdir() if p.is_dir())]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths)), "WANDB_MODE": "disabled"}


# Imported by each child from its copy before its tests run, to prove that the copy is what runs.
SHADOWED = ("mineonline_core", "mineonline_ppo")
# Imported once here, before any fork; nothing of the project may be among them (the copies shadow it).
# hypothesis: its pytest plugin, 1 s per child; torch._dynamo: what the first optimiser imports, 1.6 s.
PRELOAD = ("numpy", "torch", "torch._dynamo", "gymnasium", "ray", "ray.train", "ray.tune", "pydantic", "yaml")
PRELOAD += ("lmdb", "pytest", "hypothesis")


def preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    leaked = [name for name in sys.modules if name.startswith(("mineonline", "tests"))]
    assert not leaked, f"the parent imported {leaked}; the children would run that code instead of their copy's"
    # What the parent holds is never garbage: frozen, pytest's collections in each child (about 0.5 s on a
    # heap holding torch and Ray) skip it, and the children do not copy its pages by touching it.
    gc.freeze()


@dataclass
class Running:
    mutation: Mutation
    tmp: tempfile.TemporaryDirectory
    started: float
    deadline: float


def start(mutation: Mutation, timeout: float) -> tuple[int, Running] | tuple[None, str]:
    """Forks a child that runs ``mutation``'s tests in a mutated copy; returns its pid, or why it cannot run."""
    tmp = tempfile.TemporaryDirectory(prefix=f"mutation-{mutation.name}-")
    dest = Path(tmp.name)
    copy_checkout(dest)
    target = dest / mutation.path
    source = target.read_text()
    if source.count(mutation.old) != 1:
        tmp.cleanup()
        return None, f"{mutation.path}: the snippet occurs {source.count(mutation.old)} times, not once"
    target.write_text(source.replace(mutation.old, mutation.new))
    log = dest / "pytest.log"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 3
        try:
            os.setsid()  # its own group, so that a hung child and whatever it started die together
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.chdir(dest)
            env = shadowing_env(dest)
            os.environ.clear()
            os.environ.update(env)  # subprocesses (CLI runs, Ray workers) import the copy too
            sys.path[:0] = env["PYTHONPATH"].split(os.pathsep)
            importlib.invalidate_caches()
            for name in SHADOWED:
                module = importlib.import_module(name)
                if not module.__file__.startswith(str(dest)):
                    print(f"the copy does not shadow the installed {name}: it was imported from {module.__file__}")
                    os._exit(4)
            import pytest

            # anyio's pytest plugin probes its event-loop backends (0.4 s) for tests that none of ours are.
            quiet = ["-p", "no:anyio", "-W", "ignore::pytest.PytestAssertRewriteWarning"]  # hypothesis is preloaded
            code = int(pytest.main(["-q", "-x", "-p", "no:cacheprovider", *quiet, *mutation.tests]))
        except BaseException:  # noqa: BLE001 -- the child must end here, never run the parent's loop
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    now = time.monotonic()
    return pid, Running(mutation, tmp, now, now + (mutation.timeout or timeout))


def finish(job: Running, status: int | None) -> tuple[Mutation, str, float, str]:
    """Returns (mutation, "caught" | "MISSED" | "ERROR", seconds, output tail) and removes the copy."""
    seconds = time.monotonic() - job.started
    log = Path(job.tmp.name) / "pytest.log"
    output = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    job.tmp.cleanup()
    if status is None:
        return job.mutation, "caught", seconds, "timed out (the tests hung on the defect)"
    code = os.waitstatus_to_exitcode(status)
    if code == 1:
        return job.mutation, "caught", seconds, output
    if code == 0:
        return job.mutation, "MISSED", seconds, output
    return job.mutation, "ERROR", seconds, f"pytest exit code {code}:\n{output}"


def run_all(chosen: list[Mutation], *, jobs: int, timeout: float):
    """Yields each mutation's verdict as it comes, with at most ``jobs`` children at once."""
    queue = list(chosen)
    running: dict[int, Running] = {}
    while queue or running:
        while queue and len(running) < jobs:
            mutation = queue.pop(0)
            pid, job = start(mutation, timeout)
            if pid is None:
                yield mutation, "ERROR", 0.0, job
            else:
                running[pid] = job
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            yield finish(running.pop(pid), status)
            continue
        for pid, job in list(running.items()):
            if time.monotonic() > job.deadline:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                yield finish(running.pop(pid), None)
        # Children are waited for by polling: the parent has nothing else to do, and a SIGCHLD handler
        # would interrupt the copies above.
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--jobs", type=int, default=3, help="mutations run at once")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mutation's tests")
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown mutations {unknown}; known: {sorted(known)}")
    chosen = [known[n] for n in args.names] or list(MUTATIONS)
    # Slowest first (as last measured on this machine; new ones before all), so that the check does not
    # end on one long defect while the other jobs idle.
    last = _last_seconds()
    chosen.sort(key=lambda m: -last.get(m.name, float("inf")))
    start_time = time.monotonic()
    preload()
    failed = 0
    for mutation, verdict, seconds, output in run_all(chosen, jobs=max(1, args.jobs), timeout=args.timeout):
        print(f"{verdict:7s} {mutation.name:17s} {seconds:6.1f}s  {mutation.what}", flush=True)
        last[mutation.name] = round(seconds, 1)
        if verdict != "caught":
            failed += 1
            print("        " + output.replace("\n", "\n        "), flush=True)
    print(f"{len(chosen) - failed}/{len(chosen)} defects caught in {time.monotonic() - start_time:.0f}s")
    with contextlib.suppress(OSError):
        TIMES.parent.mkdir(parents=True, exist_ok=True)
        TIMES.write_text(json.dumps(last, indent=0, sort_keys=True))
    return 1 if failed else 0


TIMES = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mineonline" / "mutation-seconds.json"


def _last_seconds() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(TIMES.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


if __name__ == "__main__":
    sys.exit(main())
