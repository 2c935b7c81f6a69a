"""The policy built once per process: preflight's build is the in-process rank's, and the KL reference a copy.

Building a large policy costs seconds (VPT-2x loads and converts 230M parameters). The driver used to
build it for its checks (``preflight``), again for the rank it runs itself (``setup_rank``) and again
for the KL reference (``make_reference``). Now ``preflight`` builds it at the run's seed, exactly as
``setup_rank`` would, and keeps it with the RNG state its build left; a rank in the driver's process
takes that build, and the reference is a deep copy taken before ``init_policy`` or a checkpoint change
the policy: the generator's weights at the run's seed, as a fresh build gives. A Ray Train rank runs in
another process, receives the loop pickled without either (``_LIVE``), and builds its own.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class PolicyBuilding:
    """``TrainLoop``'s policy builds (see the module doc)."""

    _built: tuple[nn.Module, torch.Tensor] | None  # preflight's build and the RNG state after it
    _pristine: tuple[nn.Module, torch.Tensor] | None  # the copy make_reference takes

    def preflight_policy(self) -> nn.Module:
        """The policy as ``setup_rank`` builds it (at the run's seed), kept for an in-process rank."""
        torch.manual_seed(self.config.seed)
        policy = self.policy_generator()
        self._built = (policy, torch.random.get_rng_state())
        return policy

    def _initial_policy(self, local: bool) -> nn.Module:
        """The policy at the run's seed: preflight's build when this rank runs in the driver's process
        (a Ray Train rank in another process builds its own), and a copy of it kept for the KL reference."""
        built, self._built = (self._built if local else None), None
        if built is None:
            policy = self.policy_generator()
            rng = torch.random.get_rng_state()
        else:
            policy, rng = built
            torch.random.set_rng_state(rng)  # as if built here, right after the seed
        if self.algorithm.has_reference(self.options):
            # A copy costs a memcpy of the weights; a second build costs VPT-2x seconds.
            self._pristine = (copy.deepcopy(policy), rng)
        return policy

    def make_reference(self) -> nn.Module:
        """A frozen copy of the initial policy (``policy_generator()`` at the run's seed) on this
        rank's device, built once per rank when the algorithm ``has_reference``: the core runs it
        beside the policy in rollout and in the update loop (``ref_logits``)."""
        if self.reference is not None:  # a BaseTrainer subclass asks again in its setup_model_and_optimizer
            return self.reference
        torch.manual_seed(self.config.seed)  # same weights as the initial policy
        if self._pristine is not None:
            reference, rng = self._pristine
            self._pristine = None
            torch.random.set_rng_state(rng)  # where the build would have left the generator
        else:
            reference = self.policy_generator()
        return reference.to(self.device).eval().requires_grad_(False)
