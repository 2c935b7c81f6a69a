"""A single-process, synchronous PPO loop in plain PyTorch: the baseline mineonline must beat.

Same envs (subprocesses, gymnasium ``AsyncVectorEnv``), same network (mineonline's ``mlp`` /
``cnn_gru``) and the same hyperparameters as ``bench_e2e.py`` passes to ``mineonline run``
(``_benchlib.PPO_SETTINGS``). One iteration: every env steps ``fragment_length`` times; each env's
steps form one chunk (with the recurrent state before its first step); GAE (Schulman et al. 2016,
eq. 11-16), bootstrapping through truncations and stopping at true terminals; then
``epochs_per_iteration`` passes of clipped PPO (Schulman et al. 2017, eq. 7 and 9) over minibatches
of ``batch_size_per_gpu`` chunks. Collection and learning alternate: nothing overlaps.

Prints one JSON line: env steps/s, learner samples/s, time split, recent episode return.

    python benchmarks/plain_ppo.py --workload cartpole --iterations 50
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import _benchlib as bl  # noqa: E402


def gae(
    reward: np.ndarray,
    vpred: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
    bootstrap: np.ndarray,
    last_value: np.ndarray,
    *,
    gamma: float,
    lam: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Advantages and returns over (T, N). At a truncated step the next value is ``bootstrap`` (the
    value of the final observation) and the recursion restarts; at a terminal it is 0."""
    steps = reward.shape[0]
    adv = np.zeros_like(reward)
    running = np.zeros_like(last_value)
    next_value = last_value
    for t in reversed(range(steps)):
        ended = terminated[t] | truncated[t]
        target_next = np.where(truncated[t], bootstrap[t], np.where(terminated[t], 0.0, next_value))
        delta = reward[t] + gamma * target_next - vpred[t]
        running = delta + gamma * lam * np.where(ended, 0.0, running)
        adv[t] = running
        next_value = vpred[t]
    return adv, adv + vpred


class PlainPPO:
    def __init__(self, workload: str, *, num_envs: int | None = None, seed: int = 0, inline: bool = False) -> None:
        self.workload, self.s = workload, bl.ppo_settings(workload)
        self.num_envs = num_envs or self.s["num_envs"]
        torch.manual_seed(seed)
        self.envs = bl.make_vector_env(workload, self.num_envs, inline=inline)
        spaces = SimpleNamespace(
            observation_space=self.envs.single_observation_space, action_space=self.envs.single_action_space
        )
        self.policy = bl.build_policy(workload, spaces, use_normalized_vf=False)
        self.actor = bl.BatchedActor(self.policy, self.num_envs)
        self.opt = torch.optim.AdamW(
            self.policy.parameters(),
            lr=self.s["learning_rate"],
            eps=self.s["adam_eps"],
            weight_decay=self.s["weight_decay"],
        )
        self.obs, _ = self.envs.reset(seed=seed)
        self.ep_return = np.zeros(self.num_envs)
        self.returns: deque[float] = deque(maxlen=20)
        self.env_steps = self.samples = 0
        self.time = {"collect_s": 0.0, "gae_s": 0.0, "train_s": 0.0}

    def close(self) -> None:
        self.envs.close()

    # -- collection ---------------------------------------------------------------------------

    @torch.no_grad()
    def _value(self, obs: dict, state: object, first: torch.Tensor) -> np.ndarray:
        inputs = {k: torch.as_tensor(np.asarray(v))[:, None] for k, v in obs.items()}
        latents, _ = self.policy(inputs, state, {"first": first})
        return latents["vpred"].reshape(-1).numpy()

    def collect(self) -> dict:
        t_len, n = self.s["fragment_length"], self.num_envs
        state0 = None if self.actor.state is None else [s.clone() for s in self.actor.state]
        cols = {
            k: []
            for k in ("obs", "first", "action", "logprob", "vpred", "reward", "terminated", "truncated", "bootstrap")
        }
        for _ in range(t_len):
            cols["obs"].append(self.obs)
            cols["first"].append(self.actor.first[:, 0].numpy().copy())
            action, logprob, vpred = self.actor.act(self.obs)
            self.obs, reward, terminated, truncated, info = self.envs.step(action)
            truncated = truncated & ~terminated
            bootstrap = np.zeros(n, np.float32)
            if truncated.any():  # value of the final observation under the state the env had reached
                rows = np.flatnonzero(truncated)
                final = {k: np.stack([info["final_obs"][i][k] for i in rows]) for k in self.obs}
                state = None if self.actor.state is None else [s[rows] for s in self.actor.state]
                bootstrap[rows] = self._value(final, state, torch.zeros(len(rows), 1, dtype=torch.bool))
            self.actor.episode_ends(terminated | truncated)
            self.ep_return += reward
            for i in np.flatnonzero(terminated | truncated):
                self.returns.append(float(self.ep_return[i]))
                self.ep_return[i] = 0.0
            for key, value in (
                ("action", action),
                ("logprob", logprob),
                ("vpred", vpred),
                ("reward", reward),
                ("terminated", terminated),
                ("truncated", truncated),
                ("bootstrap", bootstrap),
            ):
                cols[key].append(value)
        last_value = self._value(self.obs, self.actor.state, self.actor.first)
        self.env_steps += t_len * n
        batch = {k: np.stack(v) for k, v in cols.items() if k != "obs"}
        batch["obs"] = {k: np.stack([o[k] for o in cols["obs"]]) for k in cols["obs"][0]}
        return {"batch": batch, "state0": state0, "last_value": last_value}

    # -- learning -----------------------------------------------------------------------------

    def learn(self, rollout: dict) -> dict:
        s, b = self.s, rollout["batch"]
        t0 = time.perf_counter()
        adv, ret = gae(
            b["reward"].astype(np.float32),
            b["vpred"],
            b["terminated"],
            b["truncated"],
            b["bootstrap"],
            rollout["last_value"],
            gamma=s["discount"],
            lam=s["gae_lambda"],
        )
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)  # normalize_advantage_full_batch
        t1 = time.perf_counter()
        self.time["gae_s"] += t1 - t0
        # (T, N, ...) -> chunks (N, T, ...): one chunk per env, trained as one sequence.
        seq = lambda x: torch.as_tensor(np.ascontiguousarray(np.swapaxes(x, 0, 1)))  # noqa: E731
        obs = {k: seq(v) for k, v in b["obs"].items()}
        first, action, logprob = seq(b["first"]), seq(b["action"]), seq(b["logprob"])
        adv_t, ret_t = seq(adv.astype(np.float32)), seq(ret.astype(np.float32))
        self.policy.train()
        stats = []
        bs = s["batch_size_per_gpu"]
        for _ in range(s["epochs_per_iteration"]):
            for idx in torch.randperm(self.num_envs).split(bs):
                state = None if rollout["state0"] is None else [x[idx] for x in rollout["state0"]]
                latents, _ = self.policy({k: v[idx] for k, v in obs.items()}, state, {"first": first[idx]})
                logits, value = latents["pi_logits"], latents["vpred"].reshape(len(idx), -1)
                new_logprob = self.policy.pi_head.logprob(action[idx], logits)
                ratio = (new_logprob - logprob[idx]).clamp(-50, 50).exp()
                a = adv_t[idx]
                policy_loss = -torch.min(ratio * a, ratio.clamp(1 - s["ppo_clip"], 1 + s["ppo_clip"]) * a).mean()
                value_loss = 0.5 * (value - ret_t[idx]).pow(2).mean()
                entropy = self.policy.pi_head.entropy(logits).mean()
                loss = policy_loss + s["ppo_vf_coef"] * value_loss - s["entropy_bonus_coef"] * entropy
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.policy.parameters(), s["max_grad_norm"])
                self.opt.step()
                stats.append((policy_loss.item(), value_loss.item(), entropy.item()))
        self.policy.eval()
        self.samples += s["epochs_per_iteration"] * first.numel()
        self.time["train_s"] += time.perf_counter() - t1
        return dict(zip(("policy_loss", "value_loss", "entropy"), np.mean(stats, 0).tolist()))

    def iterate(self) -> dict:
        t0 = time.perf_counter()
        rollout = self.collect()
        self.time["collect_s"] += time.perf_counter() - t0
        return self.learn(rollout)


def run(workload: str, *, iterations: int, seed: int = 0, num_envs: int | None = None, inline: bool = False) -> dict:
    ppo = PlainPPO(workload, num_envs=num_envs, seed=seed, inline=inline)
    try:
        ppo.iterate()  # warm-up iteration: process start, first allocations; excluded from the rates
        steps0, samples0, time0 = ppo.env_steps, ppo.samples, dict(ppo.time)
        start = time.perf_counter()
        last = {}
        for _ in range(iterations):
            last = ppo.iterate()
        wall = time.perf_counter() - start
    finally:
        ppo.close()
    return {
        "env_steps_per_s": (ppo.env_steps - steps0) / wall,
        "samples_per_s": (ppo.samples - samples0) / wall,
        "env_steps": ppo.env_steps,
        "iterations": iterations,
        "wall_s": wall,
        "time_split": {k: (ppo.time[k] - time0[k]) / wall for k in ppo.time},
        "return_mean_20": float(np.mean(ppo.returns)) if ppo.returns else None,
        "last_losses": last,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=bl.WORKLOADS, default="cartpole")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--num-envs", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default); 1 like a Ray actor")
    parser.add_argument("--quick", action="store_true", help="CartPole, 2 iterations")
    args = parser.parse_args()
    if args.quick:
        args.workload, args.iterations = "cartpole", 2
    if args.threads:
        torch.set_num_threads(args.threads)
    figures = run(args.workload, iterations=args.iterations, seed=args.seed, num_envs=args.num_envs)
    bl.emit(
        "plain_ppo",
        figures,
        workload=args.workload,
        num_envs=args.num_envs or bl.ppo_settings(args.workload)["num_envs"],
        settings=bl.ppo_settings(args.workload),
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
