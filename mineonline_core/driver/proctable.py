"""This machine's processes as ``/proc`` lists them (Linux; none elsewhere): the one reader of
``/proc/PID/stat``, shared by the local cluster's start-up and the fault tests' clean-up."""

from __future__ import annotations

import os


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state, ppid, pgrp, session, ...), or None
    when the process has gone. The name is skipped up to its last ``)``: it may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def processes(*, zombies: bool = False) -> dict[int, list[str]]:
    """Each process's ``stat_fields`` by pid; zombies (ended, not yet reaped) only when asked for."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    found = {}
    for name in names:
        fields = stat_fields(int(name)) if name.isdigit() else None
        if fields is not None and (zombies or fields[0] != "Z"):
            found[int(name)] = fields
    return found
