"""``contracts/batch.py`` against the real loop: what ``compute_loss`` receives is what the contract declares.

The batch is the trainer's own: fragments rolled out by the kit, chunked by ``assemble_chunks``, then
``run_iteration`` of the core's loop around ``PPOTrainer`` (staleness, estimate, value targets, advantage
normalisation, windows); only the fetch and the broadcast are stubbed, as in ``tests/oracle/ppo_harness.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from mineonline_ppo import PPOTrainer

from mineonline_core.config import OnlineConfig
from mineonline_core.contracts import batch as batch_contract
from mineonline_core.contracts import fragment as frag
from mineonline_core.contracts.batch import (
    COLUMN_DTYPES,
    OUTPUT_DTYPES,
    Columns,
    ModelOutputs,
    Outputs,
    TrainBatch,
)
from mineonline_core.contracts.tree import tree_leaves
from mineonline_core.testing.kit import cartpole, chunks_of, mlp_policy, rollout_fragments
from mineonline_core.trainer.batch import assemble_chunks
from mineonline_core.trainer.loop import TrainLoop

CHUNKS, PER_GPU, CONTEXT = 4, 2, 8


class _Recording(PPOTrainer):
    """PPOTrainer that keeps what each ``compute_loss`` call was given."""

    seen: list[tuple[dict[str, Any], dict[str, Any]]]

    def compute_loss(self, *, batch: TrainBatch, outputs: ModelOutputs) -> tuple[torch.Tensor, dict]:
        self.seen = [*getattr(self, "seen", []), (dict(batch), dict(outputs))]
        return super().compute_loss(batch=batch, outputs=outputs)


class _Loop(TrainLoop):
    """The core's loop, fed one batch of real chunks; its broadcast only bumps the version."""

    feed: dict[str, Any]

    def fetch_chunks(self, num_chunks: int, for_version: int | None = None, for_iteration: int | None = None) -> dict:
        return copy.deepcopy(self.feed)

    def broadcast_model_to_rollout_workers(self, new_version: bool) -> None:
        self.version += int(new_version)

    def save_checkpoint(self) -> None:
        return None


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Every (batch, outputs) ``compute_loss`` received in one iteration, with a KL reference stored by rollout."""
    torch.manual_seed(0)
    keys = {
        "context_length": CONTEXT,
        "batch_size_per_gpu": PER_GPU,
        "batches_per_iteration": 1,
        "epochs_per_iteration": 1,
        "kl_divergence_coef_rho": 0.1,
        "prefetch_batches": 0,
        "record_video_interval": 0,
        "save_interval": 10_000,
    }
    loop = _Loop(
        algorithm=_Recording,
        rollout_manager=None,
        policy_generator=mlp_policy,
        env_generator=None,
        config=OnlineConfig(seed=0, train_config=keys),
        run_dir=str(tmp_path_factory.mktemp("contract")),
    )
    loop.setup_rank(local=True)
    assert loop.reference is not None
    streams = rollout_fragments(
        loop.policy,
        lambda i: cartpole(12),
        num_envs=2,
        fragment_length=8,
        fragments_per_env=4,
        reference=loop.reference,
    )
    loop.feed = assemble_chunks(chunks_of(streams, 2))
    assert loop.feed[Columns.REWARD].shape[0] == CHUNKS
    loop.run_iteration(1)
    return loop.algorithm.seen


def test_the_declarations_agree() -> None:
    assert set(COLUMN_DTYPES) == TrainBatch.__required_keys__ | TrainBatch.__optional_keys__
    assert set(OUTPUT_DTYPES) == ModelOutputs.__required_keys__ | ModelOutputs.__optional_keys__
    names = {v for k, v in vars(Columns).items() if k.isupper()}
    assert set(COLUMN_DTYPES) <= names
    assert set(OUTPUT_DTYPES) == {v for k, v in vars(Outputs).items() if k.isupper()}
    # Each name is in the table a plugin author reads (the module docstring).
    assert all(f"\n``{key}`` " in batch_contract.__doc__ for key in (*COLUMN_DTYPES, *OUTPUT_DTYPES))
    # The fragment module's constants are the same names (third-party plugins use them).
    assert all(getattr(frag, k) == v for k, v in vars(Columns).items() if k.isupper() and k != "REWARD_RAW")


def _check(where: str, value: Any, dtype: torch.dtype | None, shape: tuple[int, int]) -> None:
    leaves = tree_leaves(value)
    assert leaves, f"{where} is empty"
    for leaf in leaves:
        assert isinstance(leaf, torch.Tensor), f"{where} holds a {type(leaf).__name__}"
        assert tuple(leaf.shape[:2]) == shape, f"{where} has shape {tuple(leaf.shape)}, not {shape} + (...)"
        assert dtype is None or leaf.dtype == dtype, f"{where} has dtype {leaf.dtype}, not {dtype}"


def test_compute_loss_gets_exactly_the_declared_batch_columns(seen: list) -> None:
    assert len(seen) == CHUNKS // PER_GPU * 2  # micro-batches x windows of the 16-step chunks
    for batch, _ in seen:
        # With a stored reference and PPO's default estimate, the optional columns but reward_raw are there.
        expected = set(COLUMN_DTYPES) - {Columns.REWARD_RAW}
        assert set(batch) == expected, (
            f"undeclared: {sorted(set(batch) - expected)}, missing: {sorted(expected - set(batch))}"
        )
        for key, value in batch.items():
            _check(f"batch[{key!r}]", value, COLUMN_DTYPES[key], (PER_GPU, CONTEXT))


def test_compute_loss_gets_the_declared_outputs(seen: list) -> None:
    for _, outputs in seen:
        assert set(OUTPUT_DTYPES) <= set(outputs), f"missing: {sorted(set(OUTPUT_DTYPES) - set(outputs))}"
        for key, dtype in OUTPUT_DTYPES.items():
            _check(f"outputs[{key!r}]", outputs[key], dtype, (PER_GPU, CONTEXT))
        assert outputs[Outputs.VPRED].dim() == 2, "vpred is (B, T), its trailing singleton axis dropped"
        assert outputs[Outputs.VPRED].requires_grad and not outputs[Outputs.REF_LOGITS].requires_grad
