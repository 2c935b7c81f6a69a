"""``load_config``: read a config from a dict, OmegaConf object, YAML file or Python module.

YAML goes through OmegaConf rather than plain PyYAML so that ``${...}`` interpolations work and
``1e-4`` reads as a number (PyYAML's YAML 1.1 reads it as a string).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from mineonline_core.config.checks import check_consistency, ignored_key_warnings
from mineonline_core.config.generators import KEYS, generator_spec, import_file
from mineonline_core.config.messages import Loc, show, validate_online_config
from mineonline_core.config.online import OnlineConfig
from mineonline_core.config.scratch import fill_from_scratch_defaults
from mineonline_core.config.secrets import find_expressions, override_expressions
from mineonline_core.errors import ConfigError

log = logging.getLogger("mineonline")


@dataclasses.dataclass
class LoadedConfig:
    """A validated config plus what a Python config module brought along."""

    config: OnlineConfig
    env_generator: Callable[[], Any] | None = None
    policy_generator: Callable[[], Any] | None = None
    source_text: str | None = None  # the whole config file (MineStudio's ``whole_config``)
    source_path: str | None = None
    expressions: dict[tuple, str] = dataclasses.field(default_factory=dict)  # see config.secrets
    # Key path -> the command-line override that set it: errors found later (the trainer's own
    # train_config keys, checked by resolve()) still name the override.
    origins: dict[tuple, str] = dataclasses.field(default_factory=dict)
    # The from-scratch defaults filled in (config/scratch.py), as the line shown at start; None: none.
    from_scratch: str | None = None


def load_config(
    source: Mapping[str, Any] | DictConfig | str | os.PathLike[str] | ModuleType | OnlineConfig,
    overrides: Sequence[str] = (),
) -> LoadedConfig:
    """Read, override, validate and cross-check a config; raise ``ConfigError`` on any mistake.

    ``overrides`` are OmegaConf dotlist items such as ``train_config.learning_rate=1e-4``,
    applied before validation, so an override of an unknown key fails like a typo in the file.
    """
    loaded, raw, label = _read(source)
    data, origins = apply_overrides(raw, overrides)
    data, loaded.from_scratch = fill_from_scratch_defaults(data)
    loaded.config = validate_online_config(data, origins=origins, source=label)
    loaded.origins = dict(origins)
    for path, item in origins.items():
        loaded.expressions = override_expressions(loaded.expressions, path, item.split("=", 1)[1])
    loaded.config._expressions = dict(loaded.expressions)
    for key in KEYS:
        # An override that names another generator replaces the module's own function.
        if isinstance(raw, Mapping) and getattr(loaded.config, key) != raw.get(key):
            setattr(loaded, key, None)
    check_consistency(loaded.config)
    for message in ignored_key_warnings(loaded.config.train_config):
        log.warning(message)
    return loaded


def apply_overrides(data: Any, overrides: Sequence[str]) -> tuple[Any, dict[Loc, str]]:
    """Merge dotlist overrides into a plain nested dict; also return which key each one set."""
    if isinstance(overrides, str):
        overrides = [overrides]
    origins: dict[Loc, str] = {}
    for item in overrides:
        if not isinstance(item, str) or "=" not in item or not item.split("=", 1)[0].strip():
            raise ConfigError(
                f"Override {show(item)} is not of the form key.path=value. Fix: write it like "
                f"train_config.learning_rate=1e-4 (keys joined by dots, then '=', then the value)."
            )
        try:
            patch = OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=True)
        except Exception as exc:  # OmegaConf's grammar errors have many types; all are user input
            raise ConfigError(
                f"Override {item!r} cannot be parsed: {exc}. Fix: write key.path=value with a "
                f"YAML value, e.g. train_config.learning_rate=1e-4 or logger_config.loggers=[]."
            ) from exc
        origins[tuple(item.split("=", 1)[0].strip().split("."))] = item
        data = _merge(data, patch)
    return data, origins


def _merge(base: Any, patch: Any) -> Any:
    if not isinstance(base, Mapping) or not isinstance(patch, Mapping):
        return patch if isinstance(base, Mapping) or base is None else base
    merged = dict(base)
    for key, value in patch.items():
        old = merged.get(key)
        merged[key] = _merge(old, value) if isinstance(old, Mapping) else value
    return merged


def _plain(value: Any) -> Any:
    """Nested mappings and lists as plain dicts and lists (OmegaConf nodes resolved)."""
    if isinstance(value, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(value, resolve=True)
        except Exception as exc:  # unresolvable interpolation, missing value '???', ...
            raise ConfigError(
                f"The OmegaConf config cannot be resolved: {exc}. Fix: correct or remove the "
                f"interpolation or the missing ('???') value it names."
            ) from exc
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def _read(source: Any) -> tuple[LoadedConfig, Any, str | None]:
    """The config data of ``source``, a LoadedConfig to fill in, and a label for errors."""
    empty = OnlineConfig.model_construct()  # placeholder until validation
    if isinstance(source, ModuleType):
        return _from_module(source, empty, text=_module_text(source))
    if isinstance(source, OnlineConfig):  # re-validated, so overrides and checks still apply
        return LoadedConfig(config=empty, expressions=dict(source._expressions)), source.to_dict(), None
    if isinstance(source, (DictConfig, ListConfig, Mapping)):
        return LoadedConfig(config=empty, expressions=_expressions_of(source)), _plain(source), None
    if isinstance(source, (str, os.PathLike)):
        path = pathlib.Path(os.fspath(source)).expanduser().absolute()
        if not path.is_file():
            raise ConfigError(
                f"Config file {str(path)!r} does not exist or is not a file. Fix: pass the path "
                f"of a .yaml/.yml file or a .py module that defines online_dict."
            )
        suffix = path.suffix.lower()
        if suffix == ".py":
            text = _read_text(path)
            return _from_module(import_file(path), empty, text=text, path=str(path))
        if suffix in (".yaml", ".yml"):
            text = _read_text(path)
            node = _parse_yaml(text, path)
            loaded = LoadedConfig(
                config=empty, source_text=text, source_path=str(path), expressions=_expressions_of(node)
            )
            return loaded, _plain(node), str(path)
        raise ConfigError(
            f"Config file {str(path)!r} has suffix {suffix!r}. Fix: use a .yaml/.yml file or a "
            f".py module defining online_dict (and optionally env_generator, policy_generator)."
        )
    raise ConfigError(
        f"Cannot read a config from {show(source)} ({type(source).__name__}). Fix: pass a dict, "
        f"an OmegaConf DictConfig, a path to a .yaml/.yml file or .py module, or a module object."
    )


def _read_text(path: pathlib.Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"Config file {str(path)!r} cannot be read: {exc}.") from exc


def _parse_yaml(text: str, path: pathlib.Path) -> Any:
    try:
        node = OmegaConf.create(text)
    except Exception as exc:  # YAML syntax errors and OmegaConf's key/type errors alike
        raise ConfigError(
            f"Config file {str(path)!r} is not valid YAML for a config: {exc}. Fix: correct the "
            f"line it names (`mineonline config template` prints a valid file)."
        ) from exc
    return node


def _expressions_of(source: Any) -> dict[tuple, str]:
    """The interpolations (``${oc.env:X}``) among the leaves of ``source``, by key path."""
    if isinstance(source, (DictConfig, ListConfig)):
        try:
            return find_expressions(OmegaConf.to_container(source, resolve=False))
        except Exception:  # noqa: BLE001 - an unreadable node fails with a clear error in _plain
            return {}
    if isinstance(source, Mapping):
        found: dict[tuple, str] = {}
        for key, value in source.items():
            if isinstance(value, (DictConfig, ListConfig, Mapping)):
                found.update({(key, *p): e for p, e in _expressions_of(value).items()})
        return found
    return {}


def _module_text(module: ModuleType) -> str | None:
    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return None


def _from_module(
    module: ModuleType, empty: OnlineConfig, *, text: str | None, path: str | None = None
) -> tuple[LoadedConfig, Any, str]:
    label = path or getattr(module, "__file__", None) or module.__name__
    if not hasattr(module, "online_dict"):
        raise ConfigError(
            f"Config module {label!r} defines no 'online_dict'. Fix: define online_dict = "
            f"{{...}} (MineStudio's format: trainer_name, rollout_config, train_config, "
            f"logger_config), and env_generator / policy_generator functions if the config "
            f"names no env_config / policy_config."
        )
    generators = {}
    for attr in ("env_generator", "policy_generator"):
        value = getattr(module, attr, None)
        if value is not None and not callable(value):
            raise ConfigError(
                f"Config module {label!r}: {attr} is {show(value)} ({type(value).__name__}), not "
                f"a function. Fix: define {attr} as a function taking no arguments that returns "
                f"the {'env' if attr == 'env_generator' else 'policy'}."
            )
        generators[attr] = value
    data = _plain(module.online_dict)
    if isinstance(data, dict):
        for attr, value in generators.items():
            spec = generator_spec(value, attr=attr, module=module, path=path) if value is not None else None
            if spec is not None and attr not in data:
                data[attr] = spec  # saved with the resolved config, so a checkpoint names its generators
    loaded = LoadedConfig(
        config=empty,
        source_text=text,
        source_path=path or getattr(module, "__file__", None),
        **generators,
    )
    loaded.expressions = _expressions_of(module.online_dict)
    return loaded, data, label
