"""Bad checkpoints, paths and full disks get ONE clear ``MineOnlineError``, and what was written before stays intact.

Each case asserts the message names the key (or file) and the offending value, so a user can fix
it from the message alone. Nothing here starts Ray.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mineonline_core.config import load_config
from mineonline_core.driver.resolve import resolve
from mineonline_core.errors import CheckpointError, ConfigError
from mineonline_core.registry import get_plugin_manager
from tests.test_bad_input_config import BASE, ROOT


@pytest.fixture(autouse=True)
def _no_ray_started():
    yield
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), "a bad-input path started Ray"


# -- checkpoints ----------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    from mineonline_core.trainer.checkpoint import save_checkpoint

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    return save_checkpoint(
        tmp_path / "checkpoints",
        iteration=3,
        model_state=model.state_dict(),
        optimizer_state=opt.state_dict(),
        scaler_state=None,
        trainer_state={"version": 3},
        config_yaml="run_name: x\n",
    )


def test_missing_checkpoint(tmp_path: Path) -> None:
    from mineonline_core.trainer.checkpoint import load_checkpoint

    with pytest.raises(CheckpointError, match=r"train_config.resume: checkpoint .*nowhere.* does not exist"):
        load_checkpoint(tmp_path / "nowhere")


def test_corrupted_checkpoint(checkpoint: Path) -> None:
    from mineonline_core.trainer.checkpoint import load_checkpoint

    data = bytearray((checkpoint / "model.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    (checkpoint / "model.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.pt.*does not match its sha256"):
        load_checkpoint(checkpoint)


def test_truncated_checkpoint(checkpoint: Path) -> None:
    from mineonline_core.trainer.checkpoint import load_checkpoint

    size = (checkpoint / "optimizer.pt").stat().st_size
    os.truncate(checkpoint / "optimizer.pt", size // 2)
    with pytest.raises(CheckpointError, match=r"optimizer\.pt.*truncated or corrupted"):
        load_checkpoint(checkpoint)
    (checkpoint / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match=r"truncated: optimizer\.pt is missing"):
        load_checkpoint(checkpoint)


def test_half_written_checkpoint_directory(tmp_path: Path) -> None:
    from mineonline_core.trainer.checkpoint import load_checkpoint

    (tmp_path / "checkpoint_000004").mkdir()  # a crash before the manifest: no complete checkpoint
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        load_checkpoint(tmp_path)


def test_checkpoint_from_an_incompatible_model(checkpoint: Path) -> None:
    from mineonline_core.trainer.checkpoint import check_compatible, load_checkpoint

    state = load_checkpoint(checkpoint)["model"]
    other = torch.nn.Sequential(torch.nn.Linear(4, 3))
    with pytest.raises(CheckpointError) as info:
        check_compatible(other, state, source=str(checkpoint))
    message = str(info.value)
    assert "different model" in message and "missing keys: 0.weight, 0.bias" in message
    assert "unexpected keys: weight, bias" in message
    with pytest.raises(CheckpointError, match=r"mis-shaped keys: weight \(file \(2, 4\), model \(3, 4\)\)"):
        check_compatible(torch.nn.Linear(4, 3), state, source=str(checkpoint))


# -- paths and disks ------------------------------------------------------------------------------


def test_unwritable_save_path(tmp_path: Path) -> None:
    from mineonline_core.driver.api import _prepare_run_dir

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")  # works as root too, unlike chmod
    loaded = load_config(BASE, [f"output_dir={tmp_path}", f"train_config.save_path={blocker}/checkpoints"])
    resolved = resolve(loaded, get_plugin_manager())
    with pytest.raises(ConfigError) as info:
        _prepare_run_dir(resolved)
    assert "train_config.save_path" in str(info.value) and str(blocker) in str(info.value)


FILL_DISK = """
import resource, signal, sys
import numpy as np
from mineonline_core.errors import MineOnlineError
from mineonline_lmdb.store import LMDBStore

store = LMDBStore(path=sys.argv[1], num_shards=1)
store.put("before", {"x": np.arange(3)})
# A file-size limit makes the store's files unable to grow, exactly as a full disk does (EFBIG
# instead of ENOSPC); SIGXFSZ would kill the process instead of failing the write.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, hard))  # the soft limit only: it can be lifted again
written = 0
try:
    for i in range(1000):
        store.put(f"k{i:04d}", {"x": np.random.default_rng(i).random(1 << 17)})  # 1 MiB each
        written += 1
    print("NO ERROR")
except MineOnlineError as exc:
    print("ERROR", type(exc).__name__, written, exc)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
print("BEFORE", store.get("before")["x"].tolist())
"""


def test_full_disk_on_the_lmdb_store(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", FILL_DISK, path], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    error = next(line for line in result.stdout.splitlines() if line.startswith(("ERROR", "NO ERROR")))
    assert error.startswith("ERROR StoreFullError"), result.stdout
    written = int(error.split()[2])
    assert 1 <= written <= 8  # it failed when the 8 MiB were used up, not before, not never
    assert f"database_config.path={path!r}" in error and "disk is full" in error
    assert "Traceback" not in result.stdout + result.stderr
    assert "BEFORE [0, 1, 2]" in result.stdout  # what was written before is intact


FULL_CHECKPOINT_DISK = """
import os, resource, signal, sys
import torch
from mineonline_core.errors import CheckpointError
from mineonline_core.trainer.checkpoint import list_checkpoints, save_checkpoint, verify_checkpoint

root = sys.argv[1]
def save(iteration, numel):
    model = {"w": torch.ones(numel)}
    return save_checkpoint(root, iteration=iteration, model_state=model, optimizer_state={}, scaler_state=None,
                           trainer_state={"version": iteration}, config_yaml="run_name: x\\n")
save(1, 16)
# A file-size limit makes writes fail exactly as a full disk does (EFBIG instead of ENOSPC).
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
try:
    save(2, 1 << 20)  # 4 MiB of weights
    print("NO ERROR")
except CheckpointError as exc:
    print("ERROR", exc)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
print("LEFT", sorted(os.listdir(root)))
print("VERIFIED", [verify_checkpoint(p).name for _, p in list_checkpoints(root)])
"""


def test_a_full_disk_while_checkpointing(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", FULL_CHECKPOINT_DISK, str(root)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    error = next(line for line in result.stdout.splitlines() if line.startswith(("ERROR", "NO ERROR")))
    assert error.startswith("ERROR train_config.save_path: writing checkpoint_000002 under " + repr(str(root))), error
    assert "File too large" in error and "MiB free of" in error and "Fix:" in error
    assert "LEFT ['checkpoint_000001']" in result.stdout  # no temporary directory left behind
    assert "VERIFIED ['checkpoint_000001']" in result.stdout  # the earlier checkpoint is intact


def test_a_checkpoint_directory_that_cannot_be_created(tmp_path: Path) -> None:
    from mineonline_core.trainer.checkpoint import save_checkpoint

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")  # works as root too, unlike chmod
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(
            blocker / "checkpoints",
            iteration=1,
            model_state={},
            optimizer_state={},
            scaler_state=None,
            trainer_state={},
            config_yaml="",
        )
    assert str(blocker / "checkpoints") in str(info.value) and "free of" in str(info.value)
