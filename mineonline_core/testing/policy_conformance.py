"""The policy conformance suite: what the rollout worker and the trainer rely on from any policy.

A policy plugin tests itself with a short subclass::

    class TestMyPolicy(PolicyConformance):
        observation_space = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (16, 16, 3), np.uint8)})
        action_space = gym.spaces.Discrete(5)

        def make_policy(self):
            return MyPolicy.build(MyPolicy.Config(), observation_space=self.observation_space,
                                  action_space=self.action_space)

The contract (what training needs to reproduce rollout): ``initial_state(B)`` batches on dim 0; ``forward(input, state_in,
{"first": (B, T)})`` returns ``({"pi_logits", "vpred"}, state_out)``; an episode start resets the
recurrent state at any t, so a chunk in one call equals the same steps one at a time (what training
recomputes is what rollout saw); the heads sample, score and compare actions; and the policy survives
what the framework does to it: pickling its generator, ``copy.deepcopy`` (the worker's standby copy)
and ``load_state_dict`` from read-only numpy arrays (weights from the object store).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
import torch

from mineonline_core.contracts.batch import Outputs
from mineonline_core.contracts.tree import tree_leaves, tree_map


class PolicyConformance:
    """Tests inherited by ``TestXxx`` subclasses; set the spaces and implement ``make_policy``."""

    observation_space: ClassVar[gym.spaces.Dict]
    action_space: ClassVar[gym.Space]
    batch: ClassVar[int] = 3
    steps: ClassVar[int] = 6
    atol: ClassVar[float] = 1e-4  # float32 kernels differ slightly between batch shapes

    def make_policy(self) -> torch.nn.Module:
        raise NotImplementedError

    # -- helpers ----------------------------------------------------------------------------------

    def _policy(self, seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)
        return self.make_policy().eval()

    def _inputs(self, batch: int, steps: int, seed: int = 0) -> dict[str, torch.Tensor]:
        self.observation_space.seed(seed)
        samples = [[self.observation_space.sample() for _ in range(steps)] for _ in range(batch)]
        return {
            k: torch.as_tensor(np.stack([np.stack([s[k] for s in row]) for row in samples]))
            for k in self.observation_space
        }

    def _first(self, batch: int, steps: int) -> torch.Tensor:
        first = torch.zeros(batch, steps, dtype=torch.bool)
        first[:, 0] = True
        first[0, steps // 2] = True  # an episode starts mid-chunk in one env
        return first

    @staticmethod
    def _close(a: Any, b: Any, atol: float, what: str) -> None:
        for x, y in zip(tree_leaves(a), tree_leaves(b)):
            assert x.shape == y.shape, f"{what}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
            assert torch.allclose(x, y, atol=atol, rtol=0), (
                f"{what}: max difference {float((x - y).abs().max()):.2e} > {atol}"
            )

    # -- the contract -------------------------------------------------------------------------------

    def test_initial_state_batches_on_dim_zero(self) -> None:
        policy = self._policy()
        for batch in (1, self.batch):
            for leaf in tree_leaves(policy.initial_state(batch)):
                assert leaf.shape[0] == batch, f"initial_state({batch}) leaf of shape {tuple(leaf.shape)}"

    @torch.no_grad()
    def test_forward_returns_logits_values_and_a_state_like_the_initial_one(self) -> None:
        policy, b, t = self._policy(), self.batch, self.steps
        latents, state = policy(self._inputs(b, t), policy.initial_state(b), {"first": self._first(b, t)})
        assert {Outputs.PI_LOGITS, Outputs.VPRED} <= set(latents), f"latents hold {sorted(latents)}"
        for leaf in tree_leaves(latents[Outputs.PI_LOGITS]):
            assert tuple(leaf.shape[:2]) == (b, t)
        assert latents[Outputs.VPRED].reshape(b, t, -1).shape[-1] == 1, (
            f"vpred of shape {tuple(latents['vpred'].shape)}"
        )
        initial = policy.initial_state(b)
        assert [tuple(x.shape) for x in tree_leaves(state)] == [tuple(x.shape) for x in tree_leaves(initial)]

    @torch.no_grad()
    def test_a_chunk_in_one_call_equals_the_same_steps_one_at_a_time(self) -> None:
        policy, b, t = self._policy(), self.batch, self.steps
        inputs, first = self._inputs(b, t, seed=1), self._first(b, t)
        chunk, _ = policy(inputs, policy.initial_state(b), {"first": first})
        state, logits, values = policy.initial_state(b), [], []
        for i in range(t):
            step, state = policy({k: v[:, i : i + 1] for k, v in inputs.items()}, state, {"first": first[:, i : i + 1]})
            logits.append(step[Outputs.PI_LOGITS])
            values.append(step[Outputs.VPRED])
        stepwise = tree_map(lambda *xs: torch.cat(xs, dim=1), *logits)
        self._close(chunk[Outputs.PI_LOGITS], stepwise, self.atol, "pi_logits, chunk vs stepwise")
        self._close(chunk[Outputs.VPRED], torch.cat(values, dim=1), self.atol, "vpred, chunk vs stepwise")

    @torch.no_grad()
    def test_an_episode_start_forgets_the_state_in(self) -> None:
        policy, b, t = self._policy(), self.batch, self.steps
        inputs = self._inputs(b, t, seed=2)
        first = torch.ones(b, 1, dtype=torch.bool)
        warm, state = policy(inputs, policy.initial_state(b), {"first": self._first(b, t)})
        fresh, _ = policy({k: v[:, :1] for k, v in inputs.items()}, policy.initial_state(b), {"first": first})
        carried, _ = policy({k: v[:, :1] for k, v in inputs.items()}, state, {"first": first})
        self._close(carried[Outputs.PI_LOGITS], fresh[Outputs.PI_LOGITS], self.atol, "pi_logits at first=True")
        self._close(carried[Outputs.VPRED], fresh[Outputs.VPRED], self.atol, "vpred at first=True")

    @torch.no_grad()
    def test_heads_sample_score_and_compare_actions(self) -> None:
        policy, b, t = self._policy(), self.batch, self.steps
        latents, _ = policy(self._inputs(b, t), policy.initial_state(b), {"first": self._first(b, t)})
        logits = latents[Outputs.PI_LOGITS]
        action = policy.pi_head.sample(logits)
        for leaf in tree_leaves(action):
            assert tuple(leaf.shape[:2]) == (b, t)
        logprob = policy.pi_head.logprob(action, logits)
        assert logprob.shape == (b, t) and bool(torch.isfinite(logprob).all())
        # A probability is at most 1 and a discrete entropy at least 0; a density and a differential entropy are
        # not bounded so (a Gaussian with std below 0.24 has both negative), so float actions skip the bounds.
        if not any(leaf.is_floating_point() for leaf in tree_leaves(action)):
            assert bool((logprob <= 1e-6).all()) and bool((policy.pi_head.entropy(logits) >= -1e-6).all())
        assert float(policy.pi_head.kl_divergence(logits, logits).abs().max()) < 1e-5
        values = torch.linspace(-3.0, 5.0, 7)
        assert torch.allclose(policy.value_head.denormalize(policy.value_head.normalize(values)), values, atol=1e-4)

    def test_survives_deepcopy_and_loads_read_only_numpy_weights(self) -> None:
        policy, other = self._policy(seed=0), self._policy(seed=1)
        standby = copy.deepcopy(policy)
        weights = {k: v.detach().cpu().numpy() for k, v in other.state_dict().items()}
        for array in weights.values():
            array.flags.writeable = False  # as ray.get returns them from the object store
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            standby.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})
        for key, value in other.state_dict().items():
            assert torch.equal(standby.state_dict()[key], value), key
        assert any(not torch.equal(policy.state_dict()[k], v) for k, v in other.state_dict().items())  # no aliasing

    def test_the_generator_pickles(self) -> None:
        import cloudpickle

        rebuilt = cloudpickle.loads(cloudpickle.dumps(self.make_policy))()
        assert set(rebuilt.state_dict()) == set(self.make_policy().state_dict())
