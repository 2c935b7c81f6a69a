"""``mineonline run --resume``: which checkpoint, whether it is whole, whether the config still fits it.

Everything here runs on the driver before Ray starts, so a refused resume costs seconds:

* ``--resume RUN_DIR`` takes the run's newest checkpoint; ``--resume RUN_DIR/checkpoints/checkpoint_N``
  (or ``train_config.resume=...`` on the command line) takes that one.
* The chosen checkpoint is verified against its manifest (sizes and sha256) and its tensor files
  unpickled as the trainer will, ``weights_only`` (a file that would run code is refused, naming it). A
  damaged newest checkpoint is reported with the newest one that verifies, to resume from explicitly.
* The config the resumed run will use is compared with the resolved config the checkpoint was trained
  with. A change that breaks continuity (``CONTINUITY``: the network, the env, the data layout, where
  checkpoints go) is refused, each difference listed, unless ``--force``; other changes (a longer
  ``num_iterations``, a new learning rate) are printed and applied.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Sequence

import yaml

from mineonline_core.config.secrets import is_redacted_override, public_config
from mineonline_core.errors import CheckpointError, ConfigError
from mineonline_core.driver.rundir import RUN_FILE
from mineonline_core.trainer import checkpoint as ckpt

log = logging.getLogger("mineonline")

# Dotted key prefixes whose change makes the checkpoint and the stored data mean something else.
CONTINUITY = (
    "trainer_name",
    "policy_config",
    "env_config",
    "rollout_config.fragment_length",
    "rollout_config.replay_buffer_config.fragments_per_chunk",
    "rollout_config.replay_buffer_config.database_config",
    "train_config.save_path",
    "train_config.use_normalized_vf",
)
# Keys a resume sets itself.
_PLUMBING = ("run_name", "output_dir", "train_config.resume")


@dataclasses.dataclass
class ResumePlan:
    run_dir: Path
    checkpoint: Path
    source: Any  # the run's config file (or its saved config.yaml)
    recorded: list[str]  # the run's overrides as run.json keeps them
    overrides: list[str]  # what load_config gets: recorded + the resume plumbing


def _is_checkpoint(path: Path) -> bool:
    return (path / ckpt.MANIFEST).is_file() or path.name.startswith("checkpoint_")


def _run_dir_of(checkpoint: Path, target: str) -> Path:
    for parent in checkpoint.parents:
        if (parent / RUN_FILE).is_file():
            return parent
    raise ConfigError(
        f"--resume {target}: a checkpoint, but no directory above it holds {RUN_FILE}, so the run it belongs to is "
        "unknown. Fix: give the run directory, --resume RUN_DIR train_config.resume=" + str(checkpoint) + "."
    )


def _save_dir(run_dir: Path) -> Path:
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"--resume {run_dir}: its config.yaml is unreadable ({exc}). Fix: restore it, or start anew."
        ) from None
    return ckpt.resolve_save_path(str((saved.get("train_config") or {}).get("save_path") or "checkpoints"), run_dir)


def _verified(checkpoint: Path, save_dir: Path, target: str) -> Path:
    try:
        verified = ckpt.verify_checkpoint(checkpoint)
        ckpt.check_loads_safely(verified)  # a file swapped for a code-running pickle, its manifest fixed up
        return verified
    except CheckpointError as exc:
        older = [path for iteration, path in reversed(ckpt.list_checkpoints(save_dir)) if path.name < checkpoint.name]
        good = next((path for path in older if _verifies(path)), None)
        offer = (
            f" The newest earlier checkpoint that verifies is {good.name}: resume from it with "
            f"`mineonline run --resume {good}` (the iterations after it are trained again)."
            if good
            else " No earlier checkpoint verifies either: start the run anew."
        )
        raise CheckpointError(f"--resume {target}: {checkpoint.name} is damaged. {exc}{offer}") from None


def _verifies(path: Path) -> bool:
    try:
        ckpt.check_loads_safely(ckpt.verify_checkpoint(path))
    except CheckpointError:
        return False
    return True


def plan_resume(target: str, overrides: Sequence[str]) -> ResumePlan:
    """Find the run and the checkpoint ``--resume target`` means, verified; no Ray, no torch.load."""
    path = Path(target).expanduser().absolute()
    explicit = path if _is_checkpoint(path) else None
    run_dir = _run_dir_of(path, target) if explicit else path
    if not (run_dir / RUN_FILE).is_file():
        raise ConfigError(
            f"--resume {target}: no {RUN_FILE} there, so it is not a mineonline run directory. "
            "Fix: give runs/<run_name>."
        )
    record = json.loads((run_dir / RUN_FILE).read_text())
    user = [o for o in overrides if not o.startswith("train_config.resume=")]
    chosen = [o.split("=", 1)[1] for o in overrides if o.startswith("train_config.resume=")]
    if chosen and chosen[-1].strip() not in ("", "null"):
        explicit = Path(chosen[-1]).expanduser().absolute()
    save_dir = _save_dir(run_dir)
    if explicit is None:
        found = ckpt.list_checkpoints(save_dir)
        if not found:
            raise ConfigError(
                f"--resume {target}: the run wrote no checkpoint yet, so there is nothing to resume. "
                "Fix: start it anew."
            )
        explicit = found[-1][1]
    checkpoint = _verified(explicit, save_dir, target)
    kept = [o for o in record.get("overrides", []) if not is_redacted_override(o)]
    dropped = [o.split("=", 1)[0] for o in record.get("overrides", []) if is_redacted_override(o)]
    if dropped and not any(o.split("=", 1)[0] in dropped for o in user):
        log.warning(
            "--resume: %s was given on the first run's command line and, being a secret, was not saved; "
            "give it again if the run needs it",
            ", ".join(dropped),
        )
    source = record.get("source_path") or str(run_dir / "config.yaml")
    recorded = [*kept, *user]
    plumbing = [f"run_name={record['run_name']}", f"output_dir={run_dir.parent}", f"train_config.resume={checkpoint}"]
    return ResumePlan(
        run_dir=run_dir, checkpoint=checkpoint, source=source, recorded=recorded, overrides=[*recorded, *plumbing]
    )


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


def _under(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def differences(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) for every leaf that differs, plumbing keys aside."""
    old, new = _flatten(saved), _flatten(current)
    keys = sorted(set(old) | set(new))
    return [(k, old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k) and not _under(k, _PLUMBING)]


def verified_resume(resume: str) -> Path:
    """``train_config.resume`` of a plain run, resolved to a checkpoint and verified (with an offer)."""
    path = ckpt.resolve_resume(resume)
    return _verified(path, path.parent, f"(train_config.resume={resume})")


def check_model(resolved: Any, checkpoint: Path) -> None:
    """The checkpoint's weights fit the policy this config builds, compared on the meta-device build."""
    policy = resolved.memory.policy if resolved.memory is not None else None
    if policy is None:
        return  # unknown without a real build: the trainer's preflight compares after building it
    import torch

    state = torch.load(checkpoint / "model.pt", map_location="cpu", weights_only=True, mmap=True)
    ckpt.check_compatible(policy, state, source=str(checkpoint))


def check_continuity(cfg: Any, checkpoint: Path, run_dir: Path, *, force: bool) -> list[str]:
    """Refuse continuity-breaking changes (unless ``force``); return a line per change that is applied."""
    text = ckpt.saved_config(checkpoint)
    against = checkpoint.name if text is not None else f"the run's config.yaml (written before {checkpoint.name})"
    if text is None:
        text = (run_dir / "config.yaml").read_text()
    saved = yaml.safe_load(text) or {}
    diffs = differences(saved, public_config(cfg))
    breaking = [d for d in diffs if _under(d[0], CONTINUITY)]
    if breaking and not force:
        listed = "\n".join(f"  - {key}: {old!r} in {against}, {new!r} now" for key, old, new in breaking)
        raise ConfigError(
            f"--resume {run_dir}: the config differs from the one {against} was trained with, in ways that "
            f"break continuity:\n{listed}\nFix: undo these changes (the run's config.yaml holds the old values), or "
            "start a new run (another run_name) with train_config.resume=" + str(checkpoint) + " to start from "
            "its weights, or pass --force to resume with the new values anyway."
        )
    return [
        f"{key}: {old!r} -> {new!r}" + ("  (breaks continuity; --force)" if _under(key, CONTINUITY) else "")
        for key, old, new in diffs
    ]


def progressed(cfg: Any, resumed: Path) -> bool:
    """Whether a resumed run wrote a checkpoint past the one it started from."""
    latest = ckpt.latest_checkpoint(cfg.resolve_path(cfg.train_config.save_path))
    return latest is not None and latest.name > resumed.name
