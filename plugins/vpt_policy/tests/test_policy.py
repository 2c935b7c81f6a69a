"""A VPT-architecture policy built from kwargs (Crafter-shaped), the rollout/training equivalence
and the plugin registration."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from mineonline_core.errors import ConfigError
from mineonline_core.contracts.tree import tree_cat, tree_index
from mineonline_vpt import VPTPolicy

CRAFTER_OBS = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)})
# The attention band (maxlen = attention_memory_size - timesteps = 6) is shorter than the sequences the
# tests feed (T): it clips inside a call.
SMALL = {
    "hidsize": 32,
    "impala_chans": [8, 16, 16],
    "n_recurrence_layers": 2,
    "attention_heads": 4,
    "attention_memory_size": 10,
    "timesteps": 4,
}


def crafter_policy(seed: int = 0, hw: int = 64) -> VPTPolicy:
    torch.manual_seed(seed)
    obs = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (hw, hw, 3), np.uint8)})
    return VPTPolicy.build(SMALL, observation_space=obs, action_space=gym.spaces.Discrete(17))


def test_crafter_policy_forward_sample_logprob_backward() -> None:
    policy = crafter_policy()
    b, t = 2, 5
    img = torch.randint(0, 256, (b, t, 64, 64, 3), dtype=torch.uint8)
    first = torch.zeros(b, t, dtype=torch.bool)
    first[:, 0] = True
    latents, state = policy({"image": img}, policy.initial_state(b), {"first": first})
    logp = latents["pi_logits"]
    assert logp.shape == (b, t, 17) and latents["vpred"].shape == (b, t, 1)
    assert torch.allclose(logp.exp().sum(-1), torch.ones(b, t), atol=1e-5)
    # A fresh policy is close to uniform, so exploration starts unbiased.
    assert (policy.pi_head.entropy(logp) - np.log(17)).abs().max() < 0.01
    action = policy.pi_head.sample(logp)
    assert action.shape == (b, t) and action.dtype == torch.int64 and int(action.max()) < 17
    lp = policy.pi_head.logprob(action, logp)
    assert lp.shape == (b, t) and bool((lp <= 0).all())
    kl = policy.pi_head.kl_divergence(logp, logp.detach())
    loss = (
        -(lp * torch.randn(b, t)).mean()
        + latents["vpred"].pow(2).mean()
        - 0.01 * policy.pi_head.entropy(logp).mean()
        + kl.mean()
    )
    loss.backward()
    missing = [
        n for n, p in policy.named_parameters() if p.requires_grad and (p.grad is None or p.grad.abs().sum() == 0)
    ]
    assert missing == []
    assert all(torch.isfinite(p.grad).all() for p in policy.parameters() if p.grad is not None)
    assert state[0][0].shape == (b, 1, 6) and state[0][1][0].shape == (b, 6, 32)


@pytest.mark.parametrize(
    ("seed", "dtype", "tol"), [(0, torch.float64, 1e-9), (1, torch.float64, 1e-9), (2, torch.float32, 2e-4)]
)
def test_stepwise_rollout_equals_chunked_training_forward(seed: int, dtype: torch.dtype, tol: float) -> None:
    """What the rollout computed step by step, the trainer recomputes in one call (resets at any t).

    In float64 the two agree to ~1e-13, so any logic difference would show far above 1e-9. In float32
    the convolutions alone differ by ~1e-5 between batch shapes (oneDNN picks other algorithms), so
    the float32 case only bounds that noise.
    """
    policy = crafter_policy(seed, hw=16).eval().to(dtype)  # small frames: the recurrence is under test
    gen = torch.Generator().manual_seed(seed)
    b, t = 3, 17
    img = torch.randint(0, 256, (b, t, 16, 16, 3), dtype=torch.uint8, generator=gen)
    first = torch.rand(b, t, generator=gen) < 0.2
    first[0, 0], first[1, 9], first[2, 1], first[2, 2] = True, True, True, True  # incl. consecutive resets
    start = policy.initial_state(b)
    with torch.no_grad():  # warm the memory so state columns matter at step 0
        _, start = policy({"image": img.flip(1)}, start, {"first": torch.zeros(b, t, dtype=torch.bool)})
        action = policy.pi_head.sample(policy({"image": img}, start, {"first": first})[0]["pi_logits"])
        # The rollout: one call per step, each env's state kept separately and re-batched.
        per_env = [tree_index(start, slice(i, i + 1)) for i in range(b)]
        step_lp, step_v = [], []
        for s in range(t):
            state = tree_cat(per_env)
            latents, state = policy({"image": img[:, s : s + 1]}, state, {"first": first[:, s : s + 1]})
            per_env = [tree_index(state, slice(i, i + 1)) for i in range(b)]
            step_lp.append(policy.pi_head.logprob(action[:, s : s + 1], latents["pi_logits"]))
            step_v.append(latents["vpred"])
        step_state = tree_cat(per_env)
        latents, chunk_state = policy({"image": img}, start, {"first": first})
    chunk_lp = policy.pi_head.logprob(action, latents["pi_logits"])
    assert (chunk_lp - torch.cat(step_lp, 1)).abs().max() < tol
    assert (latents["vpred"] - torch.cat(step_v, 1)).abs().max() < tol
    for (m1, (k1, v1)), (m2, (k2, v2)) in zip(chunk_state, step_state):
        assert torch.equal(m1, m2)
        assert torch.allclose(k1, k2, rtol=tol, atol=tol) and torch.allclose(v1, v2, rtol=tol, atol=tol)
    # Ignoring mid-call resets (OpenAI's chunked convention) would change the result.
    policy.net.honor_all_firsts = False
    with torch.no_grad():
        latents_openai, _ = policy({"image": img}, start, {"first": first})
    assert (policy.pi_head.logprob(action, latents_openai["pi_logits"]) - chunk_lp).abs().max() > 1e-3


def test_dict_action_space_and_value_head() -> None:
    space = gym.spaces.Dict({"buttons": gym.spaces.MultiDiscrete([8641]), "camera": gym.spaces.MultiDiscrete([121])})
    obs = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (128, 128, 3), np.uint8)})
    policy = VPTPolicy.build(
        {"hidsize": 16, "attention_heads": 2, "n_recurrence_layers": 1, "impala_chans": [4, 4, 4]},
        observation_space=obs,
        action_space=space,
    )
    assert list(policy.state_dict())[-4:] == [
        "pi_head.camera.linear_layer.weight",
        "pi_head.camera.linear_layer.bias",
        "pi_head.buttons.linear_layer.weight",
        "pi_head.buttons.linear_layer.bias",
    ]
    img = torch.randint(0, 256, (2, 3, 128, 128, 3), dtype=torch.uint8)
    latents, _ = policy({"image": img}, None, {"first": torch.ones(2, 3, dtype=torch.bool)})
    assert latents["pi_logits"]["buttons"].shape == (2, 3, 1, 8641)
    assert latents["pi_logits"]["camera"].shape == (2, 3, 1, 121)
    action = policy.pi_head.sample(latents["pi_logits"])
    assert action["buttons"].shape == (2, 3, 1) and policy.pi_head.logprob(action, latents["pi_logits"]).shape == (2, 3)
    head = policy.value_head
    head.update_normalizer(torch.full((1000,), 5.0))
    assert abs(head.denormalize(head.normalize(torch.tensor([2.0]))).item() - 2.0) < 1e-4
    head.reset_parameters()
    latents, _ = policy({"image": img}, None, {"first": torch.ones(2, 3, dtype=torch.bool)})
    assert torch.all(latents["vpred"] == 0)


def test_build_errors_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="weights_path needs"):
        VPTPolicy.build(
            {"weights_path": "x.weights"}, observation_space=CRAFTER_OBS, action_space=gym.spaces.Discrete(3)
        )
    with pytest.raises(ConfigError, match="cannot be combined with model_path"):
        VPTPolicy.build({"model_path": "x.model", "hidsize": 64}, observation_space=CRAFTER_OBS, action_space=None)
    with pytest.raises(ConfigError, match="image_key"):
        VPTPolicy.build(
            {}, observation_space=gym.spaces.Dict({"rgb": CRAFTER_OBS["image"]}), action_space=gym.spaces.Discrete(3)
        )
    with pytest.raises(Exception, match="extra"):
        VPTPolicy.build({"hidsise": 3}, observation_space=CRAFTER_OBS, action_space=gym.spaces.Discrete(3))


def test_plugin_registers_vpt_policy() -> None:
    import mineonline_vpt
    from mineonline_core.registry import Origin, get_plugin_manager

    pm = get_plugin_manager(load_entry_points=False)
    pm.add_plugin(mineonline_vpt, Origin("vpt", "mineonline-vpt-policy", "test"))
    try:
        assert pm.lookup("policy", "vpt") is VPTPolicy
    finally:
        pm.remove_plugin(mineonline_vpt)


FIXTURES = (
    __import__("pathlib").Path(
        __import__("os").environ.get("MINEONLINE_VPT_FIXTURES")
        or __import__("pathlib").Path(__file__).resolve().parents[3].parent / "shared" / "fixtures"
    )
    / "vpt_public"
)


@pytest.mark.skipif(not (FIXTURES / "public.model").exists(), reason="VPT public fixture not present")
def test_build_from_released_files_with_minecraft_spaces() -> None:
    """``policy_config: {name: vpt, model_path, weights_path}`` with MinecraftSim-shaped spaces."""
    obs = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (128, 128, 3), np.uint8)})
    act = gym.spaces.Dict({"buttons": gym.spaces.MultiDiscrete([8641]), "camera": gym.spaces.MultiDiscrete([121])})
    options = VPTPolicy.Config(model_path=str(FIXTURES / "public.model"), weights_path=str(FIXTURES / "public.weights"))
    policy = VPTPolicy.build(options, observation_space=obs, action_space=act)
    weights = torch.load(FIXTURES / "public.weights", weights_only=True)
    assert torch.equal(
        policy.state_dict()["pi_head.buttons.linear_layer.weight"], weights["pi_head.buttons.linear_layer.weight"]
    )
    assert policy.pi_head.temperature == 1.5
    with pytest.raises(ConfigError, match="resize frames"):
        VPTPolicy.build(options, observation_space=CRAFTER_OBS, action_space=act)
    with pytest.raises(ConfigError, match="joint action space"):
        VPTPolicy.build(options, observation_space=obs, action_space=gym.spaces.Discrete(17))


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    grads = []
    for flag in (False, True):
        policy = crafter_policy(3, hw=16).double()  # float64: batch-split convs agree to ~1e-15
        policy.net.img_process.cnn.gradient_checkpointing = flag
        policy.net.img_process.cnn.checkpoint_frames = 3  # 8 frames: uneven pieces
        img = torch.randint(0, 256, (2, 4, 16, 16, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        latents, _ = policy({"image": img}, None, {"first": torch.ones(2, 4, dtype=torch.bool)})
        (latents["pi_logits"][..., 3].sum() + latents["vpred"].sum()).backward()
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 50
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-9, atol=1e-12), name
    options = VPTPolicy.Config(gradient_checkpointing=True, hidsize=32, attention_heads=4)
    built = VPTPolicy.build(options, observation_space=CRAFTER_OBS, action_space=gym.spaces.Discrete(5))
    assert built.net.img_process.cnn.gradient_checkpointing is True


def test_autocast_keeps_logprobs_and_state_in_float32() -> None:
    policy = crafter_policy(4, hw=32)
    img = torch.randint(0, 256, (2, 5, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    first = torch.zeros(2, 5, dtype=torch.bool)
    first[:, 0] = first[1, 3] = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        latents, state = policy({"image": img}, None, {"first": first})
    assert latents["pi_logits"].dtype == torch.float32 and latents["vpred"].dtype == torch.float32
    assert all(mask.dtype == torch.bool and k.dtype == v.dtype == torch.float32 for mask, (k, v) in state)
    reference, _ = policy({"image": img}, None, {"first": first})
    assert (latents["pi_logits"] - reference["pi_logits"]).abs().max() < 0.05  # bf16 trunk, fp32 heads


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 0.02), (torch.float16, 0.005)], ids=["bf16", "fp16"])
def test_autocast_forward_backward_is_finite_close_to_float32_and_masks_exactly(dtype: torch.dtype, tol: float) -> None:
    """bf16 and fp16 autocast (CPU runs both) through the whole network and back: finite, log-probs
    within ``tol`` of float32 (measured: 9e-4 bf16, 3e-4 fp16), gradients pointing the same way
    (cosine 0.9995 bf16, 0.9997 fp16), and
    masked keys given exactly zero weight (the mask fills from the dtype's range; -1e9 overflowed fp16)."""
    policy = crafter_policy(5, hw=32)
    b, t = 2, 5
    gen = torch.Generator().manual_seed(2)
    img = torch.randint(0, 256, (b, t, 32, 32, 3), dtype=torch.uint8, generator=gen)
    first = torch.zeros(b, t, dtype=torch.bool)
    first[:, 0] = first[1, 3] = True

    def run(images: torch.Tensor, state: list, amp: bool) -> tuple[dict, dict]:
        policy.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, enabled=amp):
            latents, _ = policy({"image": images}, state, {"first": first})
        # The policy term: at random init the value's gradient through the 15 convolutions is far
        # worse conditioned (cosine 0.91 in bf16, 0.99 in fp16), so it would measure the init, not the dtype.
        latents["pi_logits"][..., 1].sum().backward()
        return latents, {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

    reference, ref_grads = run(img, policy.initial_state(b), amp=False)
    latents, grads = run(img, policy.initial_state(b), amp=True)
    assert all(torch.isfinite(g).all() for g in grads.values()) and grads.keys() == ref_grads.keys()
    assert (latents["pi_logits"] - reference["pi_logits"]).abs().max() < tol
    assert (latents["vpred"] - reference["vpred"]).abs().max() < tol * 10  # the value is unbounded, not a log-prob
    flat, ref_flat = (
        torch.cat([g.flatten() for g in grads.values()]),
        torch.cat([g.flatten() for g in ref_grads.values()]),
    )
    assert torch.nn.functional.cosine_similarity(flat, ref_flat, dim=0) > 0.99
    # Zero weight on masked keys: a state whose every column belongs to an earlier episode (first[:, 0])
    # filled with large garbage, and env 1's frames before its reset at t=3, change nothing they must not.
    garbage = [
        (torch.ones_like(mask), (torch.randn(k.shape, generator=gen) * 100, torch.randn(v.shape, generator=gen) * 100))
        for mask, (k, v) in policy.initial_state(b)
    ]
    masked, _ = run(img, garbage, amp=True)
    other = img.clone()
    other[1, :3] = 255 - other[1, :3]
    changed, _ = run(other, policy.initial_state(b), amp=True)
    assert torch.equal(masked["pi_logits"], latents["pi_logits"]) and torch.equal(masked["vpred"], latents["vpred"])
    assert torch.equal(changed["pi_logits"][1, 3:], latents["pi_logits"][1, 3:])
    assert not torch.equal(changed["pi_logits"][1, :3], latents["pi_logits"][1, :3])


def test_config_rejects_inconsistent_sizes() -> None:
    with pytest.raises(Exception, match="must divide hidsize"):
        VPTPolicy.Config(hidsize=30, attention_heads=4)
    with pytest.raises(Exception, match="must exceed timesteps"):
        VPTPolicy.Config(attention_memory_size=64, timesteps=64)
