"""``LocalPolicy``: the rollout policy run in the rollout worker's own process (``rollout_config.inference:
local``), the counterpart of the shared ``InferenceServer`` (``inference.py``).

Weights are double-buffered: ``set_weights`` (another thread) copies them into a standby copy of the
policy while the stepping thread keeps running the current one, and ``swap`` (the stepping thread,
between batches) exchanges the two. A broadcast therefore stalls rollout for a reference swap, not for a
``load_state_dict`` of the whole model, at the price of one more copy of the parameters. The KL reference
(``set_reference``) is loaded the same way and swapped in with the weights. ``step`` (the collector's
``Inference`` interface, ``stepping.py``) swaps, then runs one batched step of the policy and the reference with
the training forwards' numerics (``config/precision.py``) over the envs' recurrent states, which stay in
``StateSlots`` on the policy's device.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

from mineonline_core.config.precision import PrecisionChoice
from mineonline_core.rollout.stepping import StateSlots, StepReply, StepRequest, run_batch
from mineonline_core.services.weights import WeightReceiver


class LocalPolicy:
    """``set_weights`` and ``set_reference`` may be called from other threads; ``swap`` and ``step``
    from the stepping thread only."""

    def __init__(
        self,
        *,
        policy: torch.nn.Module,
        device: torch.device,
        precision: PrecisionChoice,
        num_envs: int = 1,
        version: int = 0,
    ) -> None:
        """``precision`` is already decided for ``device`` (``PrecisionChoice.on``); ``num_envs`` slots of
        recurrent state; ``version`` names the weights ``policy`` holds."""
        self.precision, self.device, self.version = precision, device, version
        self.policy = policy.to(device).eval()
        with torch.no_grad():
            self.slots = StateSlots(initial_state=self.policy.initial_state, num_envs=num_envs, device=device)
        self._standby = copy.deepcopy(self.policy)  # loaded by set_weights, swapped in by swap
        self._standby_version: int | None = None  # set once the standby holds complete weights
        self.reference: torch.nn.Module | None = None
        self._pending_reference: torch.nn.Module | None = None  # loaded by set_reference, swapped in by swap
        self._lock = threading.Lock()  # the hand-over between a loader and the stepping thread
        self._load_lock = threading.Lock()  # one loader at a time
        self._receiver = WeightReceiver(device=device)  # under _load_lock: its pinned buffers are reused

    def set_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load new weights into the standby policy (on the caller's thread, while stepping goes on);
        the next ``swap`` brings them in."""
        with self._load_lock:
            with self._lock:
                # Not swappable while half-loaded. The stepping thread never touches the standby
                # between swaps, so loading into it needs no lock of the stepping thread's.
                standby, self._standby_version = self._standby, None
            self._receiver.load(standby, state_dict, version=version, what="the rollout policy")
            with self._lock:
                self._standby_version = int(version)

    def set_reference(self, state_dict: dict[str, Any]) -> None:
        """Load the KL reference policy's weights (on the caller's thread); the next ``swap`` brings it in."""
        with self._load_lock:
            reference = copy.deepcopy(self._standby).eval().requires_grad_(False)
            self._receiver.load(reference, state_dict, what="the rollout's KL reference")
            with self._lock:
                self._pending_reference = reference

    def swap(self) -> tuple[torch.nn.Module | None, int | None]:
        """Between batches: bring in a loaded reference and the latest complete weights. Returns the new
        reference and the new weights' version (each None when nothing new came)."""
        with self._lock:
            reference, self._pending_reference = self._pending_reference, None
        if reference is not None:
            self.reference = reference
        with self._lock:
            version, self._standby_version = self._standby_version, None
            if version is None:
                return reference, None
            self.policy, self._standby = self._standby, self.policy
        return reference, version

    @torch.no_grad()
    def step(self, request: StepRequest) -> StepReply:
        """Bring in what ``set_weights``/``set_reference`` loaded, then run ``request`` (``stepping.run_batch``)."""
        _, version = self.swap()
        if version is not None:
            self.version = version
        (reply,) = run_batch(
            policy=self.policy,
            reference=self.reference,
            precision=self.precision,
            device=self.device,
            parts=[(self.slots, request)],
        )
        reply.version = self.version
        return reply
