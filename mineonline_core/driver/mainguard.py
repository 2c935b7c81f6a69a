"""Traps of a run started from a script or a notebook rather than from a config file.

A script that calls ``run()`` at import time, without ``if __name__ == "__main__":``:

Env processes start through ``multiprocessing``'s forkserver (or spawn), which first imports the
driver's main script as ``__mp_main__``. A script that calls ``run()`` at its top level then starts
the run again inside that import; multiprocessing refuses to start a process while bootstrapping,
the server dies, and the only thing the driver saw was an env process that died before its env was
unpickled, which reads like a crash of native code. The check here looks at the script before
anything starts: the top-level statement of ``__main__`` that is running now is either an
``if __name__ == "__main__":`` block or the mistake, named with its file and line.

A config module built in a notebook (its ``policy_generator`` or ``env_generator`` defined in a cell,
module ``__main__``, with no file): the run itself works (Ray pickles the functions by value), but its
checkpoints' config cannot name the functions, so ``load_policy``, ``mineonline eval`` and
``--resume`` could not rebuild the policy. Such a run is refused before anything starts, with the
way out, rather than leaving checkpoints nothing can load.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from mineonline_core.config import LoadedConfig
from mineonline_core.config.generators import KEYS
from mineonline_core.errors import ConfigError, MineOnlineError


def unguarded_call_site() -> tuple[str, int] | None:
    """``(script, line)`` of the main script's top-level statement that led here when it is not under
    an ``if __name__ == ...`` test; None when guarded, or when there is no script (a notebook, ``-c``,
    the ``mineonline`` command)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not str(path).endswith(".py"):
        return None
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:
        return None
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            guarded = isinstance(node, ast.If) and "__name__" in ast.unparse(node.test)
            return None if guarded else (str(path), line)
    return None


def check_main_guard(what: str = "run()") -> None:
    """Raise a ``MineOnlineError`` naming the line when the main script calls ``what`` unguarded."""
    site = unguarded_call_site()
    if site is None:
        return
    path, line = site
    raise MineOnlineError(
        f'{path}:{line} calls {what} when the script is imported, not under `if __name__ == "__main__":`. '
        f"Env processes start by importing the main script (multiprocessing's forkserver/spawn), so the run would "
        f"start again inside each of them and they would die before their env is built. Fix: move the call under "
        f'`if __name__ == "__main__":` at the end of {Path(path).name}.'
    )


def check_generators_named(loaded: LoadedConfig) -> None:
    """Raise a ``ConfigError`` when a generator function was given that the saved config cannot name."""
    for key in KEYS:
        fn = getattr(loaded, key)
        if fn is None or getattr(loaded.config, key) is not None:
            continue
        component = "policy" if key == "policy_generator" else "env"
        where = getattr(fn, "__module__", None) or "?"
        raise ConfigError(
            f"{key}: '{where}.{getattr(fn, '__qualname__', fn)}' cannot be named by an import path (it was defined in "
            f"a notebook, an interactive session or a closure), so this run's checkpoints could not rebuild its "
            f"{component}: load_policy, `mineonline eval` and --resume would fail on them. Fix: put {key} (and the "
            f"classes it uses) in a .py file and run that file (run('my_config.py')) or import the function from it, "
            f"or select the {component} by name ({component}_config: {{name: ...}}) and drop {key}."
        )
