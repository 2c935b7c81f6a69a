"""One error family: every failure a user can cause derives from ``MineOnlineError``.

The CLI prints ``str(error)`` without a traceback, so each message must stand on its own: what is
wrong, under which config key, with which value, and how to fix it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator
from typing import TypeVar


E = TypeVar("E", bound=BaseException)


def last_line(error: BaseException | str, *, limit: int | None = None) -> str:
    """The informative line of an error: the last non-blank line of its text (a traceback's ``Type:
    message``, the cause at the end of a Ray error), cut to ``limit`` characters; the exception's type
    name when it has no text."""
    text = error if isinstance(error, str) else str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "unknown error" if isinstance(error, str) else type(error).__name__
    return lines[-1][:limit]


class MineOnlineError(Exception):
    """Base class of every error mineonline raises on purpose."""


class ConfigError(MineOnlineError):
    """A config value is missing, of the wrong type, out of range or inconsistent with another."""


class UnknownComponentError(ConfigError):
    """A trainer, store, logger, policy or env name that no installed plugin registers."""


class DuplicateComponentError(MineOnlineError):
    """Two plugins register the same name for the same kind of component."""


class InvalidComponentError(MineOnlineError, TypeError):
    """A plugin registered a class that is not a valid component of its kind (base class, name, Config)."""


class CheckpointError(MineOnlineError):
    """A checkpoint is missing, truncated, corrupted or incompatible with the model."""


class RunFailedError(MineOnlineError):
    """A run ended because an actor, a thread or an env failed in a way it cannot recover from."""


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most similar to ``name`` (case-insensitive), or None when nothing is close.

    Similar means a typo away: what differs, once the prefix and suffix the two share are set aside, is a
    block one of them adds (``entropy_coef`` for ``entropy_bonus_coef``) or about one edit in three
    characters (``PP0Trainer``, ``logunifrom``). A long shared part alone is not similarity: "SACTrainer"
    and "A2CTrainer" share "Trainer", and SAC is not A2C."""
    lowered = {c.lower(): c for c in candidates}
    target = name.lower()
    scored = [(difflib.SequenceMatcher(None, target, c).ratio(), c) for c in lowered if _typo_away(target, c)]
    best = max((item for item in scored if item[0] >= 0.6), default=None)
    return lowered[best[1]] if best else None


def _typo_away(a: str, b: str) -> bool:
    start = 0
    while start < min(len(a), len(b)) and a[start] == b[start]:
        start += 1
    end = 0
    while end < min(len(a), len(b)) - start and a[-1 - end] == b[-1 - end]:
        end += 1
    a, b = a[start : len(a) - end], b[start : len(b) - end]
    return not a or not b or _edits(a, b) <= max(1, max(len(a), len(b)) // 3)


def _edits(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and swaps of neighbours turning ``a`` into ``b``."""
    rows = [list(range(len(b) + 1))]
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(rows[-1][j] + 1, row[j - 1] + 1, rows[-1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], rows[-2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


def find_user_error(exc: BaseException) -> MineOnlineError | None:
    """The ``MineOnlineError`` behind ``exc``, looking through Ray's and Ray Train's wrappers.

    An error a user can fix (a bad store layout, a checkpoint from another model) is often raised in an
    actor or a Ray Train rank and reaches the driver wrapped several times; the user must see its
    message, not the wrappers' tracebacks.
    """
    return find_cause(exc, MineOnlineError)


def find_cause(exc: BaseException, cls: type[E]) -> E | None:
    """The first exception of class ``cls`` in ``exc``'s chain of causes and wrapped errors."""
    return next((err for err in iter_causes(exc) if isinstance(err, cls)), None)


def iter_causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the errors Ray's wrappers hold (``cause``, attributes, dicts)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        todo += [err.__cause__, err.__context__, getattr(err, "cause", None)]
        for value in vars(err).values() if hasattr(err, "__dict__") else ():
            if isinstance(value, BaseException):
                todo.append(value)
            elif isinstance(value, dict):
                todo += [v for v in value.values() if isinstance(v, BaseException)]


class SampleTimeout(MineOnlineError):
    """``sample`` found too few eligible chunks within its timeout; the message says why."""


class SampleStopped(MineOnlineError):
    """``sample`` was waiting for chunks when the run was asked to stop (``stop_waiting``)."""
