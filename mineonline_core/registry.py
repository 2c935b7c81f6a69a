"""The plugin manager and the component registries.

``get_plugin_manager()`` builds a fresh ``pluggy.PluginManager``: it adds the hook specs, registers the
core's own defaults, then loads each entry point of the group ``mineonline`` one at a time. A plugin
that fails to import is recorded (distribution, version, exception) instead of breaking every run;
only a run that asks for one of its components fails, and its error names the failure.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
import traceback
from typing import Any

import importlib_metadata
import pluggy

from mineonline_core.contracts import hookspecs
from mineonline_core.errors import DuplicateComponentError, InvalidComponentError, UnknownComponentError, closest

KINDS = ("trainer", "replay_store", "logger", "policy", "env")
REGISTRATION_HOOKS = {
    "trainer": "mineonline_register_trainers",
    "replay_store": "mineonline_register_replay_stores",
    "logger": "mineonline_register_loggers",
    "policy": "mineonline_register_policies",
    "env": "mineonline_register_envs",
}

# Which config key selects each kind, and which distribution ships the well-known names.
CONFIG_KEYS = {
    "trainer": "trainer_name",
    "replay_store": "rollout_config.replay_buffer_config.database_config.backend",
    "logger": "logger_config.loggers",
    "policy": "policy_config.name",
    "env": "env_config.name",
}
TITLES = {
    "trainer": "trainers",
    "replay_store": "replay stores",
    "logger": "loggers",
    "policy": "policies",
    "env": "envs",
}
# The base class each kind's components subclass, as (module, class). Checked without importing the
# module: a class that subclasses it has imported it already, and the trainer's pulls in torch.
BASE_CLASSES = {
    "trainer": ("mineonline_core.trainer.base", "BaseTrainer"),
    "replay_store": ("mineonline_core.contracts.store", "FragmentStore"),
    "logger": ("mineonline_core.contracts.logger", "Logger"),
    "policy": ("mineonline_core.contracts.policy", "Policy"),
    "env": ("mineonline_core.contracts.envs", "EnvFactory"),
}
KNOWN_DISTRIBUTIONS = {
    "PPOTrainer": "mineonline-ppo",
    "lmdb": "mineonline-lmdb-buffer",
    "wandb": "mineonline-wandb-logger",
    "vpt": "mineonline-vpt-policy",
}


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a component came from: the plugin's name, its distribution and version."""

    plugin: str
    distribution: str
    version: str

    def __str__(self) -> str:
        return f"{self.distribution} {self.version} (plugin {self.plugin!r})"


@dataclasses.dataclass(frozen=True)
class LoadFailure:
    """An entry point that could not be loaded."""

    entry_point: str
    distribution: str
    version: str
    error: str

    def __str__(self) -> str:
        return f"{self.entry_point} from {self.distribution} {self.version}: {self.error}"


class Registry:
    """Components of one kind, keyed by each class's declared ``name``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, type] = {}
        self._origins: dict[str, Origin] = {}

    def add(self, cls: type, origin: Origin) -> None:
        check_component(self.kind, cls, origin)
        name = cls.name
        if name in self._classes:
            raise DuplicateComponentError(
                f"Two plugins register a {self.kind} named {name!r}: "
                f"{self._classes[name].__module__}.{self._classes[name].__qualname__} from "
                f"{self._origins[name]} and {cls.__module__}.{cls.__qualname__} from {origin}. "
                f"Uninstall one of them, or rename one class's 'name'."
            )
        self._classes[name] = cls
        self._origins[name] = origin

    def names(self) -> list[str]:
        return sorted(self._classes)

    def origin(self, name: str) -> Origin:
        return self._origins[name]

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def items(self) -> list[tuple[str, type, Origin]]:
        return [(n, self._classes[n], self._origins[n]) for n in self.names()]


def check_component(kind: str, cls: Any, origin: Origin) -> None:
    """Raise ``InvalidComponentError`` naming the plugin and everything ``cls`` lacks to be a ``kind``:
    a class, subclassing the kind's base class, a non-empty string ``name`` and a pydantic ``Config``."""
    from pydantic import BaseModel

    module, base_name = BASE_CLASSES[kind]
    base = getattr(sys.modules.get(module), base_name, None)
    what = f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', repr(cls))}"
    if not isinstance(cls, type):
        raise InvalidComponentError(
            f"{origin} registered {cls!r} as a {kind.replace('_', ' ')}, but it is not a class. "
            f"Fix: register the class itself (a subclass of {module}.{base_name})."
        )
    missing = []
    if base is None or not issubclass(cls, base):
        missing.append(f"it does not subclass {module}.{base_name}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        missing.append(f"it has no string class attribute 'name' (for example name = {cls.__name__!r})")
    config = getattr(cls, "Config", None)
    if not (isinstance(config, type) and issubclass(config, BaseModel)):
        missing.append("its 'Config' is not a pydantic model class (the options it accepts)")
    if missing:
        raise InvalidComponentError(
            f"{origin} registered {what} as a {kind.replace('_', ' ')}, but "
            + "; ".join(missing)
            + f". Fix the class in module {cls.__module__}, or uninstall {origin.distribution}."
        )


class PluginManager(pluggy.PluginManager):
    """A pluggy manager that also owns the registries and the record of failed plugins."""

    def __init__(self) -> None:
        super().__init__("mineonline")
        self.add_hookspecs(hookspecs)
        self.registries = {kind: Registry(kind) for kind in KINDS}
        self.load_failures: list[LoadFailure] = []
        self._origins: dict[int, Origin] = {}

    def add_plugin(self, plugin: Any, origin: Origin) -> None:
        """Register a plugin object (module or instance) and collect its components."""
        self.register(plugin, name=origin.plugin)
        self._origins[id(plugin)] = origin
        try:
            self._collect(plugin, origin)
        except Exception:
            self.remove_plugin(plugin)  # all of a plugin or none of it
            raise

    def remove_plugin(self, plugin: Any) -> None:
        """Unregister a plugin and drop the components it registered."""
        origin = self._origins.pop(id(plugin))
        self.unregister(plugin)
        for registry in self.registries.values():
            for name in [n for n, _, o in registry.items() if o == origin]:
                del registry._classes[name], registry._origins[name]

    def _collect(self, plugin: Any, origin: Origin) -> None:
        # Call only this plugin's registration hooks, so each component is attributed to its origin.
        for kind, hook_name in REGISTRATION_HOOKS.items():
            for impl in getattr(self.hook, hook_name).get_hookimpls():
                if impl.plugin is plugin:
                    register = functools.partial(self.registries[kind].add, origin=origin)
                    impl.function(*([register] if "register" in impl.argnames else []))

    def lookup(self, kind: str, name: str, *, config_key: str | None = None) -> type:
        """The class registered as ``name``, or an ``UnknownComponentError`` that explains everything."""
        registry = self.registries[kind]
        if name in registry:
            return registry._classes[name]
        raise UnknownComponentError(self.unknown_message(kind, name, config_key=config_key))

    def unknown_message(self, kind: str, name: str, *, config_key: str | None = None) -> str:
        registry = self.registries[kind]
        key = config_key or CONFIG_KEYS[kind]
        lines = [f"{key}: no {kind.replace('_', ' ')} named {name!r} is installed (plugin may not be installed)."]
        suggestion = closest(name, registry.names())
        if suggestion:
            value = f"[{suggestion}]" if kind == "logger" else suggestion
            lines.append(f"Did you mean {suggestion!r}? Set {key}={value}.")
        if registry.names():
            lines.append(f"Available {TITLES[kind]}:")
            lines += [f"  {n:<16} {o.distribution} {o.version}" for n, _, o in registry.items()]
        else:
            lines.append(f"No {kind.replace('_', ' ')} is registered at all.")
        if self.load_failures:
            lines.append("Plugins that failed to load:")
            lines += [f"  {failure}" for failure in self.load_failures]
        dist = KNOWN_DISTRIBUTIONS.get(name) or KNOWN_DISTRIBUTIONS.get(suggestion or "")
        hint = f"pip install {dist}" if dist else "pip install the plugin that provides it"
        lines.append(f"To add it: {hint}, then check with `mineonline plugins`.")
        return "\n".join(lines)


def _distribution_of(entry_point: importlib_metadata.EntryPoint) -> tuple[str, str]:
    dist = entry_point.dist
    if dist is None:
        return "unknown", "?"
    return dist.metadata["Name"], dist.version


def get_plugin_manager(*, load_entry_points: bool = True) -> PluginManager:
    """Build a fresh plugin manager: hook specs, the core's defaults, then every installed plugin."""
    from mineonline_core.builtin import defaults

    pm = PluginManager()
    core_version = importlib_metadata.version("mineonline-core") if _installed("mineonline-core") else "dev"
    pm.add_plugin(defaults, Origin("mineonline_core.builtin.defaults", "mineonline-core", core_version))
    if load_entry_points:
        for entry_point in importlib_metadata.entry_points(group="mineonline"):
            distribution, version = _distribution_of(entry_point)
            try:
                plugin = entry_point.load()
                if pm.is_registered(plugin):
                    continue
                pm.add_plugin(plugin, Origin(entry_point.name, distribution, version))
            except DuplicateComponentError:
                raise
            except Exception as exc:  # noqa: BLE001 - any import error is recorded, not fatal
                detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                pm.load_failures.append(LoadFailure(entry_point.name, distribution, version, detail))
    pm.check_pending()
    return pm


def _installed(distribution: str) -> bool:
    try:
        importlib_metadata.distribution(distribution)
        return True
    except importlib_metadata.PackageNotFoundError:
        return False


def import_string(path: str) -> Any:
    """Import ``package.module:attr`` or ``package.module.attr``."""
    module, _, attr = path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), attr)
