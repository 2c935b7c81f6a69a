"""CPU seconds per test of a whole pytest run (or any command), from every process the run starts.

On a 2-core machine the suite is bound by CPU, so a test's wall time says more about its neighbours than
about itself; its CPU does not. The command runs with a marker in its environment; every 0.5 s this
script reads each process's CPU from ``/proc`` and, for a process carrying the marker, the test that was
running when it started (``PYTEST_CURRENT_TEST``, which pytest sets and children inherit): CLI
subprocesses, Ray clusters and their workers, env processes. Limits: a process is charged to the test
that started it (a module-wide cluster to that module's first test); the pytest workers' own CPU is
"outside tests"; the last half second of each process (and so most of one that lives under it) is
missed. Linux only.

    python benchmarks/bench_suite_cpu.py --top 40 -- .venv/bin/python -m pytest -q -m "not slow" -n 4
    python benchmarks/bench_suite_cpu.py --quick      # a self-check on two short child processes

Prints a table on stderr and one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _benchlib import emit, proc_start_and_cpu_s

OUTSIDE = "outside tests"
TICK = os.sysconf("SC_CLK_TCK")


def _busy_cpu() -> float:
    with open("/proc/stat") as f:
        fields = list(map(int, f.readline().split()[1:]))
    return (sum(fields) - fields[3] - fields[4]) / TICK  # all but idle and iowait


class Sampler(threading.Thread):
    def __init__(self, *, marker: str, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.marker, self.period = marker.encode(), period
        self.owner: dict[int, tuple[int, str | None]] = {}  # pid -> (start time, test or None when unmarked)
        self.cpu: dict[tuple[int, int], tuple[float, str]] = {}  # (pid, start) -> (latest CPU s, test)
        self.done = threading.Event()

    def scan(self) -> None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            pid = int(entry)
            try:
                start, cpu = proc_start_and_cpu_s(pid)
            except OSError:
                continue  # gone
            known = self.owner.get(pid)
            if known is None or known[0] != start:  # a new process, or a reused pid
                known = self.owner[pid] = (start, self._test_of(pid))
            if known[1] is not None:
                self.cpu[(pid, start)] = (cpu, known[1])

    def _test_of(self, pid: int) -> str | None:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            return None
        if env.get(b"MINEONLINE_CPU_MARKER") != self.marker:
            return None
        test = env.get(b"PYTEST_CURRENT_TEST")
        return test.decode(errors="replace").rsplit(" (", 1)[0] if test else OUTSIDE

    def run(self) -> None:
        while not self.done.is_set():
            self.scan()
            self.done.wait(self.period)
        self.scan()

    def per_test(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
        for cpu, test in self.cpu.values():
            out[test][0] += cpu
            out[test][1] += 1
        return dict(out)


def measure(command: list[str]) -> dict:
    marker = uuid.uuid4().hex
    sampler = Sampler(marker=marker)
    busy, started = _busy_cpu(), time.monotonic()
    sampler.start()
    code = subprocess.call(command, env={**os.environ, "MINEONLINE_CPU_MARKER": marker})
    sampler.done.set()
    sampler.join()
    tests = sampler.per_test()
    return {
        "command": " ".join(command),
        "exit_code": code,
        "wall_s": round(time.monotonic() - started, 1),
        "machine_busy_cpu_s": round(_busy_cpu() - busy, 1),  # everything on the machine, the run's neighbours too
        "run_cpu_s": round(sum(cpu for cpu, _ in tests.values()), 1),
        "tests": {name: [round(cpu, 2), n] for name, (cpu, n) in sorted(tests.items(), key=lambda kv: -kv[1][0])},
    }


def report(result: dict, top: int) -> None:
    files: collections.Counter = collections.Counter()
    for name, (cpu, _) in result["tests"].items():
        files[name.split("::")[0]] += cpu
    print(
        f"wall {result['wall_s']} s; the run's processes {result['run_cpu_s']} CPU-s "
        f"(the machine's busy CPU {result['machine_busy_cpu_s']} s); exit code {result['exit_code']}",
        file=sys.stderr,
    )
    total = 0.0
    for name, (cpu, n) in list(result["tests"].items())[:top]:
        total += cpu
        print(f"{cpu:8.1f} {total:8.0f} {n:4d} processes  {name}", file=sys.stderr)
    print("by file:", file=sys.stderr)
    for name, cpu in files.most_common(top // 2):
        print(f"{cpu:8.1f}  {name}", file=sys.stderr)


QUICK = (
    "import os, subprocess, sys\n"
    "burn = 'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 1.0: pass'\n"
    "for test in ('tests/a.py::one (call)', 'tests/b.py::two (call)'):\n"
    "    subprocess.run([sys.executable, '-c', burn], env={**os.environ, 'PYTEST_CURRENT_TEST': test}, check=True)\n"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=40, help="tests listed on stderr")
    parser.add_argument("--quick", action="store_true", help="measure two 1-CPU-second children instead")
    parser.add_argument("command", nargs="*", help="the command (after --); default: the suite as make test runs it")
    args = parser.parse_args(argv)
    command = args.command or [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-n", "4", "--dist", "worksteal"]
    if args.quick:
        command = [sys.executable, "-c", QUICK]
    result = measure(command)
    report(result, args.top)
    tests = result.pop("tests")
    emit("suite_cpu", {**result, "top": list(tests.items())[: args.top]}, quick=args.quick)
    return result["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
