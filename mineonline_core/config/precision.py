"""One precision policy for every process that runs the policy: rollout inference and training alike.

``train_config.use_amp``, ``amp_dtype`` and ``allow_tf32`` (a ``PrecisionChoice``) are decided once
per process against the device it computes on (``PrecisionChoice.on`` -> ``Precision``):

* **autocast dtype**: ``use_amp: false`` is float32. ``use_amp: true`` autocasts to ``amp_dtype``;
  ``auto`` means bfloat16, which CPUs and CUDA devices from Ampere (compute capability 8.0) on
  compute. float16 is used only when asked: its range ends at 65504, so idioms like a ``-1e9`` mask
  fill overflow in it, and a policy must declare ``supports_float16 = True`` (refused otherwise
  before Ray by ``driver/resolve.py`` and on each rank by ``Algorithm.check_policy``).
  bfloat16 asked of a CUDA device without it is a ``ConfigError`` (``float16``, or ``use_amp: false``).
* **GradScaler**: only float16 on CUDA needs one (bfloat16 has float32's exponent range; CPU autocast
  in float16 trains unscaled, as the scaler is a CUDA tool).
* **TF32**: ``torch.backends.cuda.matmul.allow_tf32`` and ``torch.backends.cudnn.allow_tf32`` are set
  explicitly to ``allow_tf32`` (default false) in every process, instead of PyTorch's defaults (TF32
  convolutions on): TF32 rounds the convolutions' inputs to 10 mantissa bits, and cuDNN picks other
  algorithms for a rollout batch of 8 frames than for a training window, so at fp32 with TF32 the
  training forward's log-probs differed from rollout's by 6.8e-3 on average (4.3e-2 at most) on
  version-0 data (VPT on a GPU), against 1.4e-5 with TF32 off: on-policy data no longer looked on-policy.
* **rollout numerics = training numerics**: rollout inference runs under the same autocast dtype as
  the training forwards (on its own device, without a scaler). The behaviour log-prob ``mu`` is then
  rounded as the training side's proximal/current log-probs are, so on version-0 data the ratio and
  the importance weight ``pi / mu`` carry only the batch-shape noise of one dtype, not the gap between
  two (tiny VPT on CPU, bf16 training: max |ratio - 1| 1.3e-4 with bf16 rollout, 2.8e-3 with fp32
  rollout; 0.25 with the full-size VPT on a GPU), and rollout gets the bfloat16 speed. The heads stay float32
  inside the policy (VPT does this), so log-probs are float32.

Nothing here reads a global default: ``Precision.apply_tf32`` writes both flags whatever they were.
The module imports torch only when a decision is applied: the rollout manager, which never imports
torch, builds the ``PrecisionChoice`` its workers receive.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import TYPE_CHECKING, Any

from mineonline_core.errors import ConfigError

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class Precision:
    """The numerics of the policy's forwards in one process, on one device type."""

    device_type: str
    dtype: str | None  # the autocast dtype, "bfloat16" or "float16"; None: float32, autocast off
    allow_tf32: bool

    @property
    def grad_scaler(self) -> bool:
        """Whether training needs a ``GradScaler``: float16 on CUDA only."""
        return self.dtype == "float16" and self.device_type == "cuda"

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context every policy forward of this process runs in."""
        import torch

        dtype = getattr(torch, self.dtype or "float32")
        return torch.autocast(self.device_type, dtype=dtype, enabled=self.dtype is not None)

    def make_scaler(self) -> "torch.amp.GradScaler":
        """Training's scaler: enabled only for ``grad_scaler`` (a disabled one passes gradients through)."""
        import torch

        return torch.amp.GradScaler("cuda", enabled=self.grad_scaler)

    def apply_tf32(self) -> None:
        """Set both TF32 switches of this process (they are process-wide, not per device)."""
        import torch

        torch.backends.cuda.matmul.allow_tf32 = self.allow_tf32
        torch.backends.cudnn.allow_tf32 = self.allow_tf32


@dataclasses.dataclass(frozen=True)
class PrecisionChoice:
    """What the config asks for, before any device is known (it travels to rollout workers)."""

    use_amp: bool = False
    amp_dtype: str = "auto"
    allow_tf32: bool = False

    @classmethod
    def from_config(cls, train_config: Any) -> "PrecisionChoice":
        """The choice a ``train_config`` makes (its ``use_amp``, ``amp_dtype`` and ``allow_tf32``)."""
        return cls(
            use_amp=bool(train_config.use_amp),
            amp_dtype=str(train_config.amp_dtype),
            allow_tf32=bool(train_config.allow_tf32),
        )

    def decide(self, *, device_type: str, bf16_supported: bool) -> Precision:
        """The pure decision (device type and its bfloat16 support passed in); raises ``ConfigError``."""
        problem = self.problem(device_type=device_type, bf16_supported=bf16_supported)
        if problem:
            raise ConfigError(problem)
        dtype = ("float16" if self.amp_dtype == "float16" else "bfloat16") if self.use_amp else None
        return Precision(device_type=device_type, dtype=dtype, allow_tf32=self.allow_tf32)

    def on(self, device: "torch.device | str") -> Precision:
        """The decision for ``device`` in this process (asks CUDA whether it supports bfloat16)."""
        device_type = str(device).split(":")[0]
        return self.decide(device_type=device_type, bf16_supported=bf16_supported(device_type))

    def problem(self, *, device_type: str, bf16_supported: bool, where: str = "") -> str | None:
        """The one-paragraph error for this choice on that device, or None."""
        if not self.use_amp or self.amp_dtype == "float16" or bf16_supported:
            return None
        return (
            f"train_config.amp_dtype is {self.amp_dtype!r} with use_amp: true, which autocasts to bfloat16, but the "
            f"{device_type} device{where} does not support bfloat16 (CUDA needs compute capability 8.0, Ampere, "
            f"or newer). Fix: set train_config.amp_dtype: float16 (trained with a gradient scaler; the policy must "
            f"support float16), or use_amp: false to compute in float32."
        )


def bf16_supported(device_type: str) -> bool:
    """Whether ``device_type`` computes bfloat16 (CPU autocast always does)."""
    return device_type != "cuda" or _cuda_bf16()


@functools.lru_cache(maxsize=1)
def _cuda_bf16() -> bool:
    import torch

    # including_emulation=False: a pre-Ampere GPU "supports" bf16 only by emulation, far slower than fp32.
    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False))


def float16_problem(choice: PrecisionChoice, policy: Any) -> str | None:
    """The error when float16 is asked of a policy that does not declare ``supports_float16``."""
    if not (choice.use_amp and choice.amp_dtype == "float16") or getattr(policy, "supports_float16", False):
        return None
    return (
        f"train_config.amp_dtype is 'float16' with use_amp: true, but {type(policy).__name__} does not declare "
        f"supports_float16 = True: float16 ends at 65504, so a policy that fills masks with -1e9 or sums large "
        f"activations overflows in it. Fix: set train_config.amp_dtype: auto (bfloat16), or make the policy "
        f"float16-safe and set supports_float16 = True on its class."
    )
