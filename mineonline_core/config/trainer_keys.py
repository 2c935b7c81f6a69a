"""Switching trainers by name: ``train_config`` keys that belong to another installed trainer.

A config written for one algorithm carries that algorithm's keys in ``train_config`` (``ppo_clip``,
``ppo_vf_coef``, ...). Selecting another trainer by name on the command line
(``trainer_name=ReinforceTrainer``) must not make the user delete them one by one, so the keys that
another installed trainer's ``Config`` declares and the selected one does not are set aside: removed
from the section before the selected trainer validates it, and named in ONE warning line, so nothing
is dropped silently. A key that no installed trainer declares is still an error (a typo stays a typo),
and a key the selected trainer declares is always its own. The keys set aside are gone from the
resolved config too, so the run's saved ``config.yaml`` holds only what the run used.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel


def foreign_trainer_keys(
    selected: type, train_config: BaseModel, trainers: Iterable[tuple[str, type]]
) -> dict[str, list[str]]:
    """``{key: [other trainers declaring it]}`` for every ``train_config`` key outside the core's fields
    that the ``selected`` trainer's ``Config`` does not declare and another installed trainer's does."""
    own = set(selected.Config.model_fields)
    owners: dict[str, list[str]] = {}
    for key in train_config.model_extra or {}:
        if key in own:
            continue
        names = sorted(name for name, cls in trainers if cls is not selected and key in cls.Config.model_fields)
        if names:
            owners[key] = names
    return owners


def set_aside_foreign_keys(selected: type, train_config: BaseModel, trainers: Iterable[tuple[str, type]]) -> str | None:
    """Remove other trainers' keys from ``train_config`` (in place); return the warning line naming
    them, or None when there were none."""
    owners = foreign_trainer_keys(selected, train_config, list(trainers))
    if not owners:
        return None
    extra = train_config.model_extra
    assert extra is not None  # owners is non-empty only when the section has extra keys
    for key in owners:
        del extra[key]
    by_trainer: dict[str, list[str]] = {}
    for key, names in owners.items():
        by_trainer.setdefault(", ".join(names), []).append(key)
    owned = "; ".join(f"{', '.join(sorted(keys))} ({names})" for names, keys in sorted(by_trainer.items()))
    return (
        f"trainer_name={selected.name}: set aside {len(owners)} train_config key{'s' if len(owners) > 1 else ''} "
        f"that {selected.name} does not use and another installed trainer owns: {owned}."
    )
