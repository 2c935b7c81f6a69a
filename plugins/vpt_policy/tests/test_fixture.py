"""The VPT network against OpenAI's outputs in the public fixture (README sections 4-5).

Tolerance: ``allclose(rtol=1e-4, atol=1e-4)`` for floats, exact for masks and argmax actions.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mineonline_vpt import load_vpt_policy

FIXTURES = (
    Path(
        os.environ.get("MINEONLINE_VPT_FIXTURES") or Path(__file__).resolve().parents[3].parent / "shared" / "fixtures"
    )
    / "vpt_public"
)
pytestmark = pytest.mark.skipif(not (FIXTURES / "reference_io.pt").exists(), reason="VPT public fixture not present")

# Sequence 1 resets at step 19, in the middle of chunk 2 (local step 7); OpenAI's chunked forward
# ignores that flag, ours honours it and must then equal the step-by-step run there.
MID_RESET = (1, slice(19, 24))


@pytest.fixture(scope="module")
def ref() -> dict:
    return torch.load(FIXTURES / "reference_io.pt", weights_only=True)


@pytest.fixture(scope="module")
def policy():
    policy = load_vpt_policy(FIXTURES / "public.model", FIXTURES / "public.weights").eval()
    yield policy
    policy.net.honor_all_firsts = True


def close(mine: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert mine.shape == want.shape, f"{what}: shape {tuple(mine.shape)} != {tuple(want.shape)}"
    diff = (mine.double() - want.double()).abs().max().item()
    assert torch.allclose(mine.float(), want.float(), rtol=1e-4, atol=1e-4), f"{what}: max abs diff {diff:.3g}"


def run(policy, ref: dict, t0: int, t1: int, state):
    inter: dict = {}
    with torch.no_grad():
        latents, state_out = policy(
            {"image": ref["inputs"]["img"][:, t0:t1]}, state, {"first": ref["inputs"]["first"][:, t0:t1]}, inter
        )
    return latents, state_out, inter


def outputs(policy, ref: dict, latents: dict, t0: int, t1: int) -> dict:
    """The fixture's per-step quantities computed from our latents."""
    pi, head = latents["pi_logits"], policy.pi_head
    fixed = {k: ref["inputs"]["fixed_action"][k][:, t0:t1] for k in ("buttons", "camera")}
    argmax = head.sample(pi, deterministic=True)
    return {
        "camera": pi["camera"],
        "buttons_subset": pi["buttons"][..., ref["buttons_subset_idx"]],
        "vpred_normalized": latents["vpred"],
        "vpred": policy.value_head.denormalize(latents["vpred"]),
        "fixed_action_logprob": head.logprob(fixed, pi),
        "fixed_per_head": {k: pi[k].gather(-1, fixed[k][..., None]).squeeze(-1).sum(-1) for k in fixed},
        "entropy": head.entropy(pi),
        "entropy_per_head": head.entropy_per_key(pi),
        "max_per_head": {k: pi[k].amax(-1).squeeze(-1) for k in fixed},
        "argmax": argmax,
        "argmax_logprob": head.logprob(argmax, pi),
    }


def check_chunk(policy, ref: dict, name: str, mine: dict, inter: dict, rows=slice(None), cols=slice(None)) -> None:
    want = ref[name]
    close(mine["camera"][rows, cols], want["pi_logits"]["camera"][rows, cols], f"{name} camera log-probs")
    close(mine["buttons_subset"][rows, cols], want["pi_logits"]["buttons_subset"][rows, cols], f"{name} buttons")
    close(mine["vpred_normalized"][rows, cols], want["vpred_normalized"][rows, cols], f"{name} vpred_normalized")
    close(mine["vpred"][rows, cols], want["vpred"][rows, cols], f"{name} vpred")
    close(mine["fixed_action_logprob"][rows, cols], want["fixed_action_logprob"][rows, cols], f"{name} logprob")
    close(mine["entropy"][rows, cols], want["entropy"][rows, cols], f"{name} entropy")
    for k in ("buttons", "camera"):
        close(
            mine["fixed_per_head"][k][rows, cols],
            want["fixed_action_logprob_per_head"][k][rows, cols],
            f"{name} {k} lp",
        )
        close(mine["entropy_per_head"][k][rows, cols], want["entropy_per_head"][k][rows, cols], f"{name} {k} entropy")
        close(mine["max_per_head"][k][rows, cols], want["max_logprob_per_head"][k][rows, cols], f"{name} {k} max")
        assert torch.equal(mine["argmax"][k][rows, cols], want["argmax_action"][k][rows, cols]), f"{name} {k} argmax"
    for key, value in want["intermediates"].items():
        close(inter[key][rows, cols], value[rows, cols], f"{name} {key}")


def check_state(mine, want, what: str, rows=slice(None)) -> None:
    assert len(mine) == len(want) == 3
    for layer, ((m_mask, (m_k, m_v)), (w_mask, (w_k, w_v))) in enumerate(zip(mine, want)):
        assert torch.equal(m_mask[rows], w_mask[rows]), f"{what}: layer {layer} state mask differs"
        close(m_k[rows], w_k[rows], f"{what}: layer {layer} K")
        close(m_v[rows], w_v[rows], f"{what}: layer {layer} V")


def test_chunked_reference_mode_matches_openai_everywhere(policy, ref) -> None:
    """With OpenAI's own convention (first honoured at a call's step 0 only) every figure matches."""
    policy.net.honor_all_firsts = False
    try:
        lat1, state1, inter1 = run(policy, ref, 0, 12, ref["initial_state"])
        check_chunk(policy, ref, "chunk1", outputs(policy, ref, lat1, 0, 12), inter1)
        check_state(state1, ref["chunk1"]["state_out"], "chunk1 state_out")
        lat2, state2, inter2 = run(policy, ref, 12, 24, state1)
        check_chunk(policy, ref, "chunk2", outputs(policy, ref, lat2, 12, 24), inter2)
        check_state(state2, ref["chunk2"]["state_out"], "chunk2 state_out")
    finally:
        policy.net.honor_all_firsts = True


def test_stepwise_matches_openai(policy, ref) -> None:
    state, steps = policy.initial_state(3), []
    for t in range(24):
        latents, state, _ = run(policy, ref, t, t + 1, state)
        steps.append(outputs(policy, ref, latents, t, t + 1))
    cat = lambda key: torch.cat([s[key] for s in steps], dim=1)  # noqa: E731
    want = ref["stepwise"]
    close(cat("camera"), want["pi_logits"]["camera"], "stepwise camera")
    close(cat("buttons_subset"), want["pi_logits"]["buttons_subset"], "stepwise buttons")
    close(cat("vpred"), want["vpred"], "stepwise vpred (denormalised)")
    close(cat("fixed_action_logprob"), want["fixed_action_logprob"], "stepwise fixed logprob")
    close(cat("argmax_logprob"), want["argmax_action_logprob"], "stepwise argmax logprob")
    close(cat("entropy"), want["entropy"], "stepwise entropy")
    for k in ("buttons", "camera"):
        assert torch.equal(torch.cat([s["argmax"][k] for s in steps], 1), want["argmax_action"][k])
    check_state(state, want["state_out"], "stepwise state_out")
    assert want["state_out"][0][0][1, 0].tolist() == [False] * 5 + [True] * 5  # frames before the reset hidden


def test_chunked_honours_mid_chunk_reset(policy, ref) -> None:
    """Our training forward: equal to OpenAI's chunks except after the mid-chunk reset, where it
    equals the step-by-step run (README section 5, step 5)."""
    lat1, state1, inter1 = run(policy, ref, 0, 12, policy.initial_state(3))
    check_chunk(policy, ref, "chunk1", outputs(policy, ref, lat1, 0, 12), inter1)
    lat2, state2, inter2 = run(policy, ref, 12, 24, state1)
    out2 = outputs(policy, ref, lat2, 12, 24)
    for rows, cols in ((slice(0, 1), slice(None)), (slice(2, 3), slice(None)), (slice(1, 2), slice(0, 7))):
        check_chunk(policy, ref, "chunk2", out2, inter2, rows, cols)
    step = ref["stepwise"]
    close(out2["camera"][1, 7:], step["pi_logits"]["camera"][MID_RESET], "mid-reset camera vs stepwise")
    close(out2["buttons_subset"][1, 7:], step["pi_logits"]["buttons_subset"][MID_RESET], "mid-reset buttons")
    close(out2["vpred"][1, 7:], step["vpred"][MID_RESET], "mid-reset vpred vs stepwise")
    close(out2["entropy"][1, 7:], step["entropy"][MID_RESET], "mid-reset entropy vs stepwise")
    # OpenAI's chunked outputs differ there by far more than the tolerance: the check has teeth.
    assert (out2["camera"][1, 7:] - ref["chunk2"]["pi_logits"]["camera"][1, 7:]).abs().max() > 0.5
    check_state(state2, step["state_out"], "chunked state_out vs stepwise")


@pytest.mark.parametrize("honor_all", [True, False], ids=["honour-every-first", "openai-reference-mode"])
def test_ragged_calls(policy, ref, honor_all: bool) -> None:
    policy.net.honor_all_firsts = honor_all
    try:
        bounds = ref["ragged"]["call_bounds"]
        state, pieces = policy.initial_state(3), []
        for call, (t0, t1) in enumerate(zip(bounds[:-1], bounds[1:])):
            latents, state, _ = run(policy, ref, t0, t1, state)
            pieces.append(outputs(policy, ref, latents, t0, t1))
            want_masks = [m.clone() for m in ref["ragged"]["state_mask_per_call"][call]]
            if honor_all and call == len(bounds) - 2:  # the call holding the mid-call reset
                want_masks = [m.clone() for m in want_masks]
                for layer, m in enumerate(want_masks):
                    m[1] = ref["stepwise"]["state_out"][layer][0][1]
            for layer, (mask, _) in enumerate(state):
                assert torch.equal(mask, want_masks[layer]), f"call {call} layer {layer} mask"
    finally:
        policy.net.honor_all_firsts = True
    cat = lambda key: torch.cat([p[key] for p in pieces], dim=1)  # noqa: E731
    want = ref["ragged"]
    camera, vpred_n, vpred, entropy = cat("camera"), cat("vpred_normalized"), cat("vpred"), cat("entropy")
    rows = [0, 2] if honor_all else [0, 1, 2]
    close(camera[rows], want["pi_logits"]["camera"][rows], "ragged camera")
    close(vpred_n[rows], want["vpred_normalized"][rows], "ragged vpred_normalized")
    close(vpred[rows], want["vpred"][rows], "ragged vpred")
    close(entropy[rows], want["entropy"][rows], "ragged entropy")
    check_state(state, want["state_out"], "ragged state_out", rows=rows)
    if honor_all:
        close(camera[1], ref["stepwise"]["pi_logits"]["camera"][1], "ragged seq 1 camera vs stepwise")
        close(vpred[1], ref["stepwise"]["vpred"][1], "ragged seq 1 vpred vs stepwise")
        check_state(state, ref["stepwise"]["state_out"], "ragged seq 1 state vs stepwise", rows=[1])


def test_value_normaliser_statistics(policy, ref) -> None:
    mean, var = policy.value_head.normalizer.mean_var()
    close(mean, ref["value_normalizer"]["debiased_mean"], "debiased mean")
    close(var, ref["value_normalizer"]["debiased_var"], "debiased var")
    assert abs(var.sqrt().item() - 3.0) < 1e-4
