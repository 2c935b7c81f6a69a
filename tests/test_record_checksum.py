"""A record read back is the record written (issue 36, item 4): every column of a fragment is covered by the
checksum written with it (``contracts.fragment.seal``, through ``fragment_meta``, which the rollout worker
calls before its store write), and the trainer's fetch (``trainer/fetch.py``) refuses a fragment whose column
differs from it, or lies outside its domain, naming the key and what differed, counting it in
``trainer/corrupt_fragments`` and never training on its chunk. Through the memory store (in its host actor)
and the LMDB store (opened in this process, as a trainer on the store's node opens it); each column is
garbled after the write, as a damaged store or transfer would."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from mineonline_lmdb import LMDBStore

from mineonline_core.config import load_config
from mineonline_core.contracts import fragment as F
from mineonline_core.contracts.fragment import fragment_meta
from mineonline_core.contracts.store import MemoryStore
from mineonline_core.contracts.tree import tree_leaves, tree_map
from mineonline_core.testing import kit as tk
from mineonline_core.trainer.base import BaseTrainer
from tests.conftest import cartpole_config

pytest_plugins = ["mineonline_core.testing.fixtures"]

COLUMNS = (F.VERSION, F.REWARD, F.ACTION, F.OBS, F.STATE_IN, F.REF_STATE_IN, F.NEXT_OBS, F.LOGPROB)


class RecordingTrainer(BaseTrainer):
    name = "recording_checksum"

    def setup_model_and_optimizer(self, policy):
        return policy, None

    def train(self, batch: dict) -> dict[str, float]:
        return {}


def fragment(stream: str, version: int = 0, seed: int = 0) -> dict:
    """A recurrent policy's fragment (so ``state_in`` is arrays) with a reference state of its own."""
    (frag,) = tk.rollout_fragments(
        tk.TinyGRUPolicy(), lambda i: tk.counting(i), num_envs=1, fragment_length=8, fragments_per_env=1, seed=seed
    )["0.0.0"]
    rng = np.random.default_rng(seed)
    frag[F.REF_STATE_IN] = [rng.standard_normal((1, 8)).astype(np.float32)]
    frag[F.VERSION][:] = version
    frag.update({F.STREAM: stream, F.INDEX: 0})
    return frag


def setup(ray, tmp_path, store_cls: type, *, version: int = 0):
    from mineonline_core.rollout.buffer import ReplayBuffer
    from mineonline_core.services.storehost import StoreClient, start_store_host

    path = str(tmp_path / "replay")
    host = start_store_host(store_cls=store_cls, path=path, num_shards=1, resume=False)
    store = StoreClient.connect(host, store_cls=store_cls, path=path, num_shards=1)
    assert store.is_local == (store_cls is LMDBStore)  # LMDB: this process reads the files itself
    buffer = (
        ray.remote(ReplayBuffer)
        .options(num_cpus=0)
        .remote(store_client=store, max_chunks=16, max_reuse=4, max_staleness=100)
    )

    def add(frag: dict) -> str:
        meta = fragment_meta(frag)  # what the rollout worker does before its write: seals the payload
        store.put(meta["key"], frag)
        ray.get(buffer.add_fragment.remote(meta))
        return meta["key"]

    config = load_config(
        cartpole_config(
            run_name="checksum",
            output_dir=str(tmp_path),
            policy_config={"hidden_sizes": [8]},
            rollout_config={"fragment_length": 8},
            train_config={"num_iterations": 3, "batch_size_per_gpu": 1, "context_length": 8, "prefetch_batches": 0},
        )
    ).config
    trainer = RecordingTrainer(
        rollout_manager=None, policy_generator=tk.mlp_policy, env_generator=tk.cartpole, config=config, run_dir=path
    )
    trainer.setup_rank(local=True)
    trainer._buffer, trainer._store = buffer, store
    trainer.iteration, trainer.version = 1, version
    return trainer, add, store


def garble(store, key: str, column: str) -> None:
    """XOR 4 bytes in the middle of the first leaf of ``column`` in the payload stored under ``key``."""
    (payload,) = store.get_many([key])
    payload[column] = tree_map(np.array, payload[column])  # a writable copy: Ray hands out read-only arrays
    leaf = tree_leaves(payload[column])[0]
    raw = leaf.reshape(-1).view(np.uint8)
    middle = max(raw.size // 2 - 2, 0)
    raw[middle : middle + 4] ^= 0x5A
    store.put(key, payload)  # written as is: not sealed again


def refused_one(trainer, key: str, good: dict, caplog) -> list[str]:
    with caplog.at_level(logging.WARNING, logger="mineonline_core.trainer.fetch"):
        batch = trainer.fetch_chunks(1)
    assert trainer.corrupt_fragments == 1 and trainer.perf["trainer/corrupt_fragments"] == 1.0
    assert np.array_equal(batch[F.LOGPROB].numpy()[0], good[F.LOGPROB])  # trained on the other chunk only
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused fragment")]
    assert len(lines) == 1 and key in lines[0], lines
    return lines


@pytest.mark.parametrize("store_cls", [MemoryStore, LMDBStore], ids=["memory", "lmdb"])
@pytest.mark.parametrize("column", COLUMNS)
def test_a_garbled_column_is_refused_named_and_counted(local_ray, tmp_path, caplog, store_cls, column) -> None:
    trainer, add, store = setup(local_ray, tmp_path, store_cls)
    bad_key = add(fragment("a", seed=1))
    good = fragment("b", seed=2)
    add(good)
    garble(store, bad_key, column)
    (line,) = refused_one(trainer, bad_key, good, caplog)
    assert f"column(s) {column} differ" in line, line
    trainer.fetch_chunks(1)  # the refused chunk is served again (max_reuse 4): not counted twice
    assert trainer.corrupt_fragments == 1


@pytest.mark.parametrize(
    ("what", "expected"),
    [
        ("version", "version 7 is above the trainer's 3 (a negative staleness"),
        ("reward", "reward holds 1 non-finite values"),
        ("logprob", "logprob holds 1 non-finite values"),
        ("vpred", "vpred holds 1 non-finite values"),
    ],
    ids=["version", "reward", "logprob", "vpred"],
)
def test_a_column_outside_its_domain_is_refused_though_its_checksum_matches(
    local_ray, tmp_path, caplog, what, expected
) -> None:
    trainer, add, _ = setup(local_ray, tmp_path, MemoryStore, version=3)
    frag = fragment("a", version=3, seed=1)
    if what == "version":
        frag[F.VERSION][:] = 7  # written by a model the trainer never had: staleness -4
    else:
        frag[what][2] = np.nan
    bad_key = add(frag)  # sealed as it is: only the domain check can refuse it
    good = fragment("b", version=3, seed=2)
    add(good)
    (line,) = refused_one(trainer, bad_key, good, caplog)
    assert expected in line and "differ" not in line, line


def test_a_record_of_an_older_store_is_checked_by_the_old_rule_and_its_domain(local_ray, tmp_path, caplog) -> None:
    """A store written before records carried checksums (a resume of an older run): its records are still
    read and trained on, their reward and log-prob still checked against the buffer's checksum, and a version
    garbled past the trainer's (the issue's ``staleness_mean`` of -1.1e16) refused by the domain check."""
    trainer, _, store = setup(local_ray, tmp_path, LMDBStore, version=3)
    legacy = {}
    for stream, seed in (("a", 1), ("b", 2), ("c", 3)):
        frag = fragment(stream, version=3, seed=seed)
        meta = {**fragment_meta(dict(frag)), "checksum": F.fragment_checksum(F.fragment_key(stream, 0), frag)}
        store.put(meta["key"], frag)  # no CHECKSUM column: written as an older version wrote
        local_ray.get(trainer._buffer.add_fragment.remote(meta))
        legacy[stream] = frag
    (payload,) = store.get_many([F.fragment_key("a", 0)])
    assert F.CHECKSUM not in payload
    payload[F.VERSION][:] = 11_000_000_000_000_003
    store.put(F.fragment_key("a", 0), payload)
    (line,) = refused_one(trainer, F.fragment_key("a", 0), legacy["b"], caplog)
    assert "above the trainer's 3" in line, line
    garble(store, F.fragment_key("c", 0), F.REWARD)
    caplog.clear()
    batch = trainer.fetch_chunks(1)
    assert trainer.corrupt_fragments == 2 and np.array_equal(batch[F.LOGPROB].numpy()[0], legacy["b"][F.LOGPROB])
    assert any("checksum differs from the one its writer reported" in r.getMessage() for r in caplog.records)
