"""Checkpoints: atomic, self-verifying, loadable with ``torch.load(weights_only=True)``.

Layout of ``<save_path>/checkpoint_{iteration:06d}/``::

    model.pt          the policy's state dict (value-normaliser statistics included)
    optimizer.pt      the optimiser's state dict
    scaler.pt         the AMP grad scaler's state dict (empty when AMP is off)
    trainer.pt        iteration, model version, learning rate, env-step count, best return (keep_best),
                      RNG states, the trainer's own ``trainer_state()`` (extra); no KL weight: a
                      trainer derives it from the iteration and its options (PPO's rho_at)
    config.yaml       the resolved run config: overrides applied, every default, generators by import
                      path, secrets redacted, ``${oc.env:...}`` kept as written; with the installed
                      plugins it rebuilds the env and the policy
    source_config.txt the config file as written, secrets redacted (when there was one); a Python
                      config module's generators are imported from it when the original file is gone
    manifest.json     sha256 and size of every file above

A checkpoint is written into a temporary sibling directory, every file fsynced, then renamed into
place, so a crash leaves either the whole checkpoint or none. Nothing is pickled: RNG states are
tensors and lists, so loading never executes code from the file.

The temporary directory is named ``.checkpoint_N.tmp-PID@HOST`` after the process writing it (an
``.old-PID@HOST`` one holds a checkpoint being replaced). A writer killed mid-write leaves it behind
(1-3 GB at VPT size); ``remove_stale_temporaries`` deletes those whose writer is dead at the next
start. A writer on another host, or one still alive (a killed driver's Ray Train rank lingers for
seconds), is never touched: the directory may still be in use.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mineonline_core.errors import CheckpointError, ConfigError
from mineonline_core.contracts.policy import state_dict_mismatch

_NAME = re.compile(r"^checkpoint_(\d{6,})$")
# A writer's temporary (or replaced) directory; names without the host are those of older versions.
_TEMPORARY = re.compile(r"^\.checkpoint_\d{6,}\.(?:tmp|old)-(\d+)(?:@(.+))?$")
_FILES = ("model.pt", "optimizer.pt", "scaler.pt", "trainer.pt")
MANIFEST = "manifest.json"
SOURCE = "source_config.txt"


def checkpoint_dir(save_dir: str | Path, iteration: int) -> Path:
    return Path(save_dir) / f"checkpoint_{iteration:06d}"


def list_checkpoints(save_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (those with a manifest) under ``save_dir``, oldest first."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _NAME.match(child.name)
        if match and (child / MANIFEST).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``save_dir``, or None."""
    found = list_checkpoints(save_dir)
    return found[-1][1] if found else None


def resolve_save_path(save_path: str, run_dir: str | Path) -> Path:
    path = Path(save_path).expanduser()
    return path if path.is_absolute() else Path(run_dir) / path


def check_writable(save_dir: Path) -> None:
    """Raise ``ConfigError`` now, before training, if checkpoints could not be written there."""
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
        probe = save_dir / f".write_probe_{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"train_config.save_path: cannot write checkpoints to {str(save_dir)!r} ({exc.strerror or exc}). "
            "Set train_config.save_path to a writable directory (relative paths are under the run directory)."
        ) from exc


# ---------------------------------------------------------------------------------------------
# RNG states as plain tensors and lists
# ---------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss"]))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    save_dir: str | Path,
    *,
    iteration: int,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    scaler_state: dict[str, Any] | None,
    trainer_state: dict[str, Any],
    config_yaml: str,
    source_text: str | None = None,
    keep_interval: int | None = None,
) -> Path:
    """Write ``checkpoint_{iteration:06d}`` atomically, then apply the retention rule.

    ``config_yaml`` is the resolved run config; ``source_text`` the config file as written
    (MineStudio's ``whole_config``), kept as ``source_config.txt`` when given. A write that fails
    (disk full, read-only, quota) raises ``CheckpointError`` naming the directory and its free space,
    and leaves no temporary directory and every earlier checkpoint as it was.
    """
    root = Path(save_dir)
    final = checkpoint_dir(root, iteration)
    tmp = root / f".{final.name}.tmp-{_writer()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        _write_files(
            tmp, iteration, model_state, optimizer_state, scaler_state, trainer_state, config_yaml, source_text
        )
    except (OSError, RuntimeError) as exc:  # torch.save reports a failed write as a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(_write_failure(root, final.name, exc)) from exc
    if final.exists():  # re-saving an iteration (a resumed run): move the old one out of the way first
        stale = root / f".{final.name}.old-{_writer()}"
        os.replace(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.replace(tmp, final)
    _fsync(root)
    if keep_interval:
        apply_retention(root, keep_interval)
    return final


def _write_files(
    tmp: Path,
    iteration: int,
    model_state: dict,
    optimizer_state: dict,
    scaler_state: dict | None,
    trainer_state: dict,
    config_yaml: str,
    source_text: str | None,
) -> None:
    contents = {
        "model.pt": model_state,
        "optimizer.pt": optimizer_state,
        "scaler.pt": scaler_state or {},
        "trainer.pt": {**trainer_state, "iteration": iteration, "rng": rng_state()},
    }
    # format 2: config.yaml is the resolved config (format 1 held the config file as written).
    manifest: dict[str, Any] = {"format": 2, "iteration": iteration, "files": {}}
    for name, obj in contents.items():
        with open(tmp / name, "wb") as handle:  # through a Python file, so a failed write keeps its OSError
            torch.save(obj, handle)
    (tmp / "config.yaml").write_text(config_yaml)
    texts = ["config.yaml"]
    if source_text is not None:
        (tmp / SOURCE).write_text(source_text)
        texts.append(SOURCE)
    for name in (*_FILES, *texts):
        _fsync(tmp / name)
        manifest["files"][name] = {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync(tmp / MANIFEST)
    _fsync(tmp)


def _write_failure(root: Path, name: str, exc: BaseException | None) -> str:
    probe = root if root.exists() else next((p for p in root.parents if p.exists()), root)
    try:
        usage = shutil.disk_usage(probe)
        space = f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.0f} MiB on that disk"
    except OSError:
        space = "free space unknown"
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    # torch.save reports the file's OSError (ENOSPC, EROFS, ...) as its context under an opaque RuntimeError
    root_cause = next((e for e in chain if isinstance(e, OSError)), chain[0])
    cause = f"{type(root_cause).__name__}: {root_cause}".strip()
    return (
        f"train_config.save_path: writing {name} under {str(root)!r} failed ({cause}; {space}). The earlier "
        "checkpoints there are intact and the partial one was removed. Fix: free space on that disk, or set "
        "train_config.save_path to a writable directory on a larger disk, then resume."
    )


def _writer() -> str:
    return f"{os.getpid()}@{socket.gethostname()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_stale_temporaries(save_dir: str | Path) -> list[Path]:
    """Delete the temporary directories under ``save_dir`` whose writer, a process on this host, is
    dead (a write interrupted by a crash or SIGKILL); return those deleted. A live writer's, or one
    written on another host, is left alone."""
    root, removed, host = Path(save_dir), [], socket.gethostname()
    if not root.is_dir():
        return removed
    for child in sorted(root.iterdir()):
        match = _TEMPORARY.match(child.name)
        if match is None or not child.is_dir() or match.group(2) not in (None, host):
            continue
        if not _alive(int(match.group(1))):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def apply_retention(save_dir: str | Path, keep_interval: int) -> list[int]:
    """Delete checkpoints that are neither a multiple of ``keep_interval`` nor the latest; return kept."""
    found = list_checkpoints(save_dir)
    kept = []
    for position, (iteration, path) in enumerate(found):
        if iteration % keep_interval == 0 or position == len(found) - 1:
            kept.append(iteration)
        else:
            shutil.rmtree(path, ignore_errors=True)
    return kept


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------


def resolve_resume(path: str | Path) -> Path:
    """A checkpoint directory, or the newest checkpoint under a save directory or run directory."""
    path = Path(path).expanduser()
    if (path / MANIFEST).is_file():
        return path
    for candidate in (path, path / "checkpoints"):
        latest = latest_checkpoint(candidate)
        if latest is not None:
            return latest
    if not path.exists():
        raise CheckpointError(
            f"train_config.resume: checkpoint {str(path)!r} does not exist. Point it at a "
            "checkpoint_NNNNNN directory (or a run directory holding checkpoints), or set it to null to start fresh."
        )
    raise CheckpointError(
        f"train_config.resume: {str(path)!r} holds no complete checkpoint (no {MANIFEST}; the write may "
        "have been interrupted). Point it at an earlier checkpoint_NNNNNN directory, or set it to null."
    )


def verify_checkpoint(path: str | Path) -> Path:
    """Check every file of a checkpoint against its manifest (sizes and sha256); return its directory.

    Reads the files but unpickles nothing, so the driver can vet a checkpoint in seconds before Ray starts.
    """
    path = resolve_resume(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"train_config.resume: the manifest of {str(path)!r} is unreadable ({exc}); the checkpoint is corrupted."
        ) from exc
    for name in (*_FILES, "config.yaml", *([SOURCE] if SOURCE in files else [])):
        file = path / name
        if name not in files or not file.is_file():
            raise CheckpointError(
                f"train_config.resume: {str(path)!r} is truncated: {name} is missing. Use an earlier checkpoint."
            )
        if file.stat().st_size != files[name]["bytes"] or _sha256(file) != files[name]["sha256"]:
            raise CheckpointError(
                f"train_config.resume: {str(file)!r} does not match its sha256 in {MANIFEST} (truncated or "
                "corrupted on disk). Use an earlier checkpoint."
            )
    return path


def saved_config(path: str | Path) -> str | None:
    """The resolved run config a verified checkpoint was trained with; None for checkpoints of format 1,
    whose ``config.yaml`` holds the config file as written rather than the resolved config."""
    path = Path(path)
    manifest = json.loads((path / MANIFEST).read_text())
    return (path / "config.yaml").read_text() if manifest.get("format", 1) >= 2 else None


def _unsafe(file: Path, exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    # torch's refusal wraps advice around the line that names what the file asked to run: keep that line
    advice = ("Weights only load failed", "Check the documentation", "Please file an issue")
    cause = next((line for line in lines if not line.startswith(advice)), lines[0] if lines else "")
    return (
        f"train_config.resume: {str(file)!r} is refused: it holds more than tensors and plain data, so loading it "
        f"could run code ({type(exc).__name__}: {cause}). It was not loaded. Restore the file, or use an earlier "
        "checkpoint."
    )


def _load(file: Path, *, mmap: bool = False) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a file we must not trust
        raise CheckpointError(_unsafe(file, exc)) from None


def check_loads_safely(path: str | Path) -> None:
    """Unpickle every tensor file of a checkpoint as ``load_checkpoint`` will (``weights_only=True``),
    memory-mapped, so the tensors' bytes are not read: a file that asks to run code (a manifest fixed
    up to match it passes ``verify_checkpoint``) is refused on the driver in seconds, before Ray."""
    for name in _FILES:
        _load(Path(path) / name, mmap=True)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Verify every file against the manifest and load it with ``weights_only=True``."""
    path = verify_checkpoint(path)
    out: dict[str, Any] = {"path": path, "config_yaml": (path / "config.yaml").read_text()}
    for name in _FILES:
        out[name[:-3]] = _load(path / name)
    return out


def check_compatible(model: nn.Module, state: dict[str, torch.Tensor], *, source: str) -> None:
    """Raise ``CheckpointError`` naming missing, unexpected and mis-shaped keys."""
    mismatch = state_dict_mismatch(model, state)
    if mismatch:
        raise CheckpointError(
            f"train_config.resume: {source} was saved from a different model than policy_generator() builds: "
            f"{mismatch}. Resume with the policy config the checkpoint was trained with, or start fresh."
        )
