"""VTraceTrainer's iteration equals a plainly written IMPALA iteration (tests/oracle/vtrace_reference.py).

The product runs its real ``run_iteration`` (estimate, value-normaliser update, the core's update loop,
the version bump) with two stubs only: ``fetch_chunks`` hands it a seeded random batch, and the weight
broadcast sends nothing. The batches hold terminations, truncations with a bootstrap, steps both
terminated and truncated, episode starts inside chunks, behaviour log-probs far from the current
policy (so both truncations bite), versions of several ages, and per-chunk reward scales from 0.3 to 30.
Every value is compared relative to the scale of the quantity compared.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from mineonline_vtrace import PG_DELTA, RHO, VTraceTrainer

from mineonline_core.config import OnlineConfig
from mineonline_core.contracts import fragment as F
from mineonline_core.contracts.policy import ValueHead
from mineonline_core.testing.kit import TinyGRUPolicy
from mineonline_core.trainer.loop import TrainLoop

sys.path.insert(0, str(Path(__file__).parent))  # the oracles beside this file, as test_ppo_oracle imports them
import vtrace_reference as ref

BETA = 0.9  # a fast normaliser, so that one iteration's targets move its statistics visibly
HIDDEN = 8
# Keys whose value is wall-clock or supervision bookkeeping, not arithmetic of the batch.
NOT_ARITHMETIC = {
    "trainer/samples_per_s",
    "trainer/restarts",
    "trainer/rank_hangs",
    "trainer/skipped_updates",
    "trainer/skipped_updates_total",
    "trainer/corrupt_fragments",
}


def policy_generator() -> TinyGRUPolicy:
    """A recurrent policy whose value head normalises, with statistics far from (0, 1)."""
    policy = TinyGRUPolicy(hidden=HIDDEN)
    policy.value_head = ValueHead(HIDDEN, normalize=True, beta=BETA)
    for returns in (torch.full((4,), 12.0), torch.tensor([3.0, -8.0, 20.0, 5.0])):
        policy.value_head.update_normalizer(returns)
    return policy


def random_batch(seed: int, *, n: int, length: int, version: int) -> dict:
    """A (n, length) batch as ``assemble_chunks`` builds it."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=g)
    scale = torch.tensor([0.3, 1.0, 3.0, 10.0, 30.0, 2.0] * n)[:n, None]
    terminated = rand(n, length) < 0.12
    truncated = rand(n, length) < 0.12
    terminated[0, 3] = truncated[0, 3] = True  # a step both terminated and truncated (a store or custom env)
    truncated[1, length - 1], terminated[1, length - 1] = True, False  # a truncation at the chunk's end
    terminated[2, length - 1], truncated[2, length - 1] = True, False  # a termination at the chunk's end
    done = terminated | truncated
    first = torch.zeros(n, length, dtype=torch.bool)
    first[:, 1:] = done[:, :-1]
    first[:, 0] = rand(n) < 0.5
    episode = torch.cumsum(first.long(), dim=1)
    # The probability the behaviour policy gave the action: pi/mu ranges from about 0.5 to 10.
    behaviour = 0.05 + 0.9 * rand(n, length)
    return {
        F.OBS: {"obs": torch.randn(n, length, 3, generator=g) * 2},
        F.ACTION: torch.randint(0, 2, (n, length), generator=g),
        F.REWARD: ((torch.randn(n, length, generator=g) + 0.7) * scale).float(),
        F.TERMINATED: terminated,
        F.TRUNCATED: truncated,
        F.FIRST: first,
        F.LOGPROB: behaviour.log().float(),
        F.VPRED: torch.randn(n, length, generator=g),
        F.BOOTSTRAP: torch.where(truncated, (torch.randn(n, length, generator=g) + 1) * scale, 0.0).float(),
        F.EPISODE_ID: episode,
        F.VERSION: version - torch.randint(0, 4, (n, length), generator=g),
        F.NEXT_OBS: {"obs": torch.randn(n, 1, 3, generator=g) * 2},
        F.STATE_IN: [torch.randn(n, HIDDEN, generator=g) * 0.5],
        F.REF_STATE_IN: None,
    }


SETTINGS = {
    # rho-bar and c-bar differ, several windows (5, 5, 2), accumulation over 2 of 3 micro-batches,
    # two epochs, a clipping grad norm, a linearly annealed learning rate.
    "several_steps": {
        "discount": 0.9,
        "rho_bar": 1.0,
        "c_bar": 0.7,
        "vf_coef": 0.5,
        "entropy_coef": 0.05,
        "learning_rate": 3e-3,
        "anneal_lr": True,
        "num_iterations": 10,
        "weight_decay": 0.04,
        "adam_eps": 1e-8,
        "max_grad_norm": 0.5,
        "epochs": 2,
        "batch_size": 2,
        "accumulation": 2,
        "context_length": 5,
        "normalizer_beta": BETA,
    },
    # rho-bar above 1 and c-bar below: the two truncations and the coefficients change the result
    # in opposite directions; no clipping, no accumulation.
    "wide_rho": {
        "discount": 0.97,
        "rho_bar": 2.5,
        "c_bar": 0.4,
        "vf_coef": 1.3,
        "entropy_coef": 0.2,
        "learning_rate": 1e-2,
        "anneal_lr": False,
        "num_iterations": 10,
        "weight_decay": 0.0,
        "adam_eps": 1e-6,
        "max_grad_norm": 50.0,
        "epochs": 1,
        "batch_size": 3,
        "accumulation": 1,
        "context_length": 4,
        "normalizer_beta": BETA,
    },
}
# Six chunks in one micro-batch, one epoch: exactly one optimiser step.
SETTINGS["one_step"] = {**SETTINGS["several_steps"], "batch_size": 6, "accumulation": 1, "epochs": 1}


def make_trainer(tmp_path: Path, s: dict) -> TrainLoop:
    n = 6
    train = {
        "num_iterations": s["num_iterations"],
        "batches_per_iteration": n // s["batch_size"],
        "batch_size_per_gpu": s["batch_size"],
        "gradient_accumulation": s["accumulation"],
        "epochs_per_iteration": s["epochs"],
        "context_length": s["context_length"],
        "learning_rate": s["learning_rate"],
        "anneal_lr_linearly": s["anneal_lr"],
        "weight_decay": s["weight_decay"],
        "adam_eps": s["adam_eps"],
        "max_grad_norm": s["max_grad_norm"],
        "discount": s["discount"],
        "rho_bar": s["rho_bar"],
        "c_bar": s["c_bar"],
        "vf_coef": s["vf_coef"],
        "entropy_bonus_coef": s["entropy_coef"],
        "prefetch_batches": 0,
        "record_video_interval": 0,
        "save_interval": 1000,
    }
    config = OnlineConfig(train_config=train, rollout_config={"fragment_length": 4})
    trainer = TrainLoop(
        algorithm=VTraceTrainer,
        rollout_manager=None,
        policy_generator=policy_generator,
        env_generator=None,
        config=config,
        run_dir=str(tmp_path),
    )
    trainer.setup_rank(local=True)
    trainer._publish_weights = lambda: None  # the version is bumped; nothing is sent
    trainer.version = 5
    return trainer


def close(actual, expected, *, what: str, rel: float = 1e-6) -> None:
    """|actual - expected| within ``rel`` of the compared quantity's largest magnitude."""
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    scale = max(float(expected.abs().max()), float(actual.abs().max()), 1e-12)
    error = float((actual - expected).abs().max())
    assert error <= rel * scale, f"{what}: off by {error:.3g} at scale {scale:.3g}"


def run_both(tmp_path: Path, name: str, iterations: int) -> tuple[TrainLoop, object, list, list]:
    s = SETTINGS[name]
    trainer = make_trainer(tmp_path, s)
    oracle = ref.VTraceOracle(policy=copy.deepcopy(trainer.policy), settings=ref.OracleSettings(**s))
    product_metrics, oracle_metrics = [], []
    for iteration in range(1, iterations + 1):
        batch = random_batch(100 + iteration, n=6, length=12, version=trainer.version)
        given = {k: v for k, v in batch.items()}
        trainer.fetch_chunks = lambda num, version=None, it=None, given=given: given
        version = trainer.version
        torch.manual_seed(iteration)
        metrics = trainer.run_iteration(iteration)
        product_metrics.append((metrics, given))
        torch.manual_seed(iteration)
        oracle_metrics.append((oracle.iteration(batch, iteration=iteration, version=version), dict(oracle.targets)))
    return trainer, oracle, product_metrics, oracle_metrics


def compare_parameters(trainer: TrainLoop, oracle) -> None:
    mine = dict(oracle.policy.named_parameters())
    for name, p in trainer.policy.named_parameters():
        if p.requires_grad:
            close(p.detach(), mine[name].detach(), what=f"parameter {name}")
    norm = trainer.policy.value_head.normalizer
    close(norm.running_mean, [oracle.normalizer.mean_acc], what="normaliser mean")
    close(norm.running_mean_sq, [oracle.normalizer.sq_acc], what="normaliser mean square")
    close(norm.debiasing_term, oracle.normalizer.debias, what="normaliser debiasing term")


def compare_iteration(metrics: dict, batch: dict, expected: dict, targets: dict) -> None:
    close(batch[F.VALUE], targets["value"], what="V(x_s)")
    close(batch[F.RETURN], targets["vs"], what="v_s")
    close(batch[RHO], targets["rho"], what="rho_s")
    close(batch[PG_DELTA], targets["bracket"], what="r_s + gamma v_{s+1} - V(x_s)")
    close(batch[F.ADVANTAGE], targets["advantage"], what="the policy-gradient advantage")
    arithmetic = {k for k in metrics if k.startswith("trainer/")} - NOT_ARITHMETIC
    assert arithmetic == set(expected), f"metrics without an oracle value: {arithmetic ^ set(expected)}"
    for key, value in expected.items():
        if key == "trainer/explained_variance":  # 1 - a ratio of variances: the ratio is the quantity
            close(1 - metrics[key], 1 - value, what="1 - explained variance")
        else:
            close(metrics[key], value, what=key)
    assert metrics["trainer/skipped_updates"] == 0


def test_one_optimiser_step_equals_the_oracle(tmp_path):
    """Six chunks in one micro-batch, one epoch: exactly one AdamW step."""
    trainer, oracle, product, expected = run_both(tmp_path, "one_step", iterations=1)
    assert oracle.steps == 1
    compare_iteration(*product[0], *expected[0])
    compare_parameters(trainer, oracle)


@pytest.mark.parametrize("name", ["several_steps", "wide_rho"])
def test_several_iterations_equal_the_oracle(tmp_path, name):
    """Three iterations, each of several optimiser steps: every V-trace column, every trainer/ metric
    and the parameters after each iteration's steps."""
    trainer, oracle, product, expected = run_both(tmp_path, name, iterations=3)
    assert oracle.steps >= 6
    for (metrics, batch), (oracle_metrics, targets) in zip(product, expected):
        compare_iteration(metrics, batch, oracle_metrics, targets)
    compare_parameters(trainer, oracle)


def test_the_batches_exercise_every_term(tmp_path):
    """The comparison would be vacuous if no ratio crossed rho-bar or c-bar, no step were both
    terminated and truncated, or the optimiser never clipped."""
    batch = random_batch(101, n=6, length=12, version=5)
    assert bool((batch[F.TERMINATED] & batch[F.TRUNCATED]).any())
    assert bool(batch[F.FIRST][:, 1:].any()) and bool(batch[F.TRUNCATED].any())
    _trainer, _oracle, product, expected = run_both(tmp_path, "several_steps", iterations=1)
    ratio = (expected[0][1]["rho"] < 1.0).double().mean()
    assert 0.1 < float(ratio) < 0.9  # rho-bar truncates some steps, not all
    assert product[0][0]["trainer/grad_norm"] > SETTINGS["several_steps"]["max_grad_norm"]  # clipping happened
    assert float(product[0][1][F.STALENESS].std()) > 0


def test_on_policy_data_is_truncated_nowhere(tmp_path):
    """Behaviour log-probs that are the current model's own (on-policy data, fp32 on both sides) give
    pi/mu exactly 1: at rho-bar 1 nothing is truncated, and the clip fraction users read says 0, not 1.
    Random stale data never lands exactly on rho-bar, so this case is the one that sees the boundary."""
    from mineonline_core.trainer.batch import current_policy_outputs

    s = SETTINGS["one_step"]
    assert s["rho_bar"] == 1.0
    trainer = make_trainer(tmp_path, s)
    batch = random_batch(7, n=6, length=12, version=trainer.version)
    batch[F.VERSION] = torch.full_like(batch[F.VERSION], trainer.version)
    batch[F.LOGPROB] = current_policy_outputs(trainer.policy, batch, context_length=s["context_length"])["logprob"]
    trainer.fetch_chunks = lambda num, version=None, it=None: {k: v for k, v in batch.items()}
    metrics = trainer.run_iteration(1)
    assert metrics["trainer/vtrace_rho_clipfrac"] == 0.0 and metrics["trainer/vtrace_rho_mean"] == 1.0
