"""The product's side of the PPO oracle test: the kit's tiny policies in float64, seeded random batches, and
``TrainLoop.run_iteration`` around ``PPOTrainer`` driven without Ray (one rank in-process, or a gloo rank in a spawned process).

Only two things are stubbed: ``fetch_chunks`` hands out the test's batch, and the weight broadcast
bumps the version without sending anything. Everything else (estimate, staleness, value normaliser,
advantage normalisation, the update loop, schedules, metrics) is the product's own code.
"""

from __future__ import annotations

import copy
import os
from dataclasses import asdict
from typing import Any

import torch
from mineonline_ppo import PPOTrainer

from mineonline_core.config import OnlineConfig
from mineonline_core.contracts import fragment as F
from mineonline_core.testing.kit import TinyGRUPolicy, TinyMLPPolicy
from mineonline_core.trainer.loop import TrainLoop

OBS_DIM, ACTIONS = 3, 4


def make_policy(*, recurrent: bool, normalized: bool, prior: tuple[float, float, float] | None) -> torch.nn.Module:
    """A float64 policy; ``prior`` = (mean, std, updates) preloads the value normaliser's statistics
    as if it had seen ``updates`` batches, so that the iteration's update moves them part of the way."""
    policy = (
        TinyGRUPolicy(OBS_DIM, ACTIONS, hidden=6) if recurrent else TinyMLPPolicy(OBS_DIM, ACTIONS, hidden=8)
    ).double()
    head = policy.value_head
    head.use_normalizer = normalized
    if prior is not None:
        mean, std, updates = prior
        weight = 1 - head.normalizer.beta**updates
        with torch.no_grad():
            head.normalizer.running_mean.fill_(mean * weight)
            head.normalizer.running_mean_sq.fill_((mean**2 + std**2) * weight)
            head.normalizer.debiasing_term.fill_(weight)
    return policy


def policy_generator(spec: dict) -> Any:
    return lambda: make_policy(recurrent=spec["recurrent"], normalized=spec["normalized"], prior=spec["prior"])


@torch.no_grad()
def random_batch(
    policy: torch.nn.Module, *, seed: int, n: int, length: int, reward_scale: float, reward_shift: float, version: int
) -> dict[str, Any]:
    """N chunks of L steps acted by an *older* policy (the given one with its weights perturbed):
    episode ends inside chunks by termination, truncation (a time limit or an env crash, with a
    bootstrap value) and both at once, recurrent states mid-episode, versions 0-3 behind."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(n, length, OBS_DIM, generator=g)
    u = torch.rand(n, length, generator=g)
    terminated, truncated = u < 0.12, (u > 0.12) & (u < 0.22)
    both = torch.rand(n, length, generator=g) < 0.05
    terminated, truncated = terminated | both, truncated | both
    first = torch.zeros(n, length, dtype=torch.bool)
    first[:, 0] = torch.arange(n) % 3 == 0  # most chunks start mid-episode, from their stored states
    first[:, 1:] = (terminated | truncated)[:, :-1]
    older = copy.deepcopy(policy)
    for param in older.parameters():
        param.add_(0.4 * torch.randn(param.shape, generator=g, dtype=param.dtype))
    hidden = getattr(policy, "hidden", None)
    state_in = None if hidden is None else [0.5 * torch.randn(n, hidden, generator=g, dtype=torch.float64)]
    ref_state_in = None if hidden is None else [0.5 * torch.randn(n, hidden, generator=g, dtype=torch.float64)]
    actions, logprobs, state = [], [], state_in
    for t in range(length):
        latents, state = older(input={"obs": obs[:, t : t + 1]}, state_in=state, context={"first": first[:, t : t + 1]})
        logp = torch.log_softmax(latents["pi_logits"][:, 0].double(), -1)
        action = torch.multinomial(logp.exp(), 1, generator=g)[:, 0]
        actions.append(action)
        logprobs.append(logp.gather(1, action[:, None])[:, 0])
    reward = reward_shift + reward_scale * torch.randn(n, length, generator=g)
    bootstrap = torch.where(truncated, reward_shift * 5 + reward_scale * torch.randn(n, length, generator=g), 0.0)
    return {
        F.OBS: {"obs": obs},
        F.ACTION: torch.stack(actions, 1),
        F.REWARD: reward.float(),
        F.TERMINATED: terminated,
        F.TRUNCATED: truncated,
        F.FIRST: first,
        F.LOGPROB: torch.stack(logprobs, 1).float(),
        F.VPRED: torch.zeros(n, length),
        F.BOOTSTRAP: bootstrap.float(),
        F.EPISODE_ID: torch.cumsum(first.long(), 1),
        F.VERSION: version - torch.randint(0, 4, (n, length), generator=g),
        F.NEXT_OBS: {"obs": torch.randn(n, 1, OBS_DIM, generator=g)},
        F.STATE_IN: state_in,
        F.REF_STATE_IN: ref_state_in,
    }


def oracle_view(batch: dict[str, Any]) -> dict[str, Any]:
    """The same batch under the reference's plain names."""
    return {
        "obs": batch[F.OBS]["obs"],
        "next_obs": batch[F.NEXT_OBS]["obs"],
        **{k: batch[k] for k in ("action", "reward", "terminated", "truncated", "first", "logprob", "bootstrap")},
        "version": batch[F.VERSION],
        "state_in": batch[F.STATE_IN],
        "ref_state_in": batch[F.REF_STATE_IN],
    }


class OracleHarnessPPO(TrainLoop):
    """The core's loop around PPOTrainer, fed the test's batches; its broadcast only bumps the version."""

    feed: list[dict[str, Any]]

    def fetch_chunks(self, num_chunks: int, for_version: int | None = None, for_iteration: int | None = None) -> dict:
        return copy.deepcopy(self.feed.pop(0))

    def broadcast_model_to_rollout_workers(self, new_version: bool) -> None:
        self.version += int(new_version)

    def save_checkpoint(self) -> None:
        return None


def train_config(settings: Any) -> dict[str, Any]:
    s = asdict(settings)
    return {
        "discount": s["discount"],
        "gae_lambda": s["gae_lambda"],
        "ppo_clip": s["clip"],
        "behaviour_weight_clip": s["behaviour_weight_clip"],
        "log_ratio_range": s["log_ratio_range"],
        "clip_vloss": s["clip_vloss"],
        "ppo_policy_coef": s["policy_coef"],
        "ppo_vf_coef": s["vf_coef"],
        "entropy_bonus_coef": s["entropy_coef"],
        "kl_divergence_coef_rho": s["rho0"],
        "coef_rho_decay": s["rho_decay"],
        "vf_warmup": s["vf_warmup"],
        "vf_warmup_value_head_only": s["value_head_only"],
        "normalize_advantage_full_batch": s["normalize_full"],
        "normalize_advantage_per_minibatch": s["normalize_minibatch"],
        "use_normalized_vf": s["normalized_vf"],
        "learning_rate": s["learning_rate"],
        "anneal_lr_linearly": s["anneal_lr"],
        "num_iterations": s["num_iterations"],
        "weight_decay": s["weight_decay"],
        "adam_eps": s["adam_eps"],
        "max_grad_norm": s["max_grad_norm"],
        "batch_size_per_gpu": s["batch_size"],
        "batches_per_iteration": 1,
        "gradient_accumulation": s["accumulation"],
        "epochs_per_iteration": s["epochs"],
        "context_length": s["context_length"],
        "prefetch_batches": 0,
        "record_video_interval": 0,
        "save_interval": 10_000,
    }


def build_trainer(*, spec: dict, settings: Any, run_dir: str, seed: int) -> OracleHarnessPPO:
    keys = {**train_config(settings), "zero_initial_vf": bool(spec.get("zero_initial_vf", False))}
    config = OnlineConfig(seed=seed, train_config=keys)
    trainer = OracleHarnessPPO(
        algorithm=PPOTrainer,
        rollout_manager=None,
        policy_generator=policy_generator(spec),
        env_generator=None,
        config=config,
        run_dir=run_dir,
    )
    trainer.setup_rank(local=True)
    return trainer


def run_product(trainer: OracleHarnessPPO, *, iterations: list[int], feeds: list[dict], seeds: list[int]) -> list:
    """The product's ``run_iteration`` for each iteration; returns its metrics and parameters."""
    trainer.feed = list(feeds)
    out = []
    for iteration, seed in zip(iterations, seeds):
        torch.manual_seed(seed)  # the update's micro-batch order (see ppo_reference's module doc)
        metrics = trainer.run_iteration(iteration)
        params = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
        out.append(({k: float(v) for k, v in metrics.items() if k.startswith("trainer/")}, params))
    return out


def ddp_rank(rank: int, world: int, job: dict) -> None:
    """One gloo rank: the product's iterations on this rank's own batches, results saved to a file."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{job['rendezvous']}", rank=rank, world_size=world)
    try:
        trainer = build_trainer(spec=job["spec"], settings=job["settings"], run_dir=job["run_dir"], seed=job["seed"])
        trainer.rank, trainer.world_size = rank, world
        trainer.model = torch.nn.parallel.DistributedDataParallel(trainer.policy)
        trainer.version = job["version"]
        seeds = [seed + rank for seed in job["permutation_seeds"]]
        result = run_product(trainer, iterations=job["iterations"], feeds=job["feeds"][rank], seeds=seeds)
        torch.save(result, os.path.join(job["run_dir"], f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
