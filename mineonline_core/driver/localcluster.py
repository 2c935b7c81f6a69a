"""Start the local Ray cluster of a run without ``--address``, once more when Ray's start-up times out.

Ray waits a fixed 30 s for a new node's raylet to register with the GCS and then raises "The current node
timed out during startup" (or, for the GCS's own start, "Timed out waiting for file ...gcs_server_port..."),
leaving the processes it started running until the driver exits. On a busy
machine (a 2-core laptop beside a build, four test workers starting clusters at once) the raylet can take
longer. Those processes, the driver's own children started by the failed call, are ended, and the start is
tried once more, saying so on the console; a second timeout is raised as it is.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from mineonline_core.driver.proctable import processes

log = logging.getLogger("mineonline")

# Ray's messages when a process of a new node misses its window: the raylet's registration
# (ray/_private/node.py) and a port file the GCS or the raylet writes once it listens.
TIMED_OUT = ("timed out during startup", "Timed out waiting for file")


def children() -> set[int]:
    """Process ids whose parent is this process, zombies included (they are reaped by ``end``)."""
    me = os.getpid()
    return {pid for pid, fields in processes(zombies=True).items() if int(fields[1]) == me}


def end(pids: set[int], *, grace_s: float = 10.0) -> None:
    """SIGTERM ``pids`` (this process's children), reap them, SIGKILL those alive after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass  # already gone
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while pids and time.monotonic() < deadline:
            for pid in list(pids):
                try:
                    if os.waitpid(pid, os.WNOHANG)[0] == pid:
                        pids.discard(pid)
                except ChildProcessError:
                    pids.discard(pid)  # reaped elsewhere (Ray's own handlers)
            time.sleep(0.1)  # polling the children's exit
        if not pids:
            return


def start_local_cluster(**init_kwargs: Any) -> None:
    """``ray.init(address="local", **init_kwargs)``, a second time after a start-up timeout; the cluster's
    workers at the driver's priority unless ``RAY_worker_niceness`` says otherwise."""
    import ray

    # Ray runs its workers at nice 15 to keep its own control processes responsive; a run's work is all in
    # its workers (rollout, training, bookkeeping), so any other busy process on the machine took the CPU
    # from them: beside two busy processes on 2 cores a 5-iteration CartPole run took 155 s instead of 19.
    os.environ.setdefault("RAY_worker_niceness", "0")
    before = children()
    try:
        ray.init(address="local", **init_kwargs)
        return
    except Exception as exc:  # Ray raises a bare Exception for this
        if not any(marker in str(exc) for marker in TIMED_OUT):
            raise
        stuck = children() - before
    log.warning(
        "starting the local Ray cluster timed out: Ray waits 30 s for its raylet, and this machine is busy. "
        "Ending the %d processes it started and starting it once more.",
        len(stuck),
    )
    end(stuck)
    ray.init(address="local", **init_kwargs)
