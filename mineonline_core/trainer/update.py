"""The update loop every trainer shares; the algorithm supplies ``compute_loss`` (``trainer/algorithm.py``).

Per iteration and rank, ``train(batch)`` receives N chunks of L steps and, for each of
``epochs_per_iteration`` passes, walks them in micro-batches of ``batch_size_per_gpu`` chunks drawn
in a new random order every pass. Each chunk is one sequence from its stored ``state_in``, cut into
``context_length`` windows (truncated BPTT: one forward and backward per window bounds memory, the
recurrent state is carried into the next window and detached there). Gradients of
``gradient_accumulation`` micro-batches are summed before one optimiser step; DDP all-reduces only on
the last backward before a step (``no_sync`` elsewhere). Autocast and the fp16 ``GradScaler`` follow
``use_amp``, the global gradient norm is clipped to ``max_grad_norm``, and a step whose loss terms or
gradients are not finite is skipped on every rank (``update_is_finite``).

``compute_loss(batch=..., outputs=...)`` sees one window of one micro-batch (``contracts/batch.py`` declares
every key, dtype, shape and unit: ``TrainBatch``, ``ModelOutputs``): ``batch`` holds every
per-step column sliced to it (the estimate's ``logprob_prox`` among them; plus, in the value head's
normalised units, ``value_target`` and ``old_vpred``, the head's output at the start of the
update), ``outputs`` the policy's forward outputs for it (``pi_logits``, ``vpred`` (B, W)) and
``ref_logits``, the KL reference's logits when ``uses_reference()`` (those rollout stored with the chunks
when they are the current reference's, else the reference run here), else None. Its metrics are
averaged over windows (weighted by length) and micro-batches and logged as ``trainer/<name>``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mineonline_core.contracts import fragment as F
from mineonline_core.contracts.batch import ModelOutputs, Outputs
from mineonline_core.contracts.normalize import update_observation_statistics
from mineonline_core.contracts.tree import tree_index, tree_leaves, tree_map
from mineonline_core.errors import RunFailedError
from mineonline_core.trainer.sequence import detach_state, slice_time, squeeze_value, unwrap, windows

# Batch entries that are not per-step columns: never sliced into windows.
_NOT_STEPS = (F.STATE_IN, F.REF_STATE_IN, F.NEXT_OBS)


class UpdateLoop:
    """``TrainLoop``'s update loop around the algorithm's hooks (see the module doc)."""

    # The first model version whose rollout steps ran the current KL reference (``_stored_reference_logits``).
    reference_since: int = 0

    # -- the loop ---------------------------------------------------------------------------------

    def train(self, batch: dict[str, Any]) -> dict[str, float]:
        """One iteration's optimisation on this rank's batch; returns ``trainer/`` metrics."""
        train_config = self.train_config
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate
        batch = self.algorithm.prepare_batch(batch=self._with_value_targets(batch))
        n, per_batch, accum = (
            batch[F.REWARD].shape[0],
            train_config.batch_size_per_gpu,
            train_config.gradient_accumulation,
        )
        num_batches = math.ceil(n / per_batch)
        # Stats stay on the device (float64: the same sums as Python floats) and are read once at the
        # iteration's end: a float() per window or step would wait for the GPU each time.
        totals: dict[str, torch.Tensor] = {}
        group_terms: dict[str, torch.Tensor] = {}  # loss terms since the last optimiser step
        grad_norms: list[float] = []
        device = batch[F.REWARD].device
        for _ in range(train_config.epochs_per_iteration):
            order = torch.randperm(n, device=device)  # new minibatches every epoch
            for b in range(num_batches):
                rows = order[b * per_batch : (b + 1) * per_batch]
                group_start = (b // accum) * accum
                step_now = (b + 1) % accum == 0 or b == num_batches - 1
                stats = self._backward(batch, rows, sync=step_now, scale=1.0 / min(accum, num_batches - group_start))
                _accumulate(totals, stats)
                _accumulate(group_terms, stats)
                if step_now:
                    grad_norm = self._optimizer_step(group_terms)
                    grad_norms += [] if grad_norm is None else [grad_norm]
                    group_terms = {}
        count = train_config.epochs_per_iteration * num_batches
        metrics = {f"trainer/{k}": v / count for k, v in zip(totals, _read(totals.values()))}
        metrics["trainer/grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        returns, values = batch[F.RETURN], batch[F.VALUE]
        metrics["trainer/explained_variance"] = float(1 - (returns - values).var() / returns.var().clamp(min=1e-8))
        # normalize_observations: after the update, so the estimate and the update used the statistics the
        # behaviour policy of fresh data used; the broadcast that follows carries the new ones.
        metrics.update(update_observation_statistics(self.policy, batch, gather=self.all_gather))
        return metrics

    def _with_value_targets(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Add ``old_vpred``, the value head's output at the start of the update (PPO2's and
        CleanRL's centre of the clipped value loss), then update the value normaliser with the
        returns (``use_normalized_vf``) and add ``value_target``, the returns in the head's units.

        ``old_vpred`` is the estimate pass's own head output when the estimate recorded it, else its
        ``value`` normalised *before* the normaliser moves: re-normalising a stored value with the
        updated statistics would put the centre where the head never was."""
        head = getattr(self.policy, "value_head", None)
        normalize = head.normalize if hasattr(head, "normalize") else (lambda x: x)
        with torch.no_grad():
            old = batch.get(F.OLD_VPRED)
            batch[F.OLD_VPRED] = (old if old is not None else normalize(batch[F.VALUE])).float()
        if self.train_config.use_normalized_vf and hasattr(head, "update_normalizer"):
            returns = self.all_gather(batch[F.RETURN])
            # A NaN return would poison the running statistics for good; the loss is then
            # non-finite too, so the update guard skips this iteration's steps.
            if bool(torch.isfinite(returns).all()):
                head.update_normalizer(returns)
        with torch.no_grad():
            batch[F.VALUE_TARGET] = normalize(batch[F.RETURN]).float()
        return batch

    def _backward(
        self, batch: dict[str, Any], rows: torch.Tensor, *, sync: bool, scale: float
    ) -> dict[str, torch.Tensor]:
        """Forward/backward one micro-batch window by window; gradients accumulate in ``.grad``. Returns
        the windows' stats weighted by length, float64 tensors on the batch's device (nothing read)."""
        train_config = self.train_config
        n, length = batch[F.REWARD].shape[:2]
        steps = {k: tree_index(v, rows) for k, v in batch.items() if k not in _NOT_STEPS and _per_step(v, n, length)}
        steps = self.algorithm.prepare_minibatch(batch=steps)
        state = tree_index(batch[F.STATE_IN], rows)
        # The reference carries its own recurrent state, recorded by rollout at each fragment start.
        ref_state = tree_index(batch[F.REF_STATE_IN], rows) if batch.get(F.REF_STATE_IN) is not None else None
        use_reference = self.algorithm.uses_reference()
        stored_ref = use_reference and self._stored_reference_logits(batch, rows)
        if use_reference and not stored_ref and ref_state is None and state is not None:
            raise RunFailedError(
                "The KL reference policy is recurrent but these chunks carry no reference state (ref_state_in): "
                "they were collected without the reference (a replay store from a run with "
                "kl_divergence_coef_rho: 0). Start with a fresh replay store (database_config.path)."
            )
        spans = windows(length, train_config.context_length)
        totals: dict[str, torch.Tensor] = {}
        for i, window in enumerate(spans):
            # DDP all-reduces only on the very last backward before an optimiser step.
            last = sync and i == len(spans) - 1
            no_sync = self.model.no_sync() if hasattr(self.model, "no_sync") and not last else contextlib.nullcontext()
            part = {k: slice_time(v, window) for k, v in steps.items()}
            context = {"first": part[F.FIRST]}
            with no_sync:
                with self.algorithm.autocast():
                    latents, state_out = self.model(input=part[F.OBS], state_in=state, context=context)
                    outputs: ModelOutputs = {
                        **latents,
                        Outputs.PI_LOGITS: _float(latents[Outputs.PI_LOGITS]),
                        Outputs.VPRED: squeeze_value(latents[Outputs.VPRED]).float(),
                        Outputs.REF_LOGITS: None,
                    }
                    if stored_ref:
                        outputs[Outputs.REF_LOGITS] = _float(part[F.REF_LOGITS])
                    elif use_reference:
                        with torch.no_grad():
                            ref_latents, ref_state = self.reference(
                                input=part[F.OBS], state_in=ref_state, context=context
                            )
                        outputs[Outputs.REF_LOGITS] = _float(ref_latents[Outputs.PI_LOGITS])
                loss, stats = self.algorithm.compute_loss(batch=part, outputs=outputs)
                weight = (window.stop - window.start) / length
                self.scaler.scale(loss * weight * scale).backward()
            state = detach_state(state_out)
            _accumulate(totals, {k: _on(v, rows.device) * weight for k, v in stats.items()})
        return totals

    def _stored_reference_logits(self, batch: dict[str, Any], rows: torch.Tensor) -> bool:
        """Whether the KL term of these chunks takes the reference's logits rollout stored (``ref_logits``)
        instead of running the reference again. They are the current reference's only from the first
        version published after its last change: ``reference_changed`` sets ``reference_since`` to one past the
        version at the change (a reference loaded at a resume included), and a worker loads a reference before
        the weights it came with, so every step of that version or later ran it. Older chunks (collected before
        a ``ref_update_at_checkpoint`` refresh) and a batch without the column (a store written before it) run
        the reference as before. Only after a change does this read the versions (one host read a micro-batch)."""
        if batch.get(F.REF_LOGITS) is None:
            return False
        return self.reference_since <= 0 or bool((batch[F.VERSION][rows] >= self.reference_since).all())

    def _optimizer_step(self, loss_terms: dict[str, torch.Tensor]) -> float | None:
        """Clip and step; None when the step was skipped for non-finite loss terms or gradients."""
        self.scaler.unscale_(self.optimizer)
        self.algorithm.filter_gradients()
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.train_config.max_grad_norm)
        # The finite check needs numbers on the host: the norm and the loss terms come in one read.
        grad_norm, *terms = _read([norm, *loss_terms.values()])
        if not self.update_is_finite(grad_norm=grad_norm, loss_terms=dict(zip(loss_terms, terms))):
            if self.scaler.is_enabled():
                self.scaler.update()  # an fp16 overflow: the scaler lowers its scale, as its own skip would
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def update_is_finite(self, *, grad_norm: float, loss_terms: dict[str, float]) -> bool:
        """Call between ``clip_grad_norm_`` and ``optimizer.step``: False means skip this step (and
        zero the gradients). Every rank takes the same decision; ``max_skipped_updates`` skips in a
        row raise ``RunFailedError`` naming the loss terms and parameters that went non-finite."""
        finite = bool(np.isfinite(grad_norm)) and all(np.isfinite(float(v)) for v in loss_terms.values())
        if self.distributed():
            flag = torch.tensor([1.0 if finite else 0.0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # one rank's NaN loss skips the step everywhere
            finite = bool(flag.item() > 0)
        named = ((name, p.grad) for name, p in unwrap(self.model).named_parameters())
        return self.update_guard.check(
            finite=finite,
            loss_terms=loss_terms,
            named_grads=named,
            grad_norm=grad_norm,
            where=f"trainer rank {self.rank}, iteration {self.iteration}",
        )

    # -- cross-rank statistics --------------------------------------------------------------------

    def distributed(self) -> bool:
        """True on a rank of a multi-rank run (collectives reach the other ranks)."""
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def global_mean_std(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and (unbiased) standard deviation of ``x`` over every rank's values."""
        sums = torch.stack(
            [
                x.double().sum(),
                (x.double() ** 2).sum(),
                torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device),
            ]
        )
        if self.distributed():
            dist.all_reduce(sums)
        mean = sums[0] / sums[2]
        var = (sums[1] / sums[2] - mean**2).clamp(min=0) * sums[2] / (sums[2] - 1).clamp(min=1)
        return mean.float(), var.sqrt().float()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the first axis (``x`` itself on one rank)."""
        if not self.distributed():
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)


def _per_step(value: Any, n: int, length: int) -> bool:
    """A per-step column: every leaf a tensor of leading shape (N, L)."""
    leaves = tree_leaves(value) if value is not None else []
    return bool(leaves) and all(
        isinstance(x, torch.Tensor) and x.dim() >= 2 and tuple(x.shape[:2]) == (n, length) for x in leaves
    )


def _on(value: Any, device: torch.device) -> torch.Tensor:
    """A stat as a float64 tensor on ``device`` (a trainer may return Python numbers); no host sync."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device, torch.float64)
    return torch.full((), float(value), dtype=torch.float64, device=device)  # a fill, not a host copy


def _accumulate(totals: dict[str, torch.Tensor], stats: dict[str, torch.Tensor]) -> None:
    for k, v in stats.items():
        totals[k] = totals[k] + v if k in totals else v


def _read(values: Any) -> list[float]:
    """Scalar tensors as Python floats, in one device-to-host copy (one sync) instead of one each."""
    values = list(values)
    if not values:
        return []
    device = values[0].device
    return torch.stack([v.detach().to(device, torch.float64).reshape(()) for v in values]).tolist()


def _float(tree: Any) -> Any:
    return tree_map(lambda x: x.float(), tree)
