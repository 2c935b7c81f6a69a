"""``mineonline run --address``: a small parent process that outlives the driver to say why it ended.

When the head node dies (the GCS, the driver's raylet and object store), Ray's core worker ends the
driver's process from C++ (``The connection to the plasma store is failed. Terminate the process``,
exit status 1) before any Python code runs: no message, no cause in ``run.log``. The same happens when a
driver on another node loses the GCS for good. So the CLI runs the driver as a child and waits:

* the child notes its run directory (``note_run_dir``) once it has one, and its exit status when it
  ends through Python (``note_exit``), in the file named by ``OUTCOME_VAR``;
* a child that ended without noting its exit died abruptly. The parent then checks whether the
  cluster still answers at the address: when it does not, it prints ``lost the Ray cluster at ADDR``,
  otherwise that the driver process died (its status or signal), in both cases with the command that
  resumes the run, writes the same lines to the run's ``run.log``, and exits 1 (a failed run);
* a child whose run failed through Python may have seen the head's death first as one of its actors
  gone (the logging actor lives on the head). When its run had started and the cluster no longer
  answers, the parent says the same ``lost the Ray cluster at ADDR`` last, with the resume command.

The run's records are what an abruptly ended driver leaves: ``run.json`` and the latest checkpoint;
its lock names a dead pid and is taken over by the next ``--resume`` with a warning (``rundir.py``).

Signals: the child runs in a process group of its own and the parent forwards SIGINT, SIGTERM and
SIGHUP, so that one Ctrl-C in a terminal (sent to the foreground group: the parent) reaches the driver
once ("Ctrl-C again to abort" means a second press, not the same press counted twice). A parent killed
outright takes the driver down with SIGTERM (``PR_SET_PDEATHSIG``), which stops it like Ctrl-C.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

#: Environment variable naming the file where the supervised driver notes its run directory and exit.
OUTCOME_VAR = "MINEONLINE_DRIVER_OUTCOME"
EXIT_FAILED = 1


def note_run_dir(run_dir: Path) -> None:
    """In a supervised driver: record the run directory (for the resume command of a lost cluster)."""
    _note(f"run_dir {Path(run_dir).absolute()}")


def note_exit(code: int) -> None:
    """In a supervised driver: record that it ended through Python, with ``code``."""
    _note(f"exit {int(code)}")


def _note(line: str) -> None:
    path = os.environ.get(OUTCOME_VAR)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def supervised(argv: Sequence[str], address: str) -> int:
    """Run ``mineonline`` with ``argv`` as a child driver; return its exit status, or ``EXIT_FAILED``
    with the cause printed when it died abruptly."""
    fd, outcome = tempfile.mkstemp(prefix="mineonline-driver-", suffix=".txt")
    os.close(fd)
    env = {**os.environ, OUTCOME_VAR: outcome}
    child = subprocess.Popen(
        [sys.executable, "-m", "mineonline_core.cli", *argv], env=env, process_group=0, preexec_fn=_stop_with_parent
    )
    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, lambda signum, _frame: child.send_signal(signum)) for sig in forwarded}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    try:
        notes = Path(outcome).read_text(encoding="utf-8").splitlines()
    finally:
        os.unlink(outcome)
    status, report = ending(notes, code, address)
    if report is None:
        return status
    print(f"error: {report}", file=sys.stderr, flush=True)
    run_dir = _last_note(notes, "run_dir")
    if run_dir is not None:
        from mineonline_core.services.runlog import LOG_FILE

        try:
            with open(Path(run_dir) / LOG_FILE, "a", encoding="utf-8") as f:
                f.write(f"ERROR mineonline: {report}\n")
        except OSError:
            pass  # the console has it; a run directory that cannot be written has its own error
    return status


def ending(notes: list[str], code: int, address: str) -> tuple[int, str | None]:
    """The status the CLI exits with for a child driver that ended with ``code`` after writing ``notes``,
    and what the parent prints last (None: the child has said everything)."""
    noted, run_dir = _last_note(notes, "exit"), _last_note(notes, "run_dir")
    if noted is None:
        return EXIT_FAILED, abrupt_end_report(address, code, run_dir)
    if int(noted) != 0 and run_dir is not None and _answers(address) is False:
        return EXIT_FAILED, abrupt_end_report(address, int(noted), run_dir, noted=True)
    return int(noted), None


def _last_note(notes: list[str], kind: str) -> str | None:
    """The value of the last ``kind VALUE`` line the child noted (``_note``), or None."""
    values = [line.split(" ", 1)[1] for line in notes if line.startswith(kind + " ")]
    return values[-1] if values else None


def _stop_with_parent() -> None:
    # A parent killed by SIGKILL forwards nothing: the kernel then sends the driver SIGTERM (a stop with a
    # final checkpoint) rather than leaving it running unsupervised. Linux's prctl; elsewhere nothing.
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _answers(address: str) -> bool | None:
    """Whether the cluster's head accepts connections at ``address`` (None: no address to ask)."""
    from mineonline_core.driver.lifecycle import _listening

    from mineonline_core.errors import MineOnlineError

    target = address.removeprefix("ray://")
    try:
        return None if target == "auto" else _listening(target)
    except MineOnlineError:
        return None


def abrupt_end_report(address: str, code: int, run_dir: str | None, *, noted: bool = False) -> str:
    """The message for a driver that ended without a word: the lost cluster, or its own death.
    ``noted``: the driver ended through Python with ``code`` (its run failed) and the cluster is gone."""
    how = f"signal {-code}" if code < 0 else f"exit status {code}"
    answers = False if noted else _answers(address)
    if answers is None:
        cause = (
            f"the driver process ended abruptly ({how}); "
            f"if the head of the Ray cluster ({address}) went down, Ray ended it"
        )
    elif answers:
        cause = f"the driver process ended abruptly ({how}) while the Ray cluster at {address} still answers"
    else:
        cause = (
            f"lost the Ray cluster at {address}: its head no longer answers (the head node or the network "
            "to it went down), and " + (f"the run failed with it ({how})" if noted else f"Ray ended the driver ({how})")
        )
    if run_dir is None:
        return cause + "; the run had not started. Fix: start the cluster again, then rerun the same command."
    resume = f"mineonline run --resume {shlex.quote(run_dir)} --address {shlex.quote(address)}"
    return (
        f"{cause}. The run's records and checkpoints are kept in {run_dir}. Fix: once the cluster is back "
        f"(`ray start --head` ...), continue with: {resume}"
    )
