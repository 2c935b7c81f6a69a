"""PPOTrainer's iterations equal a plainly written PPO (tests/oracle/ppo_reference.py), DESIGN §5.10.

The product runs its real ``run_iteration`` (tests/oracle/ppo_harness.py stubs only the fetch and the
broadcast) on float64 policies over seeded random batches from an older policy: terminations,
truncations with a bootstrap (time limits and env crashes look alike in a fragment), steps both
terminated and truncated, episode starts inside chunks, stale versions. Every ``trainer/*`` metric of
each iteration must agree to RTOL of the quantity's scale: its own size or, where the product computes it
as a difference of larger float32 terms, the size of those terms (a KL from log-probs of size ~1, an
approx_kl from ratios of size 1): the estimate, GAE and the loss arithmetic are float32 in the product by
design, so float32 rounding of the terms is the floor of any agreement. Parameters after each iteration
(one optimiser step, then several) agree to PARAM_RTOL of the optimiser's step (see there).

The micro-batch order is reproduced by seeding torch's global generator before each product iteration
and the reference's own ``torch.Generator`` with the same seed (ppo_reference's module doc).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))  # the spawned DDP ranks import ppo_harness by name too
import ppo_harness as harness
from ppo_reference import PPOReference, Settings

RTOL = 1e-6
# Parameters: the product's loss and its gradients are float32 sums of terms of both signs (DESIGN §5.9's
# training numerics), so a gradient element carries float32 rounding (6e-8) of terms that may be much
# larger than their sum: measured up to 2.4e-6 of a step (the value head's bias, whose targets are centred).
PARAM_RTOL = 1e-5
# Timing and supervision counters: not numbers of the algorithm.
NOT_COMPARED = {"trainer/samples_per_s", "trainer/restarts", "trainer/rank_hangs"}
# Metrics derived from probability ratios, fractions and explained variance: their scale is 1.
UNIT_SCALE = {
    "trainer/approx_kl",
    "trainer/clipfrac",
    "trainer/ratio_deviation",
    "trainer/behaviour_weight_mean",
    "trainer/behaviour_weight_clipfrac",
    "trainer/behaviour_kl",
    "trainer/explained_variance",
    "trainer/vf_warmup",
    "trainer/value_only",
}

BASE = Settings(
    discount=0.9,
    gae_lambda=0.8,
    clip=0.15,
    behaviour_weight_clip=1.4,
    log_ratio_range=50.0,
    clip_vloss=False,
    policy_coef=1.3,
    vf_coef=0.7,
    entropy_coef=0.05,
    rho0=0.0,
    rho_decay=0.8,
    vf_warmup=0,
    value_head_only=False,
    normalize_full=True,
    normalize_minibatch=False,
    normalized_vf=True,
    learning_rate=3e-2,
    anneal_lr=False,
    num_iterations=5,
    weight_decay=0.1,
    adam_eps=1e-2,
    max_grad_norm=1e9,
    batch_size=2,
    accumulation=1,
    epochs=1,
    context_length=4,
)

CASES = {
    # feed-forward; two optimiser steps per iteration; normaliser preloaded at another scale; a clip
    # small enough that ratios leave it on both sides
    "mlp": ({"recurrent": False, "prior": (3.0, 2.0, 4)}, replace(BASE, clip=0.03), 4, 8),
    # recurrent; windows of 5, 5, 2; 3 micro-batches in groups of 2 (the last one partial); 2 epochs;
    # value clip; KL to the reference with a decaying rho; linear lr annealing; gradient clipping
    "gru": (
        {"recurrent": True, "prior": (-2.0, 0.5, 2)},
        replace(
            BASE,
            context_length=5,
            accumulation=2,
            epochs=2,
            clip_vloss=True,
            rho0=0.4,
            anneal_lr=True,
            max_grad_norm=0.3,
        ),
        5,
        12,
    ),
    # value-head-only warm-up in iteration 1 (KL at weight 1; one optimiser step), then PPO;
    # per-micro-batch advantages only; the normaliser starting empty
    "gru_warmup_head": (
        {"recurrent": True, "prior": None},
        replace(
            BASE,
            vf_warmup=1,
            value_head_only=True,
            rho0=0.2,
            normalize_full=False,
            normalize_minibatch=True,
            accumulation=2,
        ),
        4,
        6,
    ),
    # whole-model warm-up (value loss + KL at weight 1); raw returns as value targets; value clip; the value
    # head zeroed at start (zero_initial_vf); log-ratios clamped to +-0.5 (the behaviour weight's floor bites)
    "mlp_warmup_raw_values": (
        {"recurrent": False, "prior": (2.0, 1.0, 3), "zero_initial_vf": True},
        replace(
            BASE,
            vf_warmup=1,
            rho0=0.25,
            normalized_vf=False,
            clip_vloss=True,
            accumulation=3,
            epochs=2,
            log_ratio_range=0.5,
        ),
        6,
        5,
    ),
}


def _oracle(spec: dict, settings: Settings, seed: int) -> PPOReference:
    torch.manual_seed(seed)
    policy = harness.policy_generator(spec)()
    if spec.get("zero_initial_vf"):
        with torch.no_grad():  # every value-head parameter, the normaliser's statistics included
            for param in policy.value_head.parameters():
                param.zero_()
    reference = None
    if settings.rho0 > 0:
        torch.manual_seed(seed)  # the frozen initial policy
        reference = harness.policy_generator(spec)().requires_grad_(False)
    return PPOReference(policy=policy, reference=reference, settings=settings)


def _feeds(spec: dict, settings: Settings, *, seed: int, n: int, length: int, scales: list, version: int) -> list:
    torch.manual_seed(seed)
    policy = harness.policy_generator(spec)()
    return [
        harness.random_batch(
            policy, seed=seed * 100 + i, n=n, length=length, reward_scale=scale, reward_shift=shift, version=version
        )
        for i, (scale, shift) in enumerate(scales)
    ]


def _scale(key: str, expected: dict) -> float:
    size = abs(expected[key])
    if key in UNIT_SCALE:
        return max(size, 1.0)
    name = key.removeprefix("trainer/")
    return max(size, expected.get(f"trainer/scale/{name}", 0.0))


def assert_metrics_equal(product: dict, expected: dict, where: str) -> None:
    compared = {k for k in expected if not k.startswith("trainer/scale/")}
    assert set(product) - NOT_COMPARED == compared, (where, set(product) ^ compared)
    for key in sorted(compared):
        tolerance = RTOL * _scale(key, expected)
        assert abs(product[key] - expected[key]) <= tolerance, (where, key, product[key], expected[key], tolerance)


def assert_parameters_equal(product: dict, oracle: torch.nn.Module, initial: dict, where: str) -> None:
    """Each tensor's change over the run, to PARAM_RTOL of the largest change of any weight (the size of
    the optimiser's steps); a tensor the reference leaves unchanged must stay bit-identical. The value
    normaliser's statistics to RTOL of their own size (the running mean to that of the returns it
    averages, sqrt(running_mean_sq * debiasing_term), not of their mean, which may cancel)."""
    expected = oracle.state_dict()
    changes = {name: value - initial[name] for name, value in expected.items()}
    step = max(float(c.abs().max()) for name, c in changes.items() if "normalizer" not in name)
    for name, value in expected.items():
        if name.endswith("normalizer.running_mean"):
            prefix = name.removesuffix("running_mean")
            sq, weight = expected[prefix + "running_mean_sq"], expected[prefix + "debiasing_term"]
            tolerance = RTOL * float((sq.abs() * weight.abs()).sqrt().max())
        elif "normalizer" in name:
            tolerance = RTOL * float(value.abs().max())
        else:
            tolerance = PARAM_RTOL * step if bool(changes[name].any()) else 0.0
        error = float((product[name] - value).abs().max())
        assert error <= tolerance, (where, name, error, tolerance)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_one_rank_iterations_equal_the_reference(case: str, seed: int, tmp_path: Path) -> None:
    partial, settings, n, length = CASES[case]
    spec = {**partial, "normalized": settings.normalized_vf}
    version, iterations = 7, [1, 2]
    feeds = _feeds(spec, settings, seed=seed, n=n, length=length, scales=[(2.0, 0.5), (2.0, 0.5)], version=version)
    trainer = harness.build_trainer(spec=spec, settings=settings, run_dir=str(tmp_path), seed=seed)
    trainer.version = version
    results = harness.run_product(trainer, iterations=iterations, feeds=feeds, seeds=[seed + 10, seed + 20])
    oracle = _oracle(spec, settings, seed)
    initial = {k: v.clone() for k, v in oracle.policy.state_dict().items()}
    for (metrics, params), iteration, feed, perm_seed in zip(results, iterations, feeds, [seed + 10, seed + 20]):
        expected = oracle.iteration(
            iteration=iteration,
            version=version + sum(1 for j in range(1, iteration) if j > settings.vf_warmup),
            ranks=[harness.oracle_view(feed)],
            permutation_seeds=[perm_seed],
        )
        assert_metrics_equal(metrics, expected[0], f"{case} iteration {iteration}")
        assert_parameters_equal(params, oracle.policy, initial, f"{case} iteration {iteration}")


def test_two_gloo_ranks_with_different_data_equal_the_reference(tmp_path: Path) -> None:
    """DDP over gloo, each rank in its own process on its own batch: returns three orders of magnitude
    apart (so global advantage normalisation and the normaliser fed by every rank matter), advantages
    far from zero mean, a recurrent policy with its KL reference, accumulation with a partial group."""
    seed, version, iterations = 5, 3, [1, 2]
    settings = replace(BASE, context_length=3, accumulation=2, epochs=2, clip_vloss=True, rho0=0.3, max_grad_norm=0.5)
    spec = {"recurrent": True, "prior": (1.0, 2.0, 2), "normalized": True}
    scales = [(0.05, 0.02), (30.0, 12.0)]
    rank_feeds = [
        _feeds(spec, settings, seed=seed + 10 * r, n=3, length=7, scales=[scales[r]] * 2, version=version)
        for r in range(2)
    ]
    job = {
        "rendezvous": str(tmp_path / "rendezvous"),
        "spec": spec,
        "settings": settings,
        "run_dir": str(tmp_path),
        "seed": seed,
        "version": version,
        "iterations": iterations,
        "permutation_seeds": [40, 50],
        "feeds": rank_feeds,
    }
    mp.start_processes(harness.ddp_rank, args=(2, job), nprocs=2, join=True, start_method="spawn")
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    oracle = _oracle(spec, settings, seed)
    initial = {k: v.clone() for k, v in oracle.policy.state_dict().items()}
    for k, iteration in enumerate(iterations):
        expected = oracle.iteration(
            iteration=iteration,
            version=version + k,
            ranks=[harness.oracle_view(rank_feeds[r][k]) for r in range(2)],
            permutation_seeds=[[40, 50][k] + r for r in range(2)],
        )
        for r in range(2):
            metrics, params = results[r][k]
            assert_metrics_equal(metrics, expected[r], f"rank {r} iteration {iteration}")
            assert_parameters_equal(params, oracle.policy, initial, f"rank {r} iteration {iteration}")
