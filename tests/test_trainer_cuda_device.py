"""A bare ``cuda`` device reaches the trainer as one concrete GPU (``trainer/device.py``
``indexed_device``): ``torch.cuda.set_device`` refuses a device without an index. This machine has
no GPU, so torch.cuda's device calls are replaced by a fake that keeps what they were given."""

from __future__ import annotations

import pytest
import torch

from mineonline_core.trainer.device import indexed_device


class FakeCuda:
    """``torch.cuda`` as a process whose current device is GPU 3 sees it; ``set_device`` is as strict as torch's."""

    def __init__(self) -> None:
        self.set_to: list[torch.device] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)

    def set_device(self, device: torch.device) -> None:
        if device.index is None:  # what torch.cuda.set_device raises for a bare "cuda"
            raise ValueError("Expected a torch.device with a specified index or an integer, but got:cuda")
        self.set_to.append(device)


def test_indexed_device_names_the_current_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda().install(monkeypatch)
    assert indexed_device("cuda") == torch.device("cuda", 3)
    assert indexed_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert indexed_device("cpu") == torch.device("cpu")


def test_setup_rank_on_a_bare_cuda_device_sets_the_current_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from mineonline_ppo import PPOTrainer

    from mineonline_core.config import load_config
    from mineonline_core.testing.kit import cartpole, local_loop

    fake = FakeCuda()
    fake.install(monkeypatch)
    # Where the policy would move to: the fake GPU is the CPU (only the device bookkeeping is under test).
    moves: list[torch.device] = []
    real_to = torch.nn.Module.to

    def to(module: torch.nn.Module, *args, **kwargs):  # type: ignore[no-untyped-def]
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, torch.device) and target.type == "cuda":
            moves.append(target)
            return module
        return real_to(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    config = load_config(
        {"output_dir": str(tmp_path), "train_config": {"batch_size_per_gpu": 2, "context_length": 4}}
    ).config
    # The rank's numerics as on the CPU: the fake GPU cannot answer torch's bf16 and TF32 queries.
    monkeypatch.setattr(
        "mineonline_core.config.precision.PrecisionChoice.on",
        lambda self, device: self.decide(device_type="cpu", bf16_supported=True),
    )
    trainer = local_loop(PPOTrainer, config, run_dir=str(tmp_path), env=cartpole, device=torch.device("cuda"))
    assert fake.set_to == [torch.device("cuda", 3)]
    assert trainer.device == torch.device("cuda", 3)
    assert moves and all(d == torch.device("cuda", 3) for d in moves)
