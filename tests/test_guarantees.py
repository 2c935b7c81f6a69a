"""DESIGN §5.1, §5.3, §5.4 and §5.9 through the real trainer, on fragments from the real collector.

Every batch goes through the trainer's own per-iteration estimate (``trainer.algorithm.estimate``, what
``fetch_fragments_and_estimate_advantages`` runs) before ``train``. Recurrent policies (the core's
GRU and a small VPT), ``batch_size_per_gpu > 1``, ``context_length`` shorter than a fragment and
episodes that end inside chunks: the first optimisation step on version-0 data sees ratio 1,
behaviour weight 1 and KL 0 to an identical reference, in fp32 and in bf16; on stale data the
stored behaviour log-probs weigh the update; ``clip_vloss`` is centred on the value head's output
at the start of the update; a drifted reference runs with its own recurrent state, carried from
each episode's start. ``tests/mutations`` reintroduces each defect and checks that these tests
fail on it.
"""

from __future__ import annotations

import copy
import functools

import gymnasium as gym
import numpy as np
import pytest
import torch
from mineonline_ppo import PPOTrainer

from mineonline_core.config import OnlineConfig
from mineonline_core.contracts import fragment as F
from mineonline_core.testing import kit as tk
from mineonline_core.trainer.batch import assemble_chunks
from mineonline_core.trainer.sequence import forward_sequence

FRAGMENT, CONTEXT, PER_CHUNK = 8, 5, 2


def vpt_policy(seed: int = 0) -> torch.nn.Module:
    from mineonline_vpt import VPTPolicy

    torch.manual_seed(seed)
    small = {
        "hidsize": 32,
        "impala_chans": [8, 16, 16],
        "n_recurrence_layers": 2,
        "attention_heads": 4,
        "attention_memory_size": 10,
        "timesteps": 4,
    }
    obs = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)})
    return VPTPolicy.build(small, observation_space=obs, action_space=gym.spaces.Discrete(3))


POLICIES = {"gru": tk.cnn_policy, "vpt": vpt_policy}


def make_trainer(tmp_path, policy_fn, **train) -> PPOTrainer:
    train = {
        "num_iterations": 5,
        "batches_per_iteration": 2,
        "batch_size_per_gpu": 2,
        "gradient_accumulation": 2,
        "context_length": CONTEXT,
        "learning_rate": 1e-3,
        "discount": 0.9,
        "zero_initial_vf": False,
        **train,
    }
    config = OnlineConfig(
        train_config=train,
        rollout_config={"fragment_length": FRAGMENT, "replay_buffer_config": {"fragments_per_chunk": PER_CHUNK}},
    )
    trainer = tk.local_loop(PPOTrainer, config, run_dir=str(tmp_path), policy=policy_fn)
    trainer.iteration = 1
    return trainer


def collect(
    behaviour: torch.nn.Module,
    reference: torch.nn.Module | None,
    *,
    num_envs: int = 4,
    fragments_per_env: int = 4,
    mean_length: int = 11,
) -> list[list[dict]]:
    """Chunks of ``PER_CHUNK`` consecutive fragments per env, from a ``FragmentCollector`` over
    inline ``TinyImageEnv``s whose episodes end at random (inside fragments and chunks)."""
    envs = [functools.partial(tk.TinyImageEnv, seed=i, mean_length=mean_length) for i in range(num_envs)]
    collector = tk.collector(
        policy=copy.deepcopy(behaviour),
        env_fns=envs,
        fragment_length=FRAGMENT,
        batch_size=num_envs,
        env_processes=False,
        seed=0,
    )
    if reference is not None:
        collector.set_reference(reference.state_dict())
    try:
        frags = collector.collect(num_envs * fragments_per_env)
    finally:
        collector.close()
    streams: dict[str, list[dict]] = {}
    for frag in sorted(frags, key=lambda f: (f[F.STREAM], f[F.INDEX])):
        streams.setdefault(frag[F.STREAM], []).append(frag)
    return tk.chunks_of(streams, PER_CHUNK)


def batch_of(trainer: PPOTrainer, chunks: list[list[dict]]) -> dict:
    """The trainer's own per-iteration estimate over the assembled chunks: what
    ``fetch_fragments_and_estimate_advantages`` runs on a fetched batch."""
    return trainer.algorithm.estimate(batch=assemble_chunks(chunks))


def first_step_gradients(trainer: PPOTrainer, batch: dict) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """``train`` over a batch that makes one optimiser step; the gradients it clipped and stepped with."""
    grads: dict[str, torch.Tensor] = {}
    trainer.algorithm.filter_gradients = lambda: grads.update(
        {name: p.grad.clone() for name, p in trainer.policy.named_parameters() if p.grad is not None}
    )
    return grads, trainer.train(batch)


def drift(policy: torch.nn.Module, scale: float = 0.3, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_first_step_on_version0_data_is_on_policy_and_kl_to_an_identical_reference_is_0(tmp_path, name):
    trainer = make_trainer(
        tmp_path, POLICIES[name], kl_divergence_coef_rho=0.5, batches_per_iteration=2, gradient_accumulation=2
    )
    chunks = collect(trainer.policy, trainer.reference, num_envs=2)
    batch = batch_of(trainer, chunks)
    first = batch[F.FIRST]
    assert (
        first.shape == (4, PER_CHUNK * FRAGMENT) and first[:, 1:].any() and not first[:, 0].all()
    )  # resets inside chunks
    # Two micro-batches of two chunks, one optimiser step after both.
    metrics = trainer.train(batch)
    # The training forward reproduces rollout's log-probs (§5.3): the proximal policy is the behaviour policy.
    assert metrics["trainer/behaviour_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["trainer/behaviour_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["trainer/ratio_deviation"] < 1e-5
    assert metrics["trainer/approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["trainer/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["trainer/clipfrac"] == 0.0 and metrics["trainer/grad_norm"] > 0


def test_stale_data_ratio_is_taken_against_the_stored_behaviour_logprob(tmp_path):
    """§5.1 with the decoupled objective: the first step clips nothing (its ratio is to the
    proximal policy, the model it starts from) and weighs each step by pi_prox / mu, mu the stored
    behaviour log-prob: its KL(mu || pi_prox) is the staleness the fetch-time estimate must keep."""
    trainer = make_trainer(tmp_path, tk.cnn_policy, batches_per_iteration=4, gradient_accumulation=4)
    behaviour = copy.deepcopy(trainer.policy)
    drift(behaviour, 0.05)
    batch = assemble_chunks(collect(behaviour, None))
    stored = batch[F.LOGPROB].clone()  # what rollout recorded, before the trainer's estimate step
    with torch.no_grad():
        latents, _ = forward_sequence(
            trainer.policy, batch[F.OBS], batch[F.STATE_IN], batch[F.FIRST], context_length=CONTEXT
        )
        log_weight = trainer.policy.pi_head.logprob(batch[F.ACTION], latents["pi_logits"]) - stored
    batch = trainer.algorithm.estimate(batch=batch)
    expected_kl = ((log_weight.exp() - 1) - log_weight).mean().item()
    assert expected_kl > 1e-3
    metrics = trainer.train(batch)  # one optimiser step, after every micro-batch
    assert metrics["trainer/behaviour_kl"] == pytest.approx(expected_kl, rel=1e-3)
    assert metrics["trainer/behaviour_weight_mean"] == pytest.approx(
        log_weight.exp().clamp(max=2.0).mean().item(), rel=1e-3
    )
    assert metrics["trainer/approx_kl"] == pytest.approx(0.0, abs=1e-6) and metrics["trainer/clipfrac"] == 0.0


def test_the_stored_behaviour_logprob_changes_the_update(tmp_path):
    """The same chunks with other stored behaviour log-probs train to other weights: the estimate
    step keeps what rollout stored (MineStudio overwrites it with the current model's at fetch time)."""
    chunks, weights = None, []
    for shift in (0.0, 0.0, 0.3):
        # adam_eps=1 makes the step proportional to the gradient (Adam's first step is its sign otherwise).
        trainer = make_trainer(tmp_path, tk.cnn_policy, batches_per_iteration=4, gradient_accumulation=4, adam_eps=1.0)
        chunks = chunks or collect(trainer.policy, None)
        batch = assemble_chunks(chunks)
        batch[F.LOGPROB][:, ::2] -= shift  # as if the behaviour policy had liked every other action less
        trainer.train(trainer.algorithm.estimate(batch=batch))
        weights.append(torch.cat([p.detach().flatten() for p in trainer.policy.parameters()]))
    same, changed = (weights[0] - weights[1]).abs().max().item(), (weights[0] - weights[2]).abs().max().item()
    assert changed > 1e-6 and changed > 100 * same  # the update is deterministic up to float rounding


def window_stats(trainer: PPOTrainer) -> list[dict[str, float]]:
    """Records the loss metrics of every window ``train`` runs (the metrics it returns are averages)."""
    seen: list[dict[str, float]] = []
    compute_loss = trainer.algorithm.compute_loss

    def recording(*, batch: dict, outputs: dict):
        loss, stats = compute_loss(batch=batch, outputs=outputs)
        seen.append({k: float(v) for k, v in stats.items()})
        return loss, stats

    trainer.algorithm.compute_loss = recording
    return seen


@pytest.mark.parametrize("use_amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_precision_never_turns_on_policy_data_off_policy(tmp_path, name, use_amp):
    """DESIGN §5.9 / issue 24: data collected in fp32 by the current policy, trained with
    ``use_amp`` (bf16 autocast on CPU): the first step's ratio is within 1e-3 of 1 everywhere and
    clips nothing, although bf16's log-probs differ from rollout's."""
    trainer = make_trainer(tmp_path, POLICIES[name], use_amp=use_amp)
    batch = batch_of(trainer, collect(trainer.policy, None, num_envs=2))
    precision_gap = (batch[F.LOGPROB_PROX] - batch[F.LOGPROB]).abs().max().item()
    assert (precision_gap > 1e-3) if use_amp else (precision_gap < 1e-5)
    seen = window_stats(trainer)
    trainer.train(batch)  # two micro-batches, one optimiser step after both
    assert len(seen) == 2 * len(range(0, PER_CHUNK * FRAGMENT, CONTEXT))
    assert max(s["ratio_deviation"] for s in seen) < 1e-3
    assert max(s["clipfrac"] for s in seen) == 0.0


def test_drifted_reference_carries_its_own_state_from_each_episode_start(tmp_path):
    """B3: chunks that start mid-episode; the exact KL runs both policies over whole streams."""
    trainer = make_trainer(
        tmp_path,
        tk.cnn_policy,
        kl_divergence_coef_rho=0.5,
        batches_per_iteration=1,
        batch_size_per_gpu=4,
        gradient_accumulation=1,
    )
    drift(trainer.reference, 0.05)
    chunks = collect(trainer.policy, trainer.reference, fragments_per_env=4, mean_length=40)
    streams = [chunks[i : i + 2] for i in range(0, len(chunks), 2)]  # per env: fragments 0-1, then 2-3
    whole = batch_of(trainer, [a + b for a, b in streams])
    later = batch_of(trainer, [b for _, b in streams])
    assert whole[F.FIRST][:, 0].all() and not later[F.FIRST][:, 0].all()  # the later chunks start mid-episode
    # Exact: both policies over each env's whole stream from its start, then the KL on the later chunk.
    with torch.no_grad():
        pi, _ = forward_sequence(trainer.policy, whole[F.OBS], whole[F.STATE_IN], whole[F.FIRST], context_length=1)
        ref, _ = forward_sequence(
            trainer.reference, whole[F.OBS], trainer.reference.initial_state(4), whole[F.FIRST], context_length=1
        )
        kl = trainer.policy.pi_head.kl_divergence(pi["pi_logits"], ref["pi_logits"])
    exact = kl.reshape(4, -1)[:, PER_CHUNK * FRAGMENT :].mean().item()
    assert exact > 1e-3
    metrics = trainer.train(later)
    assert metrics["trainer/kl_ref"] == pytest.approx(exact, rel=1e-4)


def test_clip_vloss_is_centred_on_the_value_heads_output_at_the_start_of_the_update(tmp_path):
    """Issue 25: with normalised values the first step on on-policy data has v == v_old, so the
    clipped value loss is the unclipped one, gradients included; the normaliser moves a lot here
    (its first update), so a centre re-normalised with the updated statistics lies far away."""
    chunks, grads, metrics = None, {}, {}
    for clip_vloss in (False, True):
        trainer = make_trainer(
            tmp_path,
            tk.cnn_policy,
            use_normalized_vf=True,
            clip_vloss=clip_vloss,
            ppo_clip=0.05,
            batches_per_iteration=4,
            gradient_accumulation=4,
        )
        chunks = chunks or collect(trainer.policy, None)
        grads[clip_vloss], metrics[clip_vloss] = first_step_gradients(trainer, batch_of(trainer, chunks))
    assert metrics[True]["trainer/value_loss"] == pytest.approx(metrics[False]["trainer/value_loss"], rel=1e-6)
    assert grads[False]["value_head.linear.weight"].abs().max() > 0
    assert grads[True].keys() == grads[False].keys()
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-5, atol=1e-8, msg=name)


def test_the_normalised_value_head_regresses_normalised_returns(tmp_path):
    """The value target is the return in the head's units after the normaliser's update; the first
    step's value loss is measured from the head's start output (``old_vpred``)."""
    trainer = make_trainer(
        tmp_path, tk.cnn_policy, use_normalized_vf=True, batches_per_iteration=4, gradient_accumulation=4
    )
    batch = batch_of(trainer, collect(trainer.policy, None))
    start, returns = batch[F.OLD_VPRED].clone(), batch[F.RETURN].clone()
    metrics = trainer.train(batch)  # one optimiser step, after every micro-batch
    target = trainer.policy.value_head.normalize(returns)
    assert (target - returns).abs().mean() > 0.1  # the normaliser is far from the identity
    expected = 0.5 * ((start - target) ** 2).mean().item()
    assert metrics["trainer/value_loss"] == pytest.approx(expected, rel=1e-4)
