"""Randomly initialised 1x/2x/3x (and fixture) models have exactly the released state-dict layout."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from mineonline_vpt import VPTPolicy

MANIFEST = (
    Path(
        os.environ.get("MINEONLINE_VPT_FIXTURES") or Path(__file__).resolve().parents[3].parent / "shared" / "fixtures"
    )
    / "vpt_manifest.json"
)
pytestmark = pytest.mark.skipif(not MANIFEST.exists(), reason="VPT manifest not present")
MODELS = ["foundation-model-1x", "foundation-model-2x", "foundation-model-3x", "public_fixture"]


@pytest.mark.parametrize("model", MODELS)
def test_meta_instantiation_matches_manifest_key_for_key(model: str) -> None:
    entry = json.loads(MANIFEST.read_text())["models"][model]
    with torch.device("meta"):  # no memory: the 3x model has 532M elements
        policy = VPTPolicy.from_vpt_kwargs(
            entry["policy_kwargs"], temperature=float(entry["pi_head_opts"]["temperature"])
        )
    state = policy.state_dict()
    assert [(k, list(v.shape)) for k, v in state.items()] == [(e["key"], e["shape"]) for e in entry["state_dict"]]
    assert len(state) == entry["n_state_dict_entries"]
    assert sum(v.numel() for v in state.values()) == entry["total_state_dict_elements"]
    assert all(v.dtype == torch.float32 for v in state.values())
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    assert trainable == entry["requires_grad_parameter_elements"]
    assert policy.net.maxlen == entry["maxlen"]
    assert policy.pi_head.temperature == float(entry["pi_head_opts"]["temperature"])


@pytest.mark.parametrize("model", MODELS[:3])
def test_builtin_foundation_kwargs_equal_manifest(model: str) -> None:
    from mineonline_vpt.configs import FOUNDATION_KWARGS, FOUNDATION_TEMPERATURE

    entry = json.loads(MANIFEST.read_text())["models"][model]
    assert FOUNDATION_KWARGS[model] == entry["policy_kwargs"]
    assert FOUNDATION_TEMPERATURE == entry["pi_head_opts"]["temperature"]
