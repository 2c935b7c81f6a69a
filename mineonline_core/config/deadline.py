"""A bound on the time a Python config module may take to import.

A config module is user code executed at ``mineonline check`` and ``run``; one that loops at import
(a ``while`` waiting for a file, a server it polls) used to hang both forever with no output. Its
import runs under a timer in the main thread: after ``NOTE_S`` seconds one line says which file is
still importing, and at ``LIMIT_S`` the import is interrupted and reported as a ``ConfigError``
naming the file and what it was executing. ``LIMIT_S`` is generous because a legitimate module may
import torch and MineStudio on a loaded machine.

The interruption is an exception raised by a ``SIGALRM`` handler, derived from ``BaseException`` so
that an ``except Exception`` in the module's loop does not swallow it, and raised again every
second in case a bare ``except:`` did. Outside the main thread (a driver embedded in another
program) no signal can be used, and the import is not bounded.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from mineonline_core.errors import ConfigError

log = logging.getLogger("mineonline")

NOTE_S = 30.0  # one line saying which file is still importing
LIMIT_S = 300.0  # then the import is interrupted


class _Deadline(BaseException):
    """Raised into the importing module's code when its time is up."""


@contextlib.contextmanager
def import_deadline(path: Path) -> Iterator[None]:
    """Run the body (a config module's import) under the bound; raise ``ConfigError`` past it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted = False

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        nonlocal noted
        if not noted and NOTE_S < LIMIT_S:
            noted = True
            log.warning(
                "still importing config module %s after %.0fs (it runs its top-level code; interrupted at %.0fs)",
                path,
                NOTE_S,
                LIMIT_S,
            )
            signal.setitimer(signal.ITIMER_REAL, LIMIT_S - NOTE_S, 1.0)
            return
        raise _Deadline(frame)

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, min(NOTE_S, LIMIT_S), 0.0 if NOTE_S < LIMIT_S else 1.0)
    try:
        yield
    except _Deadline as exc:
        raise ConfigError(
            f"Importing config module {str(path)!r} did not finish within {LIMIT_S:.0f}s: its top-level code "
            f"{_where(exc.args[0], path)} never returned (a loop, or a wait for something that does not come). "
            "Fix: move long-running code into env_generator/policy_generator or under "
            '`if __name__ == "__main__":`, and check the module with `python ' + str(path) + "`."
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, previous)


def _where(frame: FrameType | None, path: Path) -> str:
    """``at line N (code)`` of the module's own innermost frame, when the interrupted code was there."""
    lines = [f for f in traceback.extract_stack(frame) if Path(f.filename) == path] if frame is not None else []
    return f"(at line {lines[-1].lineno}: {lines[-1].line})" if lines else "(in code it called)"
