"""The processes a fault test started, read from ``/proc`` (Linux), so a test ends only its own.

A killed driver leaves its Ray cluster, env processes and Ray Train ranks behind unless the run
cleans up; the tests find them by the session they created for the driver (``session_pids``) or by
descent from its pid (``descendants``), never by name.
"""

from __future__ import annotations

from pathlib import Path

from mineonline_core.driver.proctable import processes


def command_line(pid: int, width: int = 120) -> str:
    """The start of ``pid``'s command line, or ``"?"`` when it has gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:width]
    except OSError:
        return "?"


def session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (a driver started with ``start_new_session=True`` leads one)."""
    return [pid for pid, fields in processes().items() if int(fields[3]) == sid]


def descendants(root: int) -> dict[int, str]:
    """Live processes below ``root`` (by parent pid), with their command lines."""
    parent = {pid: int(fields[1]) for pid, fields in processes().items()}
    below, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - below
        below |= frontier
    return {pid: command_line(pid) for pid in below}


def reap_session(sid: int, *, grace_s: float) -> dict[int, str]:
    """Wait up to ``grace_s`` for session ``sid``'s processes to end on their own, then SIGKILL (by pid)
    those left; return them with their command lines (a test asserts there were none)."""
    import os
    import signal
    import time

    end = time.monotonic() + grace_s
    while session_pids(sid) and time.monotonic() < end:
        time.sleep(0.5)
    left = {pid: command_line(pid) for pid in session_pids(sid)}
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
