"""Every hook a mineonline plugin may implement.

A plugin is a module registered under the entry-point group ``mineonline``::

    [project.entry-points.mineonline]
    my_plugin = "my_package.my_module"

and implements any of the hooks below with ``@mineonline_core.hookimpl``. A hook implementation may
accept fewer arguments than its spec, so specs can grow without breaking plugins.

Registration hooks receive a ``register`` callback owned by the host: call it once per component
class. The host validates the class (a ``name``, a pydantic ``Config``, the right base class) and
rejects duplicate names, naming both origins. Registration hooks run once per plugin manager, in
whichever process builds one: the driver (``mineonline run``/``check``/``plugins``) and, because
registries are rebuilt rather than shipped, in Ray workers that resolve a component by name.
"""

from __future__ import annotations

from typing import Any, Callable

import pluggy

hookspec = pluggy.HookspecMarker("mineonline")
hookimpl = pluggy.HookimplMarker("mineonline")

Register = Callable[[type], None]

# ---------------------------------------------------------------------------------------------
# Component registration
# ---------------------------------------------------------------------------------------------


@hookspec
def mineonline_register_trainers(register: Register) -> None:
    """Register trainer classes, selected by ``trainer_name``.

    Called when the plugin manager is built. Each class subclasses
    ``mineonline_core.BaseTrainer`` and declares ``name`` (for example ``"PPOTrainer"``) and a
    pydantic ``Config`` (a ``mineonline_core.TrainerOptions``) validating its own ``train_config``
    keys, the ones the core does not own. Returns nothing.
    """


@hookspec
def mineonline_register_replay_stores(register: Register) -> None:
    """Register fragment-store classes, selected by ``database_config.backend``.

    Called when the plugin manager is built. Each class subclasses
    ``mineonline_core.FragmentStore`` and declares ``name`` (``"memory"``, ``"lmdb"``) and a pydantic
    ``Config`` validating the backend's extra ``database_config`` keys. Returns nothing.
    """


@hookspec
def mineonline_register_loggers(register: Register) -> None:
    """Register metric-logger classes, selected by ``logger_config.loggers``.

    Called when the plugin manager is built. Each class subclasses ``mineonline_core.Logger`` and
    declares ``name`` (``"console"``, ``"wandb"``) and a pydantic ``Config`` validating the keys of
    ``logger_config`` it consumes. Returns nothing.
    """


@hookspec
def mineonline_register_policies(register: Register) -> None:
    """Register policy classes, selected by ``policy_config.name`` in runs without a Python module.

    Called when the plugin manager is built. Each class subclasses ``mineonline_core.Policy``, declares
    ``name`` and ``Config``, and implements ``build(options, *, observation_space, action_space)``.
    Returns nothing.
    """


@hookspec
def mineonline_register_envs(register: Register) -> None:
    """Register env factories, selected by ``env_config.name`` in runs without a Python module.

    Called when the plugin manager is built. Each class subclasses ``mineonline_core.EnvFactory``,
    declares ``name`` and ``Config``, and implements ``build(options) -> gymnasium.Env``.
    Returns nothing.
    """


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
