"""Safe resume on a real run: the same run name twice, ``--resume`` after config edits, a damaged newest
checkpoint, and a resume from a chosen checkpoint.

One real run (CartPole, 2 iterations, a checkpoint each) is shared by the module. Every refusal must
come before Ray starts (how long it took is printed, not asserted) and leave ``run.json``, ``config.yaml``
and ``metrics.jsonl`` exactly as they were.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from mineonline_core.driver.api import run
from mineonline_core.errors import CheckpointError, ConfigError
from mineonline_core.driver.progress import format_value
from mineonline_core.driver.continuity import resume_point
from mineonline_core.trainer import checkpoint as ckpt
from tests.conftest import small_cartpole_run

CONFIG = small_cartpole_run(
    run_name="safe",
    seed=0,
    policy_config={"hidden_sizes": [32, 32]},
    train_config={"num_iterations": 2, "save_interval": 1, "keep_interval": 1},
)
KEPT = ("run.json", "config.yaml", "metrics.jsonl")


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _iterations(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [int(r["trainer/iteration"]) for r in map(json.loads, lines) if "trainer/iteration" in r]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    result = run({**CONFIG, "output_dir": str(root)}, progress=False)
    assert result["status"] == "completed", result
    assert not _ray_running()
    return root / "safe"


@pytest.fixture
def run_dir(finished_run: Path, tmp_path: Path) -> Path:
    """A private copy of the finished run, so that a test that damages it leaves the others alone."""
    copy = tmp_path / "runs" / "safe"
    shutil.copytree(finished_run, copy)
    return copy


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {name: (run_dir / name).read_bytes() for name in KEPT}


def test_the_same_run_name_twice_is_refused_with_the_way_out(run_dir: Path) -> None:
    before = _snapshot(run_dir)
    with pytest.raises(ConfigError) as info:
        run({**CONFIG, "output_dir": str(run_dir.parent)}, progress=False)
    message = str(info.value)
    assert "run_name='safe'" in message and "already holds a run" in message
    assert f"--resume {run_dir}" in message and "run_name=..." in message
    assert _snapshot(run_dir) == before and not _ray_running()
    assert _iterations(run_dir) == [1, 2]  # never 1,2,1,2


def test_resume_refuses_continuity_breaking_edits_listing_each(run_dir: Path) -> None:
    before = _snapshot(run_dir)
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        run(
            None,
            ["policy_config.hidden_sizes=[64]", "rollout_config.fragment_length=16", "train_config.learning_rate=1e-3"],
            resume=str(run_dir),
            progress=False,
        )
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert "policy_config.hidden_sizes: [32, 32] in checkpoint_000002, [64] now" in message
    assert "rollout_config.fragment_length: 32 in checkpoint_000002, 16 now" in message
    assert "learning_rate" not in message  # a hyperparameter change does not break continuity
    assert "--force" in message
    assert _snapshot(run_dir) == before and not _ray_running()
    print(f"FIGURE continuity refusal in {elapsed:.1f}s")


def test_an_edited_config_file_is_caught_too(run_dir: Path, tmp_path: Path) -> None:
    """``--resume`` re-reads the run's config file: an edit there is a change like an override."""
    import yaml

    source = tmp_path / "edited.yaml"
    source.write_text(yaml.safe_dump({**CONFIG, "env_config": {"name": "gymnasium", "id": "Acrobot-v1"}}))
    record = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**record, "source_path": str(source)}))
    with pytest.raises(ConfigError, match=r"env_config\.id: 'CartPole-v1' in checkpoint_000002, 'Acrobot-v1' now"):
        run(None, [], resume=str(run_dir), progress=False)


def test_a_damaged_newest_checkpoint_is_reported_before_ray_with_the_previous_one(run_dir: Path) -> None:
    model = run_dir / "checkpoints" / "checkpoint_000002" / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    before = _snapshot(run_dir)
    started = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        run(None, [], resume=str(run_dir), progress=False)
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert "checkpoint_000002 is damaged" in message and "does not match its sha256" in message
    assert f"--resume {run_dir / 'checkpoints' / 'checkpoint_000001'}" in message
    assert _snapshot(run_dir) == before and not _ray_running()
    print(f"FIGURE damaged checkpoint reported in {elapsed:.1f}s, before Ray")


def test_a_forced_change_of_the_network_still_fails_before_ray(run_dir: Path) -> None:
    with pytest.raises(CheckpointError, match=r"mis-shaped keys: actor\.0\.weight \(file \(32, 4\), model \(64, 4\)\)"):
        run(None, ["policy_config.hidden_sizes=[64, 32]"], resume=str(run_dir), force=True, progress=False)
    assert not _ray_running()


def test_resume_from_a_chosen_checkpoint_with_force(run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    chosen = run_dir / "checkpoints" / "checkpoint_000001"
    before = (run_dir / "metrics.jsonl").read_text().splitlines()
    result = run(
        None,
        ["train_config.num_iterations=3", "rollout_config.fragment_length=16"],
        resume=str(chosen),
        force=True,
        progress=False,
    )
    assert result["status"] == "completed" and result["iteration"] == 3
    out = capsys.readouterr().out
    assert "resume: rollout_config.fragment_length: 32 -> 16  (breaks continuity; --force)" in out
    assert "resume: train_config.num_iterations: 2 -> 3" in out
    # Continued after checkpoint 1, not after the latest; iteration 2's first record was dropped with
    # everything logged after the chosen checkpoint, so the curve reads as one.
    assert _iterations(run_dir) == [1, 2, 3]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["overrides"] == ["train_config.num_iterations=3", "rollout_config.fragment_length=16"]
    saved = ckpt.saved_config(ckpt.checkpoint_dir(run_dir / "checkpoints", 3))
    assert "fragment_length: 16" in saved
    _assert_one_env_step_count(run_dir, result, out, continued_from=resume_point(chosen).env_steps, before=before)


def _assert_one_env_step_count(
    run_dir: Path, result: dict, out: str, *, continued_from: int, before: list[str]
) -> None:
    """The env-step count continues from the checkpoint's, and every place shows that one count: the
    summary (summary.json, the returned one, the printed table), the step axis, ``rollout/env_steps``.
    ``before``: the lines of ``metrics.jsonl`` before the resume (it keeps a prefix of them)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    kept = next((i for i, (a, b) in enumerate(zip(before, lines)) if a != b), min(len(before), len(lines)))
    resumed = [json.loads(line) for line in lines[kept:]]
    assert resumed and all(r["step"] >= continued_from for r in resumed), [r["step"] for r in resumed][:5]
    records = [json.loads(line) for line in lines]
    final = max(r["step"] for r in records)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert final > continued_from > 0
    assert summary["env_steps"] == summary["rollout/env_steps"] == final
    assert result["summary"]["env_steps"] == result["summary"]["rollout/env_steps"] == final
    shown = [r for r in records if "rollout/env_steps" in r]
    assert shown and [r["rollout/env_steps"] for r in shown] == [r["step"] for r in shown]
    # The summary table's rows (plain progress lines show the count as it was at their iteration).
    printed = [line for line in out.splitlines() if " env_steps " in line and "│" in line]
    assert printed and all(format_value(float(final)) in line for line in printed), printed


def test_a_failed_attempt_to_continue_leaves_the_run_records_as_they_were(run_dir: Path) -> None:
    """The resume passes every pre-Ray check, writes its records, then fails once Ray is up (the cluster
    has too few CPUs): run.json and config.yaml go back to what they were, so the next --resume does not
    inherit the failed attempt's overrides."""
    before = _snapshot(run_dir)
    with pytest.raises(ConfigError, match="CPUs"):
        run(
            None,
            ["train_config.num_iterations=5", "train_config.num_cpus_per_worker=64"],
            resume=str(run_dir),
            progress=False,
        )
    assert _snapshot(run_dir) == before
    assert json.loads((run_dir / "run.json").read_text())["overrides"] == []
