"""Turn pydantic's validation errors into one ``ConfigError`` a user can act on.

Each problem becomes one line: the dotted key, what is wrong, the offending value and the fix
(the closest valid key for a typo, the valid range and default for a bad number).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from mineonline_core.config._fields import range_text, section_type
from mineonline_core.config.online import OnlineConfig
from mineonline_core.config.secrets import REDACTED, is_secret_key, redact, redact_override
from mineonline_core.errors import ConfigError, closest

Loc = tuple[Any, ...]

_RANGE_OPS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}
_NOUNS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "model_type": "a mapping of keys to values",
    "model_attributes_type": "a mapping of keys to values",
    "dict_type": "a mapping of keys to values",
    "finite_number": "a finite number",
}


def show(value: Any, limit: int = 60) -> str:
    """A short repr of a user value for an error message."""
    try:
        text = repr(value)
    except Exception:  # a value whose repr fails must not hide the config error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _num(value: Any) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def dotted(loc: Loc) -> str:
    """``('train_config', 'lr')`` -> ``train_config.lr``; list indexes as ``[0]``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"


def _walk(loc: Loc, root: type[BaseModel] = OnlineConfig) -> tuple[type[BaseModel] | None, FieldInfo | None]:
    """The section model holding the last named key of ``loc``, and that key's field."""
    model: type[BaseModel] | None = root
    parent, info = None, None
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            break
        parent, info = model, model.model_fields[part]
        model = section_type(info.annotation)
    return parent, info


def _section_fields(loc: Loc) -> list[str]:
    model: type[BaseModel] | None = OnlineConfig
    for part in loc:
        info = model.model_fields.get(part) if model and isinstance(part, str) else None
        model = section_type(info.annotation) if info else None
    return sorted(model.model_fields) if model else []


def _hint(info: FieldInfo | None) -> str:
    if info is None:
        return ""
    text = (info.description or "").split(". ")[0].rstrip(".")
    default = info.get_default(call_default_factory=True)
    if info.is_required() or isinstance(default, BaseModel):
        return f" ({text})" if text else ""
    return f" ({text}; default {show(default)})" if text else f" (default {show(default)})"


def describe(error: Mapping[str, Any], *, root: type[BaseModel] = OnlineConfig, prefix: Loc = ()) -> str:
    """One line for one pydantic error: key, problem, value, fix. ``root`` is the model that was
    validated, ``prefix`` where it sits in the whole config (a plugin's section)."""
    loc: Loc = tuple(error.get("loc", ()))
    kind, value, path = error.get("type", ""), error.get("input"), dotted(prefix + loc)
    value = REDACTED if any(is_secret_key(part) for part in loc) else redact(value)  # messages reach logs
    _, info = _walk(loc, root)
    if kind == "extra_forbidden":
        names = _section_fields(loc[:-1])
        guess = closest(str(loc[-1]), names)
        if guess:
            return (
                f"{path}: unknown key (value {show(value)}). Did you mean {guess!r}? Fix: rename the key to {guess!r}."
            )
        where = dotted(loc[:-1]) if loc[:-1] else "the top level"
        return (
            f"{path}: unknown key (value {show(value)}). Fix: remove it or use one of the keys "
            f"of {where}: {', '.join(names)}."
        )
    if kind == "missing":
        return f"{path}: required key is missing. Fix: add it{_hint(info)}."
    if kind in _RANGE_OPS:
        attr, op = _RANGE_OPS[kind]
        limit = (error.get("ctx") or {}).get(attr)
        allowed = (range_text(info) if info else "") or f"{op} {_num(limit)}"
        allowed = f"with {allowed}" if "x" in allowed else allowed
        return f"{path}: must be {op} {_num(limit)}, got {show(value)}. Fix: use a value {allowed}{_hint(info)}."
    if kind in _NOUNS:
        noun = _NOUNS[kind]
        quote = " (quote it in YAML)" if kind == "string_type" else ""
        return (
            f"{path}: must be {noun}, got {show(value)} ({type(value).__name__}). "
            f"Fix: set it to {noun}{quote}{_hint(info)}."
        )
    if kind == "value_error":
        reason = str((error.get("ctx") or {}).get("error", error.get("msg", "")))
        return f"{path}: {reason} (got {show(value)})."
    return f"{path}: {error.get('msg', 'invalid value')}, got {show(value)}{_hint(info)}."


def _origin(loc: Loc, origins: Mapping[Loc, str]) -> str:
    for size in range(len(loc), 0, -1):
        if loc[:size] in origins:
            return f" [set by override '{redact_override(origins[loc[:size]])}']"
    return ""


def validate_options(
    owner: type,
    data: Mapping[str, Any] | None,
    *,
    section: str,
    kind: str = "",
    core: Sequence[str] = (),
    origins: Mapping[Loc, str] | None = None,
) -> BaseModel:
    """A component's options: ``data`` validated against ``owner.Config``, or ONE ``ConfigError`` in the
    style of ``validate_online_config``. The one validator of every component's options (trainer, store,
    env, policy, loggers). ``section`` is the dotted key the options sit under, ``kind`` names the
    component's kind in the message ("trainer"), ``core`` the keys the core owns in the same section
    (offered as close matches too); an unknown key names the component and the closest keys."""
    options_cls = owner.Config
    try:
        return options_cls.model_validate(dict(data or {}))
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    prefix: Loc = tuple(section.split("."))
    who = f"{kind} {owner.name!r}" if kind else repr(owner.name)
    own = sorted(options_cls.model_fields)
    problems = []
    for err in errors:
        loc = tuple(err.get("loc", ()))
        where = _origin(prefix + loc, origins or {})
        if err.get("type") != "extra_forbidden":
            problems.append(describe(err, root=options_cls, prefix=prefix) + where)
            continue
        key = str(loc[-1])
        value = REDACTED if is_secret_key(key) else redact(err.get("input"))
        matches = difflib.get_close_matches(key, sorted(core) + own, n=3, cutoff=0.6)
        also = " or a core key (`mineonline config docs` lists both)" if core else ""
        fix = (
            f"Did you mean {' or '.join(repr(m) for m in matches)}? Fix: rename the key."
            if matches
            else f"Fix: remove it, or use one of {owner.name}'s keys ({', '.join(own) or 'none'}){also}."
        )
        problems.append(f"{dotted(prefix + loc)}: unknown key for {who} (value {show(value)}). {fix}{where}")
    count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
    raise ConfigError(f"Invalid {section} for {who} ({count}):\n" + "\n".join(f"  - {p}" for p in problems))


def validate_trainer_options(
    trainer_cls: type, train_config: BaseModel, *, origins: Mapping[Loc, str] | None = None
) -> BaseModel:
    """The selected trainer's ``Config`` from its section: the ``train_config`` keys the core does not
    own (``validate_options``; an unknown key is matched against the core's keys too)."""
    return validate_options(
        trainer_cls,
        train_config.model_extra,
        section="train_config",
        kind="trainer",
        core=list(type(train_config).model_fields),
        origins=origins,
    )


def validate_online_config(
    data: Any, *, origins: Mapping[Loc, str] | None = None, source: str | None = None
) -> OnlineConfig:
    """Validate a plain nested dict into an ``OnlineConfig``, or raise ONE ``ConfigError``.

    ``origins`` maps key paths to the command-line override that set them, so an error in an
    override says so; ``source`` names the file or object the config came from.
    """
    where = f" from {source}" if source else ""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"The config{where} must be a mapping of keys (trainer_name, rollout_config, "
            f"train_config, ...), got {show(data)} ({type(data).__name__}). Fix: pass a dict, an "
            f"OmegaConf DictConfig, a YAML file holding a mapping, or a module with online_dict."
        )
    try:
        return OnlineConfig.model_validate(dict(data))
    except ValidationError as exc:
        problems = [
            describe(err) + _origin(tuple(err.get("loc", ())), origins or {}) for err in exc.errors(include_url=False)
        ]
    count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
    raise ConfigError(
        f"Invalid config{where} ({count}; `mineonline config docs` lists every key):\n"
        + "\n".join(f"  - {p}" for p in problems)
    )
