"""One error family: every failure a user can cause derives from ``MineOnlineError``.

The CLI prints ``str(error)`` without a traceback, so each message must stand on its own: what is
wrong, under which config key, with which value, and how to fix it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MineOnlineError(Exception):
    """Base class of every error mineonline raises on purpose."""


class ConfigError(MineOnlineError):
    """A config value is missing, of the wrong type, out of range or inconsistent with another."""


class UnknownComponentError(ConfigError):
    """A trainer, store, logger, policy or env name that no installed plugin registers."""


class DuplicateComponentError(MineOnlineError):
    """Two plugins register the same name for the same kind of component."""


class CheckpointError(MineOnlineError):
    """A checkpoint is missing, truncated, corrupted or incompatible with the model."""


class RunFailedError(MineOnlineError):
    """A run ended because an actor, a thread or an env failed in a way it cannot recover from."""


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most similar to ``name`` (case-insensitive), or None when nothing is close."""
    candidates = list(candidates)
    lowered = {c.lower(): c for c in candidates}
    match = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[match[0]] if match else None
