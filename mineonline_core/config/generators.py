"""Env and policy generators named by import path, so that a saved config can rebuild them.

A spec is ``package.module:function`` (an importable module) or ``path/to/file.py:function`` (a
Python config module, imported from its file). ``generator_spec`` names a function that way when it
can; ``import_generator`` turns a spec back into the function. ``Deferred`` carries a generator to the
process that calls it without importing what it needs on the way.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import importlib.util
import pathlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from mineonline_core.config.deadline import import_deadline
from mineonline_core.errors import ConfigError

KEYS = ("env_generator", "policy_generator")
# A fresh module name for each import of a config file.
_module_counter = itertools.count()


def generator_spec(
    fn: Callable[..., Any], *, attr: str, module: ModuleType | None = None, path: str | None = None
) -> str | None:
    """The import path of ``fn``, found as ``attr`` of config ``module`` (loaded from ``path``).

    A function defined in the config file itself is named by the file; one the config imported
    from a package is named by that package, so the spec stays valid if the file moves. None when
    the function cannot be named (a lambda or a closure passed in from Python).
    """
    owner = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if module is not None and owner == module.__name__:
        if path is None and _importable(module.__name__):
            return f"{module.__name__}:{attr}"
        file = path or getattr(module, "__file__", None)
        return f"{pathlib.Path(file).absolute()}:{attr}" if file else None
    if owner and "<" not in qualname and _importable(owner):
        return f"{owner}:{qualname}"
    return None


def _importable(name: str) -> bool:
    if name == "__main__" or name.startswith("mineonline_user_config_"):
        return False
    return name in sys.modules or importlib.util.find_spec(name) is not None


def import_generator(spec: str, *, key: str) -> Callable[[], Any]:
    """The function ``spec`` names; a ``ConfigError`` naming ``key`` when it cannot be found."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ConfigError(
            f"{key}: {spec!r} is not an import path. Fix: write 'package.module:function' or "
            f"'path/to/config.py:function'."
        )
    if target.endswith(".py"):
        path = pathlib.Path(target).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"{key}: {spec!r} names the file {str(path)!r}, which does not exist here. Fix: restore the "
                f"file, or point {key} at the function elsewhere ({key}=package.module:function)."
            )
        module = import_file(path.absolute())
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ConfigError(
                f"{key}: cannot import module {target!r} ({exc}). Fix: install the package that provides it."
            ) from exc
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise ConfigError(f"{key}: {target!r} defines no function {attr!r}. Fix: name a function taking no arguments.")
    return obj


def import_file(path: pathlib.Path) -> ModuleType:
    """Execute a config module from its path under a unique name.

    It leaves ``sys.modules`` afterwards so that Ray's cloudpickle ships its generators by value:
    workers need not be able to import the user's file.
    """
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"mineonline_user_config_{digest}_{next(_module_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"Config module {str(path)!r} cannot be imported as Python.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))  # let it import helper modules next to it
    with import_deadline(path):  # a module that loops at import is reported, naming it, not waited on forever
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise ConfigError(
                f"Importing config module {str(path)!r} failed: {type(exc).__name__}: {exc}. Fix: "
                f"run `python {path}` to see the full traceback and correct the module."
            ) from exc
        finally:
            sys.modules.pop(name, None)
            if str(path.parent) in sys.path:
                sys.path.remove(str(path.parent))
    return module


class Deferred:
    """A generator carried as cloudpickle bytes, unpickled only by the process that calls it.

    The rollout manager hands the policy and env generators to its workers without calling them:
    deferred, it never imports what they need (torch, the env's package), which would add seconds
    to every run's start-up before the workers even exist.
    """

    def __init__(self, fn: Callable[[], Any]) -> None:
        from ray import cloudpickle

        self._payload = cloudpickle.dumps(fn)

    def __call__(self) -> Any:
        from ray import cloudpickle

        return cloudpickle.loads(self._payload)()
