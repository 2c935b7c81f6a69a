"""The pre-Ray memory estimate covers the trainer's GPU (issue 33 row 9, ``driver/gpu_budget.py``):
weights, gradients, AdamW, the reference, the batch and one window's activations at the configured
precision. Checked on a fake 80 GB card (this machine has no GPU): the flagship in float32 fits (one
window: 8 x 64 frames), a micro-batch three times as large does not and is refused with its figures before
Ray starts, and MineStudio's cow settings (examples/minestudio_cow.py) fit in bfloat16."""

from __future__ import annotations

from pathlib import Path

import pytest

from mineonline_core.config import load_config
from mineonline_core.driver import gpu_budget
from mineonline_core.driver.resolve import resolve
from mineonline_core.errors import ConfigError
from mineonline_core.registry import get_plugin_manager

FLAGSHIP = Path(__file__).resolve().parents[1] / "examples" / "flagship_vpt2x.yaml"
CARD = (80 * 10**9, "fake 80 GB card")
# MineStudio's cow example's train_config and GPU placement, on the flagship's VPT-2x (the cow's
# foundation-model-2x architecture; its weights files are not needed for shapes).
COW = [
    "train_config.num_workers=2",
    "train_config.num_gpus_per_worker=1.0",
    "train_config.batch_size_per_gpu=1",
    "train_config.batches_per_iteration=200",
    "train_config.gradient_accumulation=10",
    "train_config.context_length=64",
    "train_config.prefetch_batches=2",
    "rollout_config.num_rollout_workers=2",
    "rollout_config.num_gpus_per_worker=1.0",
    "rollout_config.fragment_length=256",
    "rollout_config.worker_config.num_envs=12",
    "rollout_config.worker_config.batch_size=6",
    "train_config.use_amp=true",
]


@pytest.fixture
def fake_card(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_budget, "gpu_memory", lambda: CARD)


def _memory(*overrides: str):  # type: ignore[no-untyped-def]
    return resolve(load_config(str(FLAGSHIP), list(overrides)), get_plugin_manager()).memory


def _window(gpu) -> int:  # type: ignore[no-untyped-def]
    return next(v for k, v in gpu.parts.items() if k.startswith("one window's activations"))


def test_the_flagship_fits_an_80_gb_card_in_float32_and_a_larger_micro_batch_is_refused(fake_card) -> None:
    fp32 = _memory()
    assert fp32.gpu.activations_known
    assert fp32.gpu.parts["weights, gradients and AdamW's two moments"] == 4 * fp32.policy_bytes
    assert fp32.gpu.parts["KL reference"] == fp32.policy_bytes
    # One window of 8 chunks x 64 steps, whatever the estimate pass holds besides (nothing, row 3).
    assert _window(fp32.gpu) == 8 * 64 * fp32.gpu.frame_bytes
    assert 30 * 2**30 < fp32.gpu.total < CARD[0]
    fp32.gpu.check()
    bf16 = _memory("train_config.use_amp=true")
    assert 2 * _window(bf16.gpu) == pytest.approx(_window(fp32.gpu), rel=1e-6)
    # A lower bound of what the trainer allocated on an H200 (bench_gpu.py's trainer part, benchmarks/RESULTS.md):
    # its parts without the inference server, the broadcast snapshot and the context the part did not count.
    for estimate, peak_mib in ((fp32, 46950), (bf16, 35570)):
        parts = estimate.gpu.parts
        trainer = estimate.gpu.total - sum(
            v for k, v in parts.items() if k.startswith(("the shared", "broadcast", "CUDA"))
        )
        assert 0.5 * peak_mib * 2**20 < trainer <= peak_mib * 2**20

    larger = _memory("train_config.batch_size_per_gpu=24")
    with pytest.raises(ConfigError) as refused:
        larger.check(2**80, "the machine's memory")  # the host has room: the GPU is what does not fit
    message = str(refused.value)
    assert "fake 80 GB card" in message and "74.5 GiB" in message
    assert "one window's activations (24 x 64 steps, float32)" in message
    for key in ("batch_size_per_gpu", "context_length", "use_amp"):
        assert key in message


def test_minestudios_cow_settings_fit_an_80_gb_card_in_bfloat16(fake_card) -> None:
    cow = _memory(*COW)
    assert cow.gpu.activations_known
    assert not any("rollout workers" in k for k in cow.gpu.parts)  # each on a GPU of its own
    assert cow.gpu.total < CARD[0]
    cow.check(2**80, "the machine's memory")


def test_a_cpu_trainer_has_no_gpu_part() -> None:
    assert _memory("train_config.num_gpus_per_worker=0").gpu is None


def test_the_batches_the_prefetch_thread_puts_on_the_card_are_counted() -> None:
    # trainer/fetch.py assembles the next prefetch_batches iterations on the device while one trains.
    cfg = load_config(str(FLAGSHIP), ["train_config.prefetch_batches=2"]).config
    gpu = gpu_budget.estimate_gpu(
        cfg, None, policy_bytes=0, state_bytes=0, step_bytes=1000, observation_space=None, reference=False
    )
    assert gpu is not None
    one_batch = 4 * 8 * 128 * 1000  # 4 x 8 chunks of 128 steps
    assert gpu.parts["the iteration's batch and 2 prefetched"] == 3 * one_batch


def test_a_window_counts_each_saved_storage_once_and_not_the_weights() -> None:
    """Autograd saves the same tensor for several ops, views of it, and the weights: the card holds each
    storage once and the weights once for the whole batch (counted apart), so the window is the input, the
    hidden and squared outputs and the tanh's output. Counting every saved tensor gave VPT-2x 96 MiB a frame, above
    the about 80 its trainer allocated on an H200 (no lower bound); by storage 62.6 (13.7 of the rest: weights)."""
    import gymnasium
    import torch

    class Policy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

        def forward(self, *, input: torch.Tensor, state_in: None, context: dict) -> torch.Tensor:
            hidden = self.first(input)  # saves the input (not its weight: the input needs no gradient)
            squared = hidden * hidden  # saves the hidden output twice
            out = self.second(squared.view(-1, 16).view(squared.shape))  # saves a view of squared and its weight
            return torch.tanh(out).sum()  # saves its output

    space = gymnasium.spaces.Box(-1.0, 1.0, shape=(16,), dtype="float32")
    steps = 10
    frame = steps * 16 * 4  # float32 bytes of one (steps, 16) tensor
    assert gpu_budget.window_activation_bytes(Policy().to("meta"), space, steps) == 4 * frame
