"""``mlp_gru``: the recurrent policy for vector observations (SB3-contrib RecurrentPPO's role).

A memory task only a recurrent policy solves: the observation shows a cue at the first step only, and the
reward at the last step depends on acting on it. ``mlp`` cannot beat chance there, ``mlp_gru`` must solve it.
The reset test compares the policy with plainly written GRU equations stepped one step at a time.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

from mineonline_core.builtin.models import MLPPolicy, RecurrentMLPPolicy
from mineonline_core.registry import get_plugin_manager
from mineonline_core.testing.policy_conformance import PolicyConformance

DELAY = 3  # blank steps between the cue and the decision


class CueEnv(gym.Env):
    """Step 0 shows a cue (+1 or -1) in feature 0 and a start flag in feature 1; the next DELAY steps show
    zeros; the last step's action is rewarded 1 when it names the cue (action 1 for +1, 0 for -1)."""

    observation_space = gym.spaces.Dict({"obs": gym.spaces.Box(-1.0, 1.0, (2,), np.float32)})
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        super().reset(seed=seed)
        self.cue, self.t = int(self.np_random.integers(2)), 0
        return {"obs": np.array([2.0 * self.cue - 1.0, 1.0], np.float32)}, {}

    def step(self, action: Any) -> tuple[dict, float, bool, bool, dict]:
        self.t += 1
        done = self.t > DELAY
        reward = float(int(action) == self.cue) if done else 0.0
        return {"obs": np.zeros(2, np.float32)}, reward, done, False, {}


def _episodes(policy: torch.nn.Module, envs: list[CueEnv], *, greedy: bool) -> tuple[dict, torch.Tensor]:
    """One episode per env, stepped one step at a time with the recurrent state carried (as rollout
    does): observations and actions (B, T), and each episode's final reward (B,)."""
    obs = [env.reset()[0]["obs"] for env in envs]
    state = policy.initial_state(len(envs))
    steps, actions, rewards = [], [], np.zeros(len(envs), np.float32)
    with torch.no_grad():
        for t in range(DELAY + 1):
            x = torch.as_tensor(np.stack(obs))[:, None]
            first = torch.full((len(envs), 1), t == 0)
            latents, state = policy(input={"obs": x}, state_in=state, context={"first": first})
            action = policy.pi_head.sample(latents["pi_logits"], deterministic=greedy)[:, 0]
            steps.append(x[:, 0])
            actions.append(action)
            for i, env in enumerate(envs):
                o, r, *_ = env.step(int(action[i]))
                obs[i], rewards[i] = o["obs"], rewards[i] + r
    return {"obs": torch.stack(steps, 1), "action": torch.stack(actions, 1)}, torch.as_tensor(rewards)


def _train_and_score(policy: torch.nn.Module, *, iterations: int = 60, batch: int = 64) -> float:
    """REINFORCE with a mean baseline on whole episodes, the training forward over each (B, T) sequence
    in one call from the initial state; then the greedy success rate on 256 fresh episodes."""
    torch.manual_seed(0)
    envs = [CueEnv() for _ in range(batch)]
    for i, env in enumerate(envs):
        env.reset(seed=i)
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    first = torch.zeros(batch, DELAY + 1, dtype=torch.bool)
    first[:, 0] = True
    for _ in range(iterations):
        data, reward = _episodes(policy, envs, greedy=False)
        latents, _ = policy(input={"obs": data["obs"]}, state_in=policy.initial_state(batch), context={"first": first})
        logprob = policy.pi_head.logprob(data["action"], latents["pi_logits"]).sum(1)
        loss = -((reward - reward.mean()) * logprob).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    tests = [CueEnv() for _ in range(256)]
    for i, env in enumerate(tests):
        env.reset(seed=10_000 + i)
    return float(_episodes(policy, tests, greedy=True)[1].mean())


def _build(cls: type, **options: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls.build(
        cls.Config(**options), observation_space=CueEnv.observation_space, action_space=gym.spaces.Discrete(2)
    )


def test_mlp_gru_is_registered_by_name() -> None:
    assert get_plugin_manager().lookup("policy", "mlp_gru") is RecurrentMLPPolicy


@pytest.fixture
def one_thread() -> Any:
    # Tiny matrices: more threads only contend for the cores (minutes instead of seconds on a busy machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_only_the_recurrent_policy_solves_a_task_that_needs_memory(one_thread: None) -> None:
    recurrent = _train_and_score(_build(RecurrentMLPPolicy, hidden_sizes=[32], hidden_size=32))
    feed_forward = _train_and_score(_build(MLPPolicy, hidden_sizes=[32, 32]))
    assert recurrent >= 0.95, f"mlp_gru solved {recurrent:.0%} of the cue episodes"
    assert feed_forward <= 0.65, f"mlp solved {feed_forward:.0%}: the task does not need memory"


def _plain_gru_step(policy: RecurrentMLPPolicy, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The GRU equations (Cho et al. 2014, PyTorch's gate order r, z, n), written out."""
    g = policy.gru
    wi, wh = g.weight_ih.chunk(3), g.weight_hh.chunk(3)
    bi, bh = g.bias_ih.chunk(3), g.bias_hh.chunk(3)
    r = torch.sigmoid(x @ wi[0].T + bi[0] + h @ wh[0].T + bh[0])
    z = torch.sigmoid(x @ wi[1].T + bi[1] + h @ wh[1].T + bh[1])
    n = torch.tanh(x @ wi[2].T + bi[2] + r * (h @ wh[2].T + bh[2]))
    return (1 - z) * n + z * h


@pytest.mark.parametrize("seed", [0, 1])
def test_first_resets_the_memory_at_any_step_as_a_fresh_state(seed: int) -> None:
    torch.manual_seed(seed)
    policy = RecurrentMLPPolicy(obs_dim=3, num_actions=4, hidden_sizes=[8], hidden_size=6)
    b, t = 3, 9
    obs = torch.randn(b, t, 3, dtype=torch.float32)
    first = torch.zeros(b, t, dtype=torch.bool)
    first[0, 4] = first[1, 0] = first[1, 5] = first[1, 6] = first[2, 8] = True
    state_in = [torch.randn(b, 6, dtype=torch.float32)]  # a memory the resets must forget
    with torch.no_grad():
        latents, (h_out,) = policy(input={"obs": obs}, state_in=state_in, context={"first": first})
        fresh = policy.initial_state(b)[0]
        h, expected = state_in[0], []
        for step in range(t):
            h = torch.where(first[:, step, None], fresh, h)
            h = _plain_gru_step(policy, policy.embed(obs[:, step]), h)
            expected.append(h)
        expected_logits = policy.pi_head(torch.stack(expected, 1))
        # The suffix after a reset equals a run from the initial state over that suffix alone.
        suffix, _ = policy(
            input={"obs": obs[:1, 4:]}, state_in=policy.initial_state(1), context={"first": first[:1, 4:]}
        )
    torch.testing.assert_close(latents["pi_logits"], expected_logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h_out, expected[-1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(latents["pi_logits"][:1, 4:], suffix["pi_logits"], rtol=1e-5, atol=1e-6)


class TestRecurrentMLPBoxPolicy(PolicyConformance):
    """``mlp_gru`` takes the head of its action space as ``mlp`` does: a Gaussian for a Box."""

    observation_space = gym.spaces.Dict({"obs": gym.spaces.Box(-2.0, 2.0, (3,), np.float32)})
    action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def make_policy(self) -> RecurrentMLPPolicy:
        config = RecurrentMLPPolicy.Config(hidden_sizes=[16], hidden_size=12)
        return RecurrentMLPPolicy.build(
            config, observation_space=self.observation_space, action_space=self.action_space
        )
