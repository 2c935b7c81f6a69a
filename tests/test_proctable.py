"""``driver/proctable.py`` reads ``/proc`` as the kernel writes it: a name with spaces and parentheses, a
zombie not yet reaped, a process that has gone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mineonline_core.driver.proctable import processes, stat_fields

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")


def test_a_name_with_spaces_and_parentheses_does_not_shift_the_fields(tmp_path: Path) -> None:
    odd = tmp_path / "a) b (c"  # the kernel writes the name inside "(...)" as it is
    shutil.copy(shutil.which("sleep"), odd)
    child = subprocess.Popen([str(odd), "30"])
    try:
        fields = stat_fields(child.pid)
        assert fields is not None and fields[0] in "RSD" and int(fields[1]) == os.getpid()
        assert int(fields[3]) == os.getsid(0)  # the session: the fourth field after the name
        # The same parent, group and session from the table (the state and the times move between two reads).
        assert processes()[child.pid][1:4] == fields[1:4]
    finally:
        child.kill()
        child.wait()


def test_a_zombie_is_listed_only_when_asked_for_and_a_gone_process_not_at_all() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while (stat_fields(child.pid) or ["?"])[0] != "Z":  # it exits; nobody has reaped it yet
        assert time.monotonic() < deadline, stat_fields(child.pid)
        time.sleep(0.05)  # polling the child's state
    assert child.pid in processes(zombies=True) and child.pid not in processes()
    child.wait()
    assert stat_fields(child.pid) is None and child.pid not in processes(zombies=True)
