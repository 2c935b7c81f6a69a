"""Env <-> agent action conversions against OpenAI's recorded cases and full tables."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from mineonline_vpt import actions as A

FIXTURES = (
    Path(
        os.environ.get("MINEONLINE_VPT_FIXTURES") or Path(__file__).resolve().parents[3].parent / "shared" / "fixtures"
    )
    / "vpt_public"
)
pytestmark = pytest.mark.skipif(not (FIXTURES / "action_cases.json").exists(), reason="VPT public fixture not present")


@pytest.fixture(scope="module")
def cases() -> dict:
    return json.loads((FIXTURES / "action_cases.json").read_text())


@pytest.fixture(scope="module")
def tables() -> dict:
    return torch.load(FIXTURES / "action_tables.pt", weights_only=True)


def test_constants_and_tables_match(cases, tables) -> None:
    assert (A.N_BUTTONS, A.N_CAMERA) == (cases["n_button_combinations"], cases["n_camera_combinations"])
    assert (A.CAMERA_NULL_BIN, A.CAMERA_NULL_IDX) == (cases["camera_null_bin"], cases["camera_null_idx"])
    assert (A.NULL_BUTTONS_IDX, A.INVENTORY_IDX) == (cases["null_buttons_idx"], cases["inventory_buttons_idx"])
    assert list(A.BUTTONS_ALL) == tables["buttons_all"] == cases["Buttons_ALL_factored_order"]
    assert {k: list(v) for k, v in A.BUTTON_GROUPS.items()} == cases["BUTTONS_GROUPS"]
    assert np.array_equal(A.BUTTON_TABLE, tables["button_idx_to_factored"].numpy())
    assert np.array_equal(A.BUTTON_CAMERA_OFF, tables["button_idx_camera_meta_off"].numpy())
    assert np.array_equal(A.CAMERA_TABLE, tables["camera_idx_to_factored"].numpy())
    assert np.allclose(A.undiscretize_camera(np.arange(11)), tables["camera_bin_degrees"].numpy(), rtol=0, atol=1e-12)


def test_camera_quantization(cases) -> None:
    q = cases["camera_quantization"]
    degrees = [c["degrees"] for c in q["discretize"]]
    assert A.discretize_camera(degrees).tolist() == [c["bin"] for c in q["discretize"]]
    bins = [c["bin"] for c in q["undiscretize_bins"]]
    assert np.allclose(A.undiscretize_camera(bins), [c["degrees"] for c in q["undiscretize_bins"]], atol=1e-12)


def test_env_to_agent_unbatched(cases) -> None:
    for case in cases["env_to_agent"]:
        agent = A.env_to_agent(case["env_action"])
        want = case["agent_action"]
        assert agent["buttons"].shape == (1,) and agent["camera"].shape == (1,)
        assert (int(agent["buttons"][0]), int(agent["camera"][0])) == (want["buttons"], want["camera"]), case["name"]
        back = A.agent_to_env(agent)
        rt = case["roundtrip_env_action"]
        assert set(back) == set(rt), case["name"]
        assert all(back[k] == rt[k] for k in rt if k != "camera"), case["name"]
        assert np.allclose(back["camera"], rt["camera"], atol=1e-9), case["name"]


def test_env_to_agent_batched_equals_unbatched(cases) -> None:
    envs = [c["env_action"] for c in cases["env_to_agent"]]
    batched = {k: np.array([e[k] for e in envs]) for k in envs[0]}
    agent = A.env_to_agent(batched)
    assert agent["buttons"].shape == (12, 1) and agent["buttons"].dtype == np.int64
    assert agent["buttons"][:, 0].tolist() == [c["agent_action"]["buttons"] for c in cases["env_to_agent"]]
    assert agent["camera"][:, 0].tolist() == [c["agent_action"]["camera"] for c in cases["env_to_agent"]]
    # torch tensors and (B, T, 1) layouts work too, as the rollout passes them.
    back = A.agent_to_env({k: torch.as_tensor(v).reshape(3, 4, 1) for k, v in agent.items()})
    assert back["camera"].shape == (3, 4, 2) and back["attack"].shape == (3, 4)
    flat = A.agent_to_env(agent)
    for i, case in enumerate(cases["env_to_agent"]):
        rt = case["roundtrip_env_action"]
        assert all(int(flat[k][i]) == rt[k] for k in rt if k != "camera")
        assert np.allclose(flat["camera"][i], rt["camera"], atol=1e-9)


def test_agent_to_env(cases) -> None:
    for case in cases["agent_to_env"]:
        for action in (case["agent_action"], {k: np.array([v]) for k, v in case["agent_action"].items()}):
            env = A.agent_to_env(action)
            want = case["env_action"]
            assert set(env) == set(want)
            assert all(env[k] == want[k] for k in want if k != "camera"), case
            assert np.allclose(env["camera"], want["camera"], atol=1e-9), case
    with pytest.raises(ValueError, match="out of range"):
        A.agent_to_env({"buttons": 8641, "camera": 0})
