"""Every hook a mineonline plugin may implement.

A plugin is a module registered under the entry-point group ``mineonline``::

    [project.entry-points.mineonline]
    my_plugin = "my_package.my_module"

and implements any of the hooks below with ``@mineonline_core.hookimpl``. A hook implementation may
accept fewer arguments than its spec, so specs can grow without breaking plugins.

Registration hooks (``mineonline_register_trainers``, ``_replay_stores``, ``_loggers``, ``_policies``,
``_envs``) are written below from the kinds' records in ``kinds.py``, one per kind; each receives a
``register`` callback owned by the host: call it once per component class. The host validates the class (a ``name``, a pydantic ``Config``, the right base class) and
rejects duplicate names, naming both origins. Registration hooks run once per plugin manager, in
whichever process builds one: the driver (``mineonline run``/``check``/``plugins``) and, because
registries are rebuilt rather than shipped, in Ray workers that resolve a component by name.
"""

from __future__ import annotations

from typing import Any, Callable

import pluggy

from mineonline_core.contracts.kinds import KINDS, Kind

hookspec = pluggy.HookspecMarker("mineonline")
hookimpl = pluggy.HookimplMarker("mineonline")

Register = Callable[[type], None]

# ---------------------------------------------------------------------------------------------
# Component registration: one hook per kind, written from its record in ``kinds.py``
# ---------------------------------------------------------------------------------------------


def _registration_spec(kind: Kind) -> Callable[[Register], None]:
    def spec(register: Register) -> None:
        pass

    spec.__name__ = spec.__qualname__ = kind.hook
    spec.__doc__ = (
        f"Register {kind.plural}, selected by ``{kind.config_key}``.\n\n"
        f"Called once per plugin when the plugin manager is built. Call ``register(cls)`` once per class: "
        f"each subclasses ``{kind.exported_base}`` and declares ``name`` (for example ``{kind.example!r}``) "
        f"and a pydantic ``Config``; {kind.contract}. Returns nothing."
    )
    return hookspec(spec)


for _kind in KINDS:
    globals()[_kind.hook] = _registration_spec(_kind)
del _kind


# ---------------------------------------------------------------------------------------------
# Run lifecycle
# ---------------------------------------------------------------------------------------------


@hookspec
def mineonline_run_start(config: Any, run_dir: str) -> None:
    """Called on the driver once a run's config is resolved and its run directory exists, before
    any Ray actor starts. ``config`` is the validated ``OnlineConfig``; ``run_dir`` an absolute path.
    Returns nothing; an exception aborts the run before any work starts.
    """


@hookspec
def mineonline_run_finish(config: Any, run_dir: str, status: str) -> None:
    """Called on the driver when a run ends, after the final checkpoint and the report are written.
    ``status`` is ``"completed"``, ``"interrupted"`` or ``"failed"``. Returns nothing; exceptions
    are logged and do not change the run's status.
    """
