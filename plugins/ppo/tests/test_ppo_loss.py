"""PPO loss pieces and train-step semantics, on real fragments from a step-by-step rollout."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from mineonline_ppo import PPOTrainer, ppo_loss

from mineonline_core.config import OnlineConfig
from mineonline_core.contracts import fragment as F
from mineonline_core.contracts.policy import CategoricalHead
from mineonline_core.errors import ConfigError
from mineonline_core.testing.kit import (
    TinyImageEnv,
    cartpole,
    chunks_of,
    cnn_policy,
    local_loop,
    mlp_policy,
    rollout_fragments,
)
from mineonline_core.trainer.batch import assemble_chunks, estimate_advantages

HEAD = CategoricalHead(4, 3)


def _loss(**overrides):
    torch.manual_seed(0)
    logits = torch.log_softmax(torch.randn(2, 5, 3), -1)
    action = torch.randint(0, 3, (2, 5))
    kw = dict(
        pi_head=HEAD,
        pi_logits=logits,
        vpred=torch.zeros(2, 5),
        action=action,
        behaviour_logprob=HEAD.logprob(action, logits),
        old_vpred=torch.zeros(2, 5),
        advantage=torch.ones(2, 5),
        value_target=torch.ones(2, 5),
        ref_logits=None,
        rho=0.0,
        clip=0.2,
        behaviour_weight_clip=2.0,
        log_ratio_range=50.0,
        clip_vloss=False,
        policy_coef=1.0,
        vf_coef=0.5,
        entropy_coef=0.0,
    )
    kw.update(overrides)
    kw.setdefault("proximal_logprob", kw["behaviour_logprob"])  # fresh fp32 data: pi_prox == mu
    return ppo_loss(**kw)


def test_ratio_is_taken_against_the_proximal_logprob_and_weighted_from_the_behaviour_logprob():
    loss, stats = _loss()
    assert stats["policy_loss"].item() == pytest.approx(-1.0)  # ratio 1, weight 1, advantage 1
    assert stats["approx_kl"].item() == pytest.approx(0.0, abs=1e-7) and stats["clipfrac"].item() == 0.0
    logits = torch.log_softmax(torch.randn(2, 5, 3), -1)
    action = torch.zeros(2, 5, dtype=torch.long)
    current = HEAD.logprob(action, logits)
    # The behaviour policy liked these actions more: ratio 1 to the proximal (current) policy, weight e^-0.1.
    _, stats = _loss(pi_logits=logits, action=action, behaviour_logprob=current + 0.1, proximal_logprob=current)
    assert stats["policy_loss"].item() == pytest.approx(-math.exp(-0.1), rel=1e-5)
    assert stats["approx_kl"].item() == pytest.approx(0.0, abs=1e-7) and stats["ratio_deviation"].item() == 0.0
    assert stats["behaviour_weight_mean"].item() == pytest.approx(math.exp(-0.1), rel=1e-6)
    assert stats["behaviour_kl"].item() == pytest.approx(math.exp(-0.1) - 1 + 0.1, rel=1e-4)
    # The same gap between the proximal and the current policy is the ratio instead (weight 1).
    _, stats = _loss(pi_logits=logits, action=action, behaviour_logprob=current + 0.1)
    assert stats["policy_loss"].item() == pytest.approx(-math.exp(-0.1), rel=1e-5)
    assert stats["behaviour_weight_mean"].item() == 1.0 and stats["approx_kl"].item() > 0
    # A weight above behaviour_weight_clip is truncated to it.
    _, stats = _loss(pi_logits=logits, action=action, behaviour_logprob=current - 1.0, proximal_logprob=current)
    assert stats["policy_loss"].item() == pytest.approx(-2.0, rel=1e-6)
    assert stats["behaviour_weight_clipfrac"].item() == 1.0


def test_clipping_bounds_the_ratio_and_stops_the_gradient():
    logits = torch.log_softmax(torch.randn(2, 5, 3), -1).requires_grad_(True)
    action = torch.zeros(2, 5, dtype=torch.long)
    behaviour = HEAD.logprob(action, logits).detach() - 0.5  # ratio e^0.5 ~ 1.65 > 1.2
    loss, stats = _loss(pi_logits=logits, action=action, behaviour_logprob=behaviour, vf_coef=0.0)
    assert stats["policy_loss"].item() == pytest.approx(-1.2, rel=1e-6)
    assert stats["clipfrac"].item() == 1.0
    loss.backward()
    assert logits.grad.abs().max().item() == 0.0
    # log_ratio_range clamps both sides before exp.
    _, stats = _loss(
        pi_logits=logits.detach(),
        action=action,
        behaviour_logprob=behaviour,
        log_ratio_range=0.1,
        advantage=-torch.ones(2, 5),
    )
    assert stats["policy_loss"].item() == pytest.approx(torch.exp(torch.tensor(0.1)).item(), rel=1e-5)


@pytest.mark.parametrize("advantage, log_ratio", [(-1.0, 0.5), (1.0, -0.5)])
def test_the_surrogate_is_pessimistic_outside_the_clip_range(advantage, log_ratio):
    """min(r A, clip(r) A): where clipping would flatter the objective, the unclipped term counts and
    keeps its gradient (r = e^0.5 with A < 0, r = e^-0.5 with A > 0)."""
    logits = torch.log_softmax(torch.randn(2, 5, 3), -1).requires_grad_(True)
    action = torch.zeros(2, 5, dtype=torch.long)
    proximal = HEAD.logprob(action, logits).detach() - log_ratio
    loss, stats = _loss(
        pi_logits=logits,
        action=action,
        behaviour_logprob=proximal,
        vf_coef=0.0,
        advantage=torch.full((2, 5), advantage),
    )
    assert stats["policy_loss"].item() == pytest.approx(-advantage * math.exp(log_ratio), rel=1e-5)
    assert stats["clipfrac"].item() == 1.0
    loss.backward()
    assert logits.grad.abs().max().item() > 0


def test_clip_vloss_around_the_start_value():
    vpred, target = torch.full((2, 5), 2.0), torch.full((2, 5), 3.0)
    _, plain = _loss(vpred=vpred, value_target=target)
    assert plain["value_loss"].item() == pytest.approx(0.5)
    # Start value 0: the clipped value is 0.2, farther from the target, so the max picks it.
    _, clipped = _loss(vpred=vpred, value_target=target, clip_vloss=True)
    assert clipped["value_loss"].item() == pytest.approx(0.5 * 2.8**2, rel=1e-6)


def test_kl_term_is_weighted_by_rho():
    logits = torch.log_softmax(torch.randn(2, 5, 3), -1)
    ref = torch.log_softmax(torch.randn(2, 5, 3), -1)
    base, _ = _loss(pi_logits=logits)
    with_kl, stats = _loss(pi_logits=logits, ref_logits=ref, rho=0.3)
    expected_kl = (logits.exp() * (logits - ref)).sum(-1).mean()
    assert stats["kl_ref"].item() == pytest.approx(expected_kl.item(), rel=1e-6)
    assert (with_kl - base).item() == pytest.approx(0.3 * expected_kl.item(), rel=1e-5)


# -- whole train() steps on real fragments --------------------------------------------------------


def make_trainer(tmp_path, policy_fn=mlp_policy, **train):
    train = {
        "num_iterations": 5,
        "batches_per_iteration": 2,
        "batch_size_per_gpu": 2,
        "gradient_accumulation": 2,
        "context_length": 6,
        "learning_rate": 1e-2,
        "discount": 0.9,
        **train,
    }
    config = OnlineConfig(train_config=train, rollout_config={"fragment_length": 8})
    trainer = local_loop(PPOTrainer, config, run_dir=str(tmp_path), policy=policy_fn)
    return trainer


def make_batch(trainer, env_fn=lambda i: cartpole(12), num_envs=2):
    streams = rollout_fragments(trainer.policy, env_fn, num_envs=num_envs, fragment_length=8, fragments_per_env=4)
    batch = assemble_chunks(chunks_of(streams, 2))
    return estimate_advantages(trainer.model, batch, version=0, context_length=6, discount=0.9, gae_lambda=0.95)


def params(module):
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def changed(before, module):
    return {k for k, v in module.named_parameters() if not torch.equal(before[k], v.detach())}


def test_first_pass_over_version0_data_is_on_policy(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer.iteration = 1
    before = params(trainer.policy)
    metrics = trainer.train(make_batch(trainer))
    # One optimiser step at the end (accumulation over both batches): every ratio is exactly 1.
    assert metrics["trainer/approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["trainer/clipfrac"] == 0.0
    assert metrics["trainer/grad_norm"] > 0 and changed(before, trainer.policy)
    assert set(metrics) >= {
        f"trainer/{k}" for k in ("policy_loss", "value_loss", "entropy", "kl_ref", "explained_variance")
    }


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    a = make_trainer(
        tmp_path,
        batch_size_per_gpu=1,
        batches_per_iteration=4,
        gradient_accumulation=4,
        max_grad_norm=1e9,
        adam_eps=1.0,
    )
    b = make_trainer(
        tmp_path,
        batch_size_per_gpu=4,
        batches_per_iteration=1,
        gradient_accumulation=1,
        max_grad_norm=1e9,
        adam_eps=1.0,
    )
    batch = make_batch(a)
    a.iteration = b.iteration = 1
    before = params(a.policy)
    a.train(copy.deepcopy(batch)), b.train(copy.deepcopy(batch))
    # adam_eps=1 makes the step proportional to the gradient, so equal steps mean equal gradients.
    assert changed(before, a.policy)
    for (name, pa), (_, pb) in zip(a.policy.named_parameters(), b.policy.named_parameters()):
        assert torch.allclose(pa, pb, atol=1e-6), (name, (pa - pb).abs().max())


def test_vf_warmup_minestudio_meaning_trains_everything_on_value_loss_and_kl(tmp_path):
    trainer = make_trainer(tmp_path, vf_warmup=1, kl_divergence_coef_rho=0.5)
    trainer.iteration = 1
    trainer.policy.actor[0].weight.data.add_(0.5)  # the reference differs, so the KL pulls the actor
    before = params(trainer.policy)
    metrics = {**trainer.train(make_batch(trainer)), **trainer.algorithm.iteration_metrics()}
    moved = changed(before, trainer.policy)
    assert metrics["trainer/vf_warmup"] == 1.0 and metrics["trainer/kl_ref"] > 0
    assert {"actor.0.weight", "value_head.linear.weight"} <= moved and not metrics["trainer/value_only"]
    # The policy terms weigh 0: with the KL gone too, only the value loss moves anything.
    plain = make_trainer(tmp_path, vf_warmup=1, weight_decay=0.0, entropy_bonus_coef=0.1)
    plain.iteration = 1
    before = params(plain.policy)
    plain.train(make_batch(plain))
    assert not any(k.startswith(("actor.", "pi_head.")) for k in changed(before, plain.policy))


def test_vf_warmup_value_head_only_updates_only_the_value_head(tmp_path):
    trainer = make_trainer(tmp_path, vf_warmup=1, vf_warmup_value_head_only=True, weight_decay=0.1)
    trainer.iteration = 1
    before = params(trainer.policy)
    trainer.train(make_batch(trainer))
    moved = changed(before, trainer.policy)
    assert moved and all(k.startswith("value_head.") for k in moved), moved


def test_freeze_pi_head_freezes_it_and_fix_decoder_alone_does_not(tmp_path):
    trainer = make_trainer(tmp_path, freeze_pi_head=True)
    trainer.iteration = 1
    before = params(trainer.policy)
    trainer.train(make_batch(trainer))
    moved = changed(before, trainer.policy)
    assert moved and not any(k.startswith("pi_head.") for k in moved)
    minestudio = make_trainer(tmp_path, fix_decoder=True)
    minestudio.iteration = 1
    before = params(minestudio.policy)
    minestudio.train(make_batch(minestudio))
    assert any(k.startswith("pi_head.") for k in changed(before, minestudio.policy))

    class NoDecoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.value_head = mlp_policy().value_head

    with pytest.raises(ConfigError, match="freeze_pi_head"):
        make_trainer(tmp_path, policy_fn=NoDecoder, freeze_pi_head=True, zero_initial_vf=False)


def test_minestudio_only_keys_are_accepted_and_reported(tmp_path, caplog):
    from mineonline_core.config import load_config

    with caplog.at_level("WARNING", logger="mineonline"):
        load_config({"train_config": {"num_readers": 8, "num_cpus_per_reader": 0.1}})  # the core's own
        # PPO's own: reported once, by the driver's preflight.
        make_trainer(tmp_path, fix_decoder=True, enable_ref_update=True).preflight()
    for key in ("fix_decoder", "enable_ref_update", "num_readers"):
        assert f"train_config.{key}" in caplog.text and "has no effect" in caplog.text
    assert "num_cpus_per_reader" not in caplog.text  # set to its default: nothing to say


def test_kl_reference_and_ref_update_at_checkpoint(tmp_path):
    trainer = make_trainer(tmp_path, kl_divergence_coef_rho=0.5, ref_update_at_checkpoint=True)
    ref = trainer.reference
    assert ref is not None and not any(p.requires_grad for p in ref.parameters())
    # The reference starts as policy_generator()'s weights, i.e. the initial policy (value head aside).
    assert torch.equal(ref.actor[0].weight, trainer.policy.actor[0].weight)
    trainer.iteration = 1
    batch = make_batch(trainer)
    metrics = trainer.train(copy.deepcopy(batch))
    assert metrics["trainer/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # first step: policy == reference
    trainer.iteration = 2
    metrics = trainer.train(copy.deepcopy(batch))
    assert metrics["trainer/kl_ref"] > 0
    assert not torch.equal(ref.actor[0].weight, trainer.policy.actor[0].weight)
    trainer.save_checkpoint()  # a checkpoint refreshes the reference
    assert torch.equal(ref.actor[0].weight, trainer.policy.actor[0].weight)
    assert trainer.algorithm.rho_at(3) == pytest.approx(0.5 * 0.9995**2)
    # enable_ref_update alone (MineStudio's PPOTrainer reads it nowhere) keeps the reference.
    minestudio = make_trainer(tmp_path, kl_divergence_coef_rho=0.5, enable_ref_update=True)
    minestudio.iteration = 1
    minestudio.train(make_batch(minestudio))
    minestudio.save_checkpoint()
    assert not torch.equal(minestudio.reference.actor[0].weight, minestudio.policy.actor[0].weight)


def test_normalize_advantage_full_batch_false_leaves_advantages_alone(tmp_path):
    """B4: one chunk per micro-batch, advantages all +1: MineStudio trains on them as they are."""
    batch = None
    for per_minibatch, expected in ((False, -1.0), (True, 0.0)):
        trainer = make_trainer(
            tmp_path,
            normalize_advantage_full_batch=False,
            batch_size_per_gpu=1,
            batches_per_iteration=4,
            gradient_accumulation=4,
            normalize_advantage_per_minibatch=per_minibatch,
        )
        trainer.iteration = 1
        batch = batch if batch is not None else make_batch(trainer)
        batch[F.ADVANTAGE] = torch.ones_like(batch[F.ADVANTAGE])
        metrics = trainer.train(copy.deepcopy(batch))
        assert metrics["trainer/policy_loss"] == pytest.approx(expected, abs=1e-5)  # ratio 1 on the one step


def test_minibatches_are_reshuffled_every_epoch(tmp_path):
    trainer = make_trainer(
        tmp_path, epochs_per_iteration=3, batch_size_per_gpu=1, batches_per_iteration=4, gradient_accumulation=4
    )
    trainer.iteration = 1
    seen, backward = [], trainer._backward
    trainer._backward = lambda batch, rows, *a, **kw: seen.append(rows.tolist()) or backward(batch, rows, *a, **kw)
    trainer.train(make_batch(trainer))
    epochs = [sum(seen[i : i + 4], []) for i in range(0, 12, 4)]
    assert all(sorted(e) == [0, 1, 2, 3] for e in epochs)  # every chunk once per epoch
    assert len({tuple(e) for e in epochs}) > 1, epochs


def test_zero_initial_vf_meanings(tmp_path):
    def pretrained_head():
        policy = mlp_policy()
        policy.value_head.update_normalizer(torch.full((8,), 5.0))
        return policy

    minestudio = make_trainer(tmp_path, policy_fn=pretrained_head, zero_initial_vf=True)
    assert all(not p.any() for p in minestudio.policy.value_head.parameters())  # statistics too
    ours = make_trainer(tmp_path, policy_fn=pretrained_head, zero_initial_vf=True, zero_initial_vf_keep_normalizer=True)
    assert not ours.policy.value_head.linear.weight.any()
    assert ours.policy.value_head.normalizer.mean_var()[0].item() == pytest.approx(5.0)


def test_normalized_vf_updates_the_normaliser(tmp_path):
    trainer = make_trainer(tmp_path)
    trainer.iteration = 1
    batch = make_batch(trainer)
    trainer.train(batch)
    mean, _ = trainer.policy.value_head.normalizer.mean_var()
    assert mean.item() == pytest.approx(batch[F.RETURN].mean().item(), rel=1e-3)


def test_recurrent_policy_with_batches_and_amp_bf16(tmp_path):
    trainer = make_trainer(tmp_path, policy_fn=cnn_policy, batch_size_per_gpu=2, use_amp=True, context_length=5)
    trainer.iteration = 1
    batch = make_batch(trainer, env_fn=lambda i: TinyImageEnv(seed=i), num_envs=2)
    assert batch[F.STATE_IN][0].shape == (4, 32)
    before = params(trainer.policy)
    metrics = trainer.train(batch)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert "gru.weight_hh" in changed(before, trainer.policy)
