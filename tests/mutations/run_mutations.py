"""Mutation check: reintroduce each known defect and assert that the tests guarding it fail.

The defects are listed in the ``*.yaml`` files beside this file (``mutations.yaml``, and one file per
area such as ``oracle_*.yaml``; each entry: name, what, path, old snippet, new code, tests). Each mutation replaces one exact snippet of the source by the defective code, in a temporary copy
of the checkout (``mineonline_core``, ``plugins``, ``tests``; put first on ``PYTHONPATH`` so the
copy shadows the editable installs), and runs only the tests named for it. A mutation whose tests
still pass is a guarantee nothing checks: the script prints it and exits 1. A snippet that is no
longer in the source is an error too, so the list cannot silently go stale.

Run: ``python tests/mutations/run_mutations.py [name ...]`` (``make test`` runs all of them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COPY = ("mineonline_core", "plugins", "tests", "examples", "benchmarks", "conftest.py", "pyproject.toml")


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


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
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".venv")
    for name in COPY:
        src = ROOT / name
        (shutil.copytree(src, dest / name, ignore=ignore) if src.is_dir() else shutil.copy2(src, dest / name))


def shadowing_env(dest: Path) -> dict[str, str]:
    """The environment in which ``dest``'s copy of the core and plugins is imported before the installed ones."""
    paths = [dest, *(p for p in (dest / "plugins").iterdir() if p.is_dir())]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths)), "WANDB_MODE": "disabled"}


def check_shadowing() -> str | None:
    """Why a copy would not shadow the installed packages (None when it does). Every copy is made alike,
    so one check stands for all: it costs an interpreter start with torch, per mutation a few seconds."""
    with tempfile.TemporaryDirectory(prefix="mutation-shadow-") as tmp:
        dest = Path(tmp)
        copy_checkout(dest)
        check = (
            "import mineonline_core, mineonline_ppo; "
            f"assert all(m.__file__.startswith({str(dest)!r}) for m in (mineonline_core, mineonline_ppo))"
        )
        done = subprocess.run(
            [sys.executable, "-c", check], cwd=dest, env=shadowing_env(dest), capture_output=True, text=True
        )
        return done.stderr[-2000:] if done.returncode else None


def run(mutation: Mutation, timeout: float) -> tuple[Mutation, str, float, str]:
    """Returns (mutation, "caught" | "MISSED" | "ERROR", seconds, output tail)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mutation-{mutation.name}-") as tmp:
        dest = Path(tmp)
        copy_checkout(dest)
        target = dest / mutation.path
        source = target.read_text()
        if source.count(mutation.old) != 1:
            return (
                mutation,
                "ERROR",
                0.0,
                f"{mutation.path}: the snippet occurs {source.count(mutation.old)} times, not once",
            )
        target.write_text(source.replace(mutation.old, mutation.new))
        env = shadowing_env(dest)
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *mutation.tests]
        try:
            proc = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return mutation, "caught", time.monotonic() - start, "timed out (the tests hung on the defect)"
        output = (proc.stdout + proc.stderr)[-3000:]
        if proc.returncode == 1:
            return mutation, "caught", time.monotonic() - start, output
        if proc.returncode == 0:
            return mutation, "MISSED", time.monotonic() - start, output
        return mutation, "ERROR", time.monotonic() - start, f"pytest exit code {proc.returncode}:\n{output}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="mutations run at once")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mutation's tests")
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown mutations {unknown}; known: {sorted(known)}")
    chosen = [known[n] for n in args.names] or list(MUTATIONS)
    start = time.monotonic()
    problem = check_shadowing()
    if problem is not None:
        print(f"ERROR   a copy of the checkout does not shadow the installed packages:\n{problem}")
        return 1
    failed = 0
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for mutation, verdict, seconds, output in pool.map(lambda m: run(m, args.timeout), chosen):
            print(f"{verdict:7s} {mutation.name:17s} {seconds:6.1f}s  {mutation.what}", flush=True)
            if verdict != "caught":
                failed += 1
                print("        " + output.replace("\n", "\n        "), flush=True)
    print(f"{len(chosen) - failed}/{len(chosen)} defects caught in {time.monotonic() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
