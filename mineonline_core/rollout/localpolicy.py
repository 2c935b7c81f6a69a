"""``LocalPolicy``: the rollout policy run in the rollout worker's own process (``rollout_config.inference:
local``), the counterpart of the shared ``InferenceServer`` (``inference.py``).

Weights are double-buffered: ``set_weights`` (another thread) copies them into a standby copy of the
policy while the stepping thread keeps running the current one, and ``swap`` (the stepping thread,
between batches) exchanges the two. A broadcast therefore stalls rollout for a reference swap, not for a
``load_state_dict`` of the whole model, at the price of one more copy of the parameters. The KL reference
(``set_reference``) is loaded the same way and swapped in with the weights. ``forward`` runs one batched
step of the policy and the reference with the training forwards' numerics (``config/precision.py``); the
``FragmentCollector`` owns the recurrent states it passes in and gets back.
"""

from __future__ import annotations

import copy
import threading
import warnings
from typing import Any

import torch

from mineonline_core.config.precision import PrecisionChoice
from mineonline_core.contracts.tree import to_numpy, tree_map
from mineonline_core.rollout.inference import policy_step


class LocalPolicy:
    """``set_weights`` and ``set_reference`` may be called from other threads; ``swap`` and ``forward``
    from the stepping thread only."""

    def __init__(self, *, policy: torch.nn.Module, device: torch.device, precision: PrecisionChoice) -> None:
        """``precision`` is already decided for ``device`` (``PrecisionChoice.on``)."""
        self.precision = precision
        self.policy = policy.to(device).eval()
        self._standby = copy.deepcopy(self.policy)  # loaded by set_weights, swapped in by swap
        self._standby_version: int | None = None  # set once the standby holds complete weights
        self.reference: torch.nn.Module | None = None
        self._pending_reference: torch.nn.Module | None = None  # loaded by set_reference, swapped in by swap
        self._lock = threading.Lock()  # the hand-over between a loader and the stepping thread
        self._load_lock = threading.Lock()  # one loader at a time

    def set_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load new weights into the standby policy (on the caller's thread, while stepping goes on);
        the next ``swap`` brings them in."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only numpy from the object store
            tensors = {k: torch.as_tensor(v) for k, v in state_dict.items()}
        with self._load_lock:
            with self._lock:
                # Not swappable while half-loaded. The stepping thread never touches the standby
                # between swaps, so loading into it needs no lock of the stepping thread's.
                standby, self._standby_version = self._standby, None
            standby.load_state_dict(tensors)
            with self._lock:
                self._standby_version = int(version)

    def set_reference(self, state_dict: dict[str, Any]) -> None:
        """Load the KL reference policy's weights (on the caller's thread); the next ``swap`` brings it in."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only numpy from the object store
            tensors = {k: torch.as_tensor(v) for k, v in state_dict.items()}
        with self._load_lock:
            reference = copy.deepcopy(self._standby).eval().requires_grad_(False)
            reference.load_state_dict(tensors)
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

    def forward(self, obs: Any, state: Any, first: torch.Tensor, n: int, ref_state: Any) -> tuple:
        """One batched step (call under ``torch.no_grad``) over ``obs`` (B, 1, ...); the first ``n`` rows
        choose actions and, with ``ref_state``, run the reference too. Returns numpy actions, log-probs and
        values, and the policy's and the reference's states after the step (tensors)."""
        with self.precision.autocast():
            action, logprob, vpred, state_out = policy_step(self.policy, obs, state, first)
            ref_out = None
            if ref_state is not None:
                _, ref_out = self.reference(
                    input=tree_map(lambda x: x[:n], obs), state_in=ref_state, context={"first": first[:n]}
                )
        return to_numpy(action), logprob.float().cpu().numpy(), vpred.float().cpu().numpy(), state_out, ref_out
