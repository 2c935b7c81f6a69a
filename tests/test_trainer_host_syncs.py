"""The update loop reads numbers from the device once per optimiser step (the finite check) and once
per iteration (the metrics), never once per window or per stat (``trainer/update.py``): on a GPU each
read waits for every kernel queued before it. Counted on the CPU by recording every Tensor-to-Python
read (``float``, ``bool``, ``item``, ``tolist``) during ``train``."""

from __future__ import annotations

import os
import traceback
import types

import pytest
import torch

from mineonline_core.testing.kit import cartpole, local_loop
from mineonline_core.trainer.device import fused_adamw


def _trainer(tmp_path, **train):  # type: ignore[no-untyped-def]
    from mineonline_core.config import load_config
    from mineonline_ppo import PPOTrainer

    config = load_config({"output_dir": str(tmp_path), "seed": 3, "train_config": train}).config
    trainer = local_loop(PPOTrainer, config, run_dir=str(tmp_path), env=cartpole)
    return trainer


def _estimated_batch(trainer, *, fragments: int) -> dict:  # type: ignore[no-untyped-def]
    """Four chunks of ``fragments`` fragments of 4 CartPole steps, estimated as an iteration would."""
    from mineonline_core.testing.kit import chunks_of, rollout_fragments
    from mineonline_core.trainer.batch import assemble_chunks

    streams = rollout_fragments(
        trainer.policy, lambda i: cartpole(), num_envs=4, fragment_length=4, fragments_per_env=fragments
    )
    trainer.iteration = 1
    return trainer.algorithm.estimate(batch=assemble_chunks(chunks_of(streams, fragments)))


def test_reads_per_iteration_do_not_grow_with_windows(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    for name in ("__float__", "__bool__", "item", "tolist"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **k):  # type: ignore[no-untyped-def]
            # torch's own optimiser reads its CPU step counters: no device involved, not counted.
            caller = traceback.extract_stack(limit=2)[0].filename
            if f"torch{os.sep}" not in caller:
                reads.append(f"{_name} at {caller}")
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)

    counts = {}
    for fragments in (2, 8):  # 2 and 8 windows of 4 steps, the same number of optimiser steps
        trainer = _trainer(
            tmp_path / str(fragments),
            batch_size_per_gpu=2,
            context_length=4,
            epochs_per_iteration=2,
            gradient_accumulation=1,
            batches_per_iteration=2,
        )
        batch = _estimated_batch(trainer, fragments=fragments)
        reads.clear()
        metrics = trainer.train(batch)
        counts[fragments] = len(reads)
        assert all(isinstance(v, float) for v in metrics.values())
    # 2 epochs x 2 micro-batches = 4 optimiser steps either way; four times the windows must not add reads.
    assert counts[8] == counts[2], counts
    # One read per optimiser step, and three per iteration: the normaliser's finite check, the metrics, the
    # explained variance.
    assert counts[2] == 4 + 3, reads


def test_fused_adamw_only_where_every_parameter_is_a_cuda_float() -> None:
    cuda = types.SimpleNamespace(is_cuda=True, is_floating_point=lambda: True)
    cpu = types.SimpleNamespace(is_cuda=False, is_floating_point=lambda: True)
    assert fused_adamw([cuda, cuda]) is True
    assert fused_adamw([cuda, cpu]) is None
    assert fused_adamw([]) is None
