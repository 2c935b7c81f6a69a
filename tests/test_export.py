"""``mineonline export``: the exported file, run where mineonline cannot be imported, acts as
``load_policy(RUN).predict(obs, deterministic=True)`` does, for a batch size it was not traced at, and
carries a recurrent policy's state (reset where an episode starts) as ``predict`` does.

The checkpoints are written by the real trainer without Ray (``tests/test_evaluate.write_checkpoint``:
a run directory with run.json, its resolved config and weights unlike a fresh policy's).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from mineonline_core.driver.evaluate import load_policy
from mineonline_core.driver.export import DeterministicPolicy, export_policy
from mineonline_core.errors import ConfigError
from tests.test_evaluate import ROOT, write_checkpoint

# A fresh interpreter in which any import of mineonline fails: the exported file must need torch or
# onnxruntime alone. It reads inputs.npz (one array per input name, or per step for a recurrent policy),
# runs FILE and prints the outputs as JSON.
RUNNER = r"""
import importlib.abc, json, sys
import numpy as np

class NoMineonline(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0].startswith("mineonline"):
            raise ImportError(f"{name} imported by the exported file")
        return None

sys.meta_path.insert(0, NoMineonline())
fmt, path, inputs = sys.argv[1], sys.argv[2], sys.argv[3]
signature = json.load(open(path + ".json"))
names = [io["name"] for io in signature["inputs"]]
steps = np.load(inputs)
if fmt == "torchscript":
    import torch
    module = torch.jit.load(path)
    def run(feeds):
        return [o.numpy() for o in module(*(torch.from_numpy(feeds[n]) for n in names))]
else:
    import onnxruntime
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    def run(feeds):
        return session.run(None, {n: feeds[n] for n in names})
outputs, state = [], None
for t in range(int(steps["steps"])):
    feeds = {n: steps[f"{n}@{t}"] for n in names if f"{n}@{t}" in steps.files}
    if signature["recurrent"]:
        states = [n for n in names if n.startswith("state_in.")]
        feeds.update(zip(states, state if state is not None else [steps[f"{n}@init"] for n in states]))
    result = run(feeds)
    state = result[1:]
    outputs.append(result[0].tolist())
assert not [m for m in sys.modules if m.startswith("mineonline")]
print(json.dumps(outputs))
"""


def run_exported(fmt: str, path: Path, steps: dict[str, np.ndarray], tmp_path: Path) -> list:
    np.savez(tmp_path / "inputs.npz", **steps)
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, fmt, str(path), str(tmp_path / "inputs.npz")],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # not the checkout: nothing of mineonline on sys.path by the working directory
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def cartpole_observations(n: int) -> np.ndarray:
    """Observations CartPole visits under random play, from several episodes."""
    env, rng, rows = gym.make("CartPole-v1"), np.random.default_rng(0), []
    obs, _ = env.reset(seed=0)
    while len(rows) < n:
        rows.append(obs)
        obs, _, terminated, truncated, _ = env.step(int(rng.integers(2)))
        if terminated or truncated:
            obs, _ = env.reset(seed=len(rows))
    return np.stack(rows)


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
def test_exported_cartpole_policy_acts_as_predict_without_mineonline(tmp_path: Path, fmt: str) -> None:
    write_checkpoint(ROOT / "examples" / "cartpole.yaml", ["run_name=cp"], tmp_path)
    run = tmp_path / "cp"
    target = tmp_path / f"policy.{fmt}"
    done = subprocess.run(
        [sys.executable, "-m", "mineonline_core.cli", "export", str(run), "--format", fmt, "--output", str(target)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"to {target}: inputs obs float32 ('N', 4); outputs action int64 ('N',)" in done.stdout
    observations = cartpole_observations(50)
    expected, _ = load_policy(run).predict(observations, deterministic=True)
    assert len(set(expected.tolist())) == 2  # both actions occur: a constant policy would prove nothing
    got = run_exported(fmt, target, {"steps": np.array(1), "obs@0": observations}, tmp_path)
    assert got[0] == expected.tolist()


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
def test_exported_recurrent_policy_carries_and_resets_state_as_predict(tmp_path: Path, fmt: str) -> None:
    config = {
        "env_config": {"name": "crafter", "length": 20},
        "policy_config": {"name": "cnn_gru", "hidden_size": 16, "channels": [4, 8, 8]},
        "logger_config": {"loggers": []},
        "run_name": "rec",
        "rollout_config": {"replay_buffer_config": {"database_config": {"backend": "memory"}}},
    }
    write_checkpoint(config, [], tmp_path)
    result = export_policy(tmp_path / "rec", fmt=fmt)
    target = Path(result["file"])
    assert target == tmp_path / "rec" / "export" / f"checkpoint_000003{'.pt' if fmt == 'torchscript' else '.onnx'}"
    assert [io["name"] for io in result["inputs"]] == ["image", "state_in.0", "episode_start"]
    assert [io["name"] for io in result["outputs"]] == ["action", "state_out.0"]
    frames = np.random.default_rng(0).integers(0, 256, (6, 3, 64, 64, 3), dtype=np.uint8)  # (T, N, H, W, C)
    starts = np.zeros((6, 3), dtype=bool)
    starts[0] = True
    starts[3, 1] = starts[4, 2] = True  # envs 1 and 2 start new episodes part-way
    policy, state, expected = load_policy(tmp_path / "rec"), None, []
    for t in range(6):
        actions, state = policy.predict(frames[t], state, episode_start=starts[t], deterministic=True)
        expected.append(actions.tolist())
    steps = {"steps": np.array(6), "state_in.0@init": np.full((3, 16), 7.0, np.float32)}  # garbage: reset at t=0
    for t in range(6):
        steps[f"image@{t}"], steps[f"episode_start@{t}"] = frames[t], starts[t]
    got = run_exported(fmt, target, steps, tmp_path)
    assert got == expected


def test_export_refuses_an_unknown_format(tmp_path: Path) -> None:
    write_checkpoint(ROOT / "examples" / "cartpole.yaml", ["run_name=cp"], tmp_path)
    with pytest.raises(ConfigError, match="--format 'tflite' is not one of"):
        export_policy(tmp_path / "cp", fmt="tflite")


def test_exported_box_actions_are_clipped_to_the_bounds_as_predict(tmp_path: Path) -> None:
    """A Gaussian head's mean can leave the Box; predict clips it to the bounds, so the exported file must."""
    write_checkpoint(ROOT / "examples" / "pendulum.yaml", ["run_name=pd"], tmp_path)
    loaded = load_policy(tmp_path / "pd")
    with torch.no_grad():
        loaded.policy.pi_head.linear.weight.mul_(300.0)  # means far past the torque bounds of +-2
    env, rng, rows = gym.make("Pendulum-v1"), np.random.default_rng(0), []
    obs, _ = env.reset(seed=0)
    for _ in range(50):
        rows.append(obs)
        obs, *_ = env.step(rng.uniform(-2, 2, (1,)).astype(np.float32))
    observations = np.stack(rows)
    expected, _ = loaded.predict(observations, deterministic=True)
    assert (np.abs(expected) == 2.0).any() and (np.abs(expected) < 2.0).any()  # both clipped and free actions
    module = DeterministicPolicy(loaded).eval()
    traced = torch.jit.trace(module, (torch.from_numpy(observations),), check_trace=False)
    got = traced(torch.from_numpy(observations))[0].numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
