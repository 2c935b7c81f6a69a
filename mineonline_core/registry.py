"""The plugin manager and the component registries.

``get_plugin_manager()`` builds a fresh ``pluggy.PluginManager``: it adds the hook specs, registers the
core's own defaults, then loads each entry point of the group ``mineonline`` one at a time. A plugin
that fails to import is recorded (distribution, version, exception) instead of breaking every run;
only a run that asks for one of its components fails, and its error names the failure.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import traceback
from typing import Any

import importlib_metadata
import pluggy

from mineonline_core.contracts import hookspecs
from mineonline_core.contracts.kinds import BY_NAME, KINDS, Kind
from mineonline_core.errors import DuplicateComponentError, InvalidComponentError, UnknownComponentError, closest


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

    def __init__(self, kind: Kind) -> None:
        self.kind = kind
        self._entries: dict[str, tuple[type, Origin]] = {}

    def add(self, cls: type, origin: Origin) -> None:
        check_component(self.kind.name, cls, origin)
        name = cls.name
        if name in self._entries:
            other, other_origin = self._entries[name]
            raise DuplicateComponentError(
                f"Two plugins register a {self.kind.name} named {name!r}: "
                f"{other.__module__}.{other.__qualname__} from {other_origin} and "
                f"{cls.__module__}.{cls.__qualname__} from {origin}. "
                f"Uninstall one of them, or rename one class's 'name'."
            )
        self._entries[name] = (cls, origin)

    def get(self, name: str) -> type:
        """The class registered as ``name`` (a ``KeyError`` if none is)."""
        return self._entries[name][0]

    def origin(self, name: str) -> Origin:
        return self._entries[name][1]

    def remove_origin(self, origin: Origin) -> None:
        """Drop every component ``origin`` registered."""
        for name in [n for n, (_, o) in self._entries.items() if o == origin]:
            del self._entries[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def items(self) -> list[tuple[str, type, Origin]]:
        return [(n, *self._entries[n]) for n in self.names()]


def check_component(kind: str, cls: Any, origin: Origin) -> None:
    """Raise ``InvalidComponentError`` naming the plugin and everything ``cls`` lacks to be a ``kind``:
    a class, subclassing the kind's base class, a non-empty string ``name`` and a pydantic ``Config``."""
    from pydantic import BaseModel

    record = BY_NAME[kind]
    module, base_name = record.base_module, record.base_name
    base = getattr(sys.modules.get(module), base_name, None)
    what = f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', repr(cls))}"
    if not isinstance(cls, type):
        raise InvalidComponentError(
            f"{origin} registered {cls!r} as a {record.label}, but it is not a class. "
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
            f"{origin} registered {what} as a {record.label}, but "
            + "; ".join(missing)
            + f". Fix the class in module {cls.__module__}, or uninstall {origin.distribution}."
        )


class PluginManager(pluggy.PluginManager):
    """A pluggy manager that also owns the registries and the record of failed plugins."""

    def __init__(self) -> None:
        super().__init__("mineonline")
        self.add_hookspecs(hookspecs)
        self.registries = {kind.name: Registry(kind) for kind in KINDS}
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
            registry.remove_origin(origin)

    def _collect(self, plugin: Any, origin: Origin) -> None:
        # Call only this plugin's registration hooks, so each component is attributed to its origin.
        for kind in KINDS:
            for impl in getattr(self.hook, kind.hook).get_hookimpls():
                if impl.plugin is plugin:
                    register = functools.partial(self.registries[kind.name].add, origin=origin)
                    impl.function(*([register] if "register" in impl.argnames else []))

    def lookup(self, kind: str, name: str, *, config_key: str | None = None) -> type:
        """The class registered as ``name``, or an ``UnknownComponentError`` that explains everything."""
        registry = self.registries[kind]
        if name in registry:
            return registry.get(name)
        raise UnknownComponentError(self.unknown_message(kind, name, config_key=config_key))

    def unknown_message(self, kind: str, name: str, *, config_key: str | None = None) -> str:
        registry = self.registries[kind]
        record = registry.kind
        key = config_key or record.config_key
        lines = [f"{key}: no {record.label} named {name!r} is installed (plugin may not be installed)."]
        suggestion = closest(name, registry.names())
        if suggestion:
            value = f"[{suggestion}]" if record.many else suggestion
            lines.append(f"Did you mean {suggestion!r}? Set {key}={value}.")
        if registry.names():
            lines.append(f"Available {record.plural}:")
            lines += [f"  {n:<16} {o.distribution} {o.version}" for n, _, o in registry.items()]
        else:
            lines.append(f"No {record.label} is registered at all.")
        if self.load_failures:
            lines.append("Plugins that failed to load:")
            lines += [f"  {failure}" for failure in self.load_failures]
        dist = record.distribution(name) or record.distribution(suggestion or "")
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


# The kind table of docs/plugins.md sits between these lines; `mineonline plugins --table --output FILE`
# rewrites it there, and tests/test_kinds.py checks the committed page against `kind_table()`.
TABLE_BEGIN = "<!-- kind table: generated from mineonline_core/contracts/kinds.py by `make docs` -->"
TABLE_END = "<!-- end of kind table -->"


def kind_table() -> str:
    """Every hook a plugin may implement as a markdown table: the kinds' records, then the run hooks
    (each with its spec's first sentence)."""
    rows = [
        "| Hook | Registers | Base class | Selected by |",
        "|---|---|---|---|",
        *(f"| `{k.hook}(register)` | {k.plural} | `{k.exported_base}` | `{k.config_key}` |" for k in KINDS),
    ]
    kind_hooks = {k.hook for k in KINDS}
    for name in [n for n in vars(hookspecs) if n.startswith("mineonline_") and n not in kind_hooks]:
        spec = getattr(hookspecs, name)
        summary = " ".join((spec.__doc__ or "").split()).split(". ")[0].rstrip(".")
        params = ", ".join(inspect.signature(spec).parameters)
        rows.append(f"| `{name}({params})` | — | — | {summary} |")
    return "\n".join(rows) + "\n"


def with_kind_table(page: str) -> str:
    """``page`` with the text between its table markers replaced by ``kind_table()``."""
    return replace_between(page, TABLE_BEGIN, TABLE_END, kind_table(), what="kind table")


def replace_between(page: str, begin: str, end: str, table: str, *, what: str) -> str:
    """``page`` with the text between the lines ``begin`` and ``end`` replaced by ``table`` (a generated table)."""
    head, found_begin, rest = page.partition(begin + "\n")
    _, found_end, tail = rest.partition(end)
    if not found_begin or not found_end:
        raise ValueError(f"the page has no lines {begin!r} ... {end!r} to put the {what} between")
    return head + found_begin + "\n" + table + "\n" + found_end + tail
