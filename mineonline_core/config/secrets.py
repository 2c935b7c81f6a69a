"""What a run writes about its config never holds a secret or an environment variable's value.

Three places carry a config out of the process: the run directory (``config.yaml``, ``run.json``,
``source_config.txt``), checkpoints (``config.yaml``) and loggers (wandb's run config, the console).
All of them go through this module:

* the value of every key that looks like a credential (``SECRET_KEY``) becomes ``"<redacted>"``,
  in the config tree, in command-line overrides and in the raw text of a config file;
* a value that came from an OmegaConf interpolation (``${oc.env:HOME}``) is written as the
  expression the user wrote, not as its expansion, so a saved file never copies the environment.
  ``load_config`` records those expressions on the config (``set_expressions``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"
# Matched anywhere in a key: api_key, apiKey, wandb_token, secret_key, password, passwd, credentials,
# private_key, and 'auth' as a word part (auth, auth_header) but not 'author'.
SECRET_KEY = re.compile(
    r"api[_-]?key|token|secret|passw(?:or)?d|credential|private[_-]?key|(?:^|[_-])auth(?:$|[_-])", re.IGNORECASE
)
# A secret-looking key followed by ':' or '=' and its value (quoted, or up to a separator), in YAML
# or Python source text.
_ASSIGNMENT = re.compile(
    r"""(["']?\b[\w-]*"""
    r"""(?:api[_-]?key|apikey|token|secret|passw(?:or)?d|credential|private[_-]?key)"""
    r"""[\w-]*["']?\s*[:=]\s*)"""
    r"""("[^"\n]*"|'[^'\n]*'|[^\s,}\]#)]+)""",
    re.IGNORECASE,
)

Path = tuple[Any, ...]


def is_secret_key(key: Any) -> bool:
    return isinstance(key, str) and bool(SECRET_KEY.search(key))


def redact(tree: Any) -> Any:
    """A copy of a config tree with the value of every secret-looking key replaced."""
    if isinstance(tree, Mapping):
        return {k: (REDACTED if is_secret_key(k) and v is not None else redact(v)) for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact(v) for v in tree]
    return tree


def redact_text(text: str) -> str:
    """``text`` (a YAML file, a Python module) with the value of every secret-looking assignment replaced."""
    return _ASSIGNMENT.sub(lambda m: m.group(1) + f'"{REDACTED}"', text)


def redact_override(item: str) -> str:
    """``a.api_key=VALUE`` -> ``a.api_key=<redacted>``, and ``a={api_key: VALUE}`` (a secret inside the
    value, at any depth) -> ``a=<redacted>``; other overrides unchanged."""
    key, sep, value = item.partition("=")
    if sep and (any(is_secret_key(part) for part in key.strip().split(".")) or _holds_secret(value)):
        return f"{key}={REDACTED}"
    return item


def _holds_secret(value: str) -> bool:
    import yaml

    try:  # an override's value is YAML flow syntax; one that does not parse holds no mapping
        tree = yaml.safe_load(value)
    except yaml.YAMLError:
        return False
    return redact(tree) != tree


def is_redacted_override(item: str) -> bool:
    return item.endswith("=" + REDACTED)


# -- interpolations -------------------------------------------------------------------------------


def find_expressions(tree: Any, prefix: Path = ()) -> dict[Path, str]:
    """Paths of the leaves of an unresolved OmegaConf container that are interpolations."""
    found: dict[Path, str] = {}
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            found.update(find_expressions(value, (*prefix, key)))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            found.update(find_expressions(value, (*prefix, index)))
    elif isinstance(tree, str) and "${" in tree:
        found[prefix] = tree
    return found


def override_expressions(expressions: dict[Path, str], path: Path, raw_value: str) -> dict[Path, str]:
    """``expressions`` after an override set ``path`` to ``raw_value`` (which may itself be one)."""
    kept = {p: e for p, e in expressions.items() if p[: len(path)] != path}
    if "${" in raw_value:
        kept[path] = raw_value.strip()
    return kept


def _put(tree: Any, path: Path, value: str) -> None:
    node = tree
    for part in path[:-1]:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return  # the key did not survive validation (e.g. a defaulted section)
    if (
        isinstance(node, dict)
        and path[-1] in node
        or isinstance(node, list)
        and isinstance(path[-1], int)
        and path[-1] < len(node)
    ):
        node[path[-1]] = value


def public_config(cfg: Any) -> dict:
    """``cfg`` (an ``OnlineConfig``) as the plain dict written to disk and loggers."""
    data = cfg.to_dict() if hasattr(cfg, "to_dict") else cfg.model_dump(mode="json")
    for path, expression in (getattr(cfg, "_expressions", None) or {}).items():
        _put(data, path, expression)
    return redact(data)
