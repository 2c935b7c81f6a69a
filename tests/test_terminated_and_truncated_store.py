"""A step both terminated and truncated, stored and read back (DESIGN §5.2).

Our rollout never writes one (the env pool keeps ``truncated`` only when not ``terminated``), but a
store filled by other code, an older run or a custom collector can. Through each replay store and
``assemble_chunks``, both flags and the bootstrap survive, and both estimates (the core's GAE and
V-trace) treat the step as the true terminal it is: nothing bootstrapped, the recursion stopped. The
same batch with the step marked truncated only must estimate differently, so the check can fail.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from mineonline_lmdb import LMDBStore
from mineonline_vtrace import VTraceTrainer

from mineonline_core.config import OnlineConfig
from mineonline_core.contracts import fragment as F
from mineonline_core.contracts.fragment import fragment_key
from mineonline_core.contracts.store import MemoryStore
from mineonline_core.testing.kit import TinyGRUPolicy, chunks_of, rollout_fragments, time_limited_counting
from mineonline_core.trainer import BaseTrainer, build_loop
from mineonline_core.trainer.batch import assemble_chunks

BOTH_AT = 3  # the step of the first fragment of each stream marked both terminated and truncated


class GAEOnly(BaseTrainer):
    name = "GAEOnly"

    def compute_loss(self, *, batch, outputs):
        return outputs["vpred"].sum() * 0, {}


def _gru() -> TinyGRUPolicy:
    return TinyGRUPolicy()


def _fragments() -> dict[str, list[dict]]:
    torch.manual_seed(0)
    streams = rollout_fragments(_gru(), lambda i: time_limited_counting(i, limit=6), num_envs=2, fragment_length=8)
    for frags in streams.values():
        first = frags[0]
        first[F.TERMINATED][BOTH_AT] = first[F.TRUNCATED][BOTH_AT] = True
        first[F.BOOTSTRAP][BOTH_AT] = 40.0  # were it used, every earlier advantage would move
        first[F.FIRST][BOTH_AT + 1] = True
    return streams


def _through(store, streams: dict[str, list[dict]]) -> dict[str, list[dict]]:
    keys = {s: [fragment_key(s, f[F.INDEX]) for f in frags] for s, frags in streams.items()}
    store.put_many((key, frag) for s, frags in streams.items() for key, frag in zip(keys[s], frags))
    return {s: store.get_many(keys[s]) for s in streams}


def _estimates(tmp_path, batch: dict) -> dict[str, torch.Tensor]:
    config = OnlineConfig(train_config={"context_length": 5, "discount": 0.9, "gae_lambda": 0.8})
    out = {}
    for cls in (GAEOnly, VTraceTrainer):
        trainer = build_loop(
            cls, rollout_manager=None, policy_generator=_gru, env_generator=None, config=config, run_dir=str(tmp_path)
        )
        trainer.setup_rank(local=True)
        out[cls.name] = trainer.algorithm.estimate(batch=dict(batch))[F.ADVANTAGE]
    return out


@pytest.mark.parametrize("backend", ["memory", "lmdb"])
def test_a_step_both_terminated_and_truncated_is_a_terminal_after_the_store(tmp_path, backend):
    streams = _fragments()
    store = MemoryStore(path="unused") if backend == "memory" else LMDBStore(path=str(tmp_path / "s"), num_shards=2)
    try:
        read = _through(store, streams)
    finally:
        store.close()
    batch = assemble_chunks(chunks_of(read, 2))
    both = batch[F.TERMINATED] & batch[F.TRUNCATED]
    rows = [0, 2]  # each stream's first chunk
    assert int(both.sum()) == 2 and bool(both[rows, BOTH_AT].all())
    assert torch.equal(batch[F.BOOTSTRAP][rows, BOTH_AT], torch.full((2,), 40.0))

    terminal_only = copy.deepcopy(batch)
    terminal_only[F.TRUNCATED][rows, BOTH_AT] = False
    terminal_only[F.BOOTSTRAP][rows, BOTH_AT] = 0.0
    truncated_only = copy.deepcopy(batch)
    truncated_only[F.TERMINATED][rows, BOTH_AT] = False
    got, terminal, truncation = (_estimates(tmp_path, b) for b in (batch, terminal_only, truncated_only))
    for name in got:
        torch.testing.assert_close(got[name], terminal[name], rtol=1e-6, atol=0, msg=name)
        assert (got[name] - truncation[name]).abs().max() > 1.0, name
    assert np.isfinite(batch[F.REWARD].numpy()).all()
