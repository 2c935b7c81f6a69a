"""The trainer fetches the next iteration's chunks while the current one trains, and the buffer
holds that early fetch to ``max_staleness`` at the version the chunks will be trained at."""

from __future__ import annotations


import numpy as np
import pytest

from mineonline_core.contracts import fragment as F
from mineonline_core.config import load_config
from mineonline_core.contracts.store import MemoryStore
from mineonline_core.testing import kit as tk
from mineonline_core.trainer.base import BaseTrainer
from mineonline_core.contracts.fragment import fragment_meta
from tests.conftest import cartpole_config

pytest_plugins = ["mineonline_core.testing.fixtures"]


class RecordingTrainer(BaseTrainer):
    name = "recording"

    def setup_model_and_optimizer(self, policy):
        return policy, None

    def train(self, batch: dict) -> dict[str, float]:
        return {}


def fragment(stream: str, index: int, version: int) -> dict:
    (frag,) = tk.rollout_fragments(
        tk.mlp_policy(),
        lambda i: tk.cartpole(50),
        num_envs=1,
        fragment_length=8,
        fragments_per_env=1,
        version=version,
        seed=index,
    )["0.0.0"]
    frag.update({F.STREAM: stream, F.INDEX: index})
    return frag


def setup(ray, tmp_path, *, max_staleness: int = 0, max_reuse: int = 1, **train):
    """A trainer reading from a real ``ReplayBuffer`` actor and store; returns it, ``add`` and the store."""
    from mineonline_core.rollout.buffer import ReplayBuffer
    from mineonline_core.services.storehost import StoreClient, start_store_host

    host = start_store_host(store_cls=MemoryStore, path="unused", num_shards=1, resume=False)
    store = StoreClient.connect(host, store_cls=MemoryStore, path="unused", num_shards=1)
    buffer = (
        ray.remote(ReplayBuffer)
        .options(num_cpus=0)
        .remote(store_client=store, max_chunks=16, max_reuse=max_reuse, max_staleness=max_staleness)
    )

    def add(stream: str, index: int, version: int) -> None:
        frag = fragment(stream, index, version)
        meta = fragment_meta(frag)
        store.put(meta["key"], frag)
        ray.get(buffer.add_fragment.remote(meta))

    config = load_config(
        cartpole_config(
            run_name="prefetch",
            output_dir=str(tmp_path),
            policy_config={"hidden_sizes": [32, 32]},
            rollout_config={"fragment_length": 8},
            train_config={
                "num_iterations": 3,
                "batch_size_per_gpu": 1,
                "batches_per_iteration": 1,
                "context_length": 8,
                "gradient_accumulation": 1,
                **train,
            },
        )
    ).config
    trainer = RecordingTrainer(
        rollout_manager=None,
        policy_generator=tk.mlp_policy,
        env_generator=tk.cartpole,
        config=config,
        run_dir=str(tmp_path / "run"),
    )
    trainer.setup_rank(local=True)
    trainer._buffer, trainer._store = buffer, store
    return trainer, add, store


def test_next_chunks_are_fetched_during_training_and_never_staler_than_allowed(local_ray, tmp_path) -> None:
    ray = local_ray
    trainer, add, _ = setup(ray, tmp_path)
    buffer = trainer._buffer

    add("a", 0, version=0)
    trainer.iteration = 1
    first = trainer.fetch_fragments_and_estimate_advantages(1)
    assert first["version"].unique().tolist() == [0]
    (ahead,) = trainer._prefetch  # asked for while iteration 1 trains, for version 1
    assert ahead[:2] == (2, 1)
    add("b", 0, version=0)  # fresh now, but one version too old for iteration 2: never served to it
    add("c", 0, version=1)
    trainer.version, trainer.iteration = 1, 2  # iteration 1 published version 1
    second = trainer.fetch_fragments_and_estimate_advantages(1)
    assert ahead[2].done()
    assert second["version"].unique().tolist() == [1]
    assert second[F.STALENESS].max().item() == 0
    trainer.version, trainer.iteration = 2, 3
    ray.get(buffer.set_version.remote(2))
    add("d", 0, version=2)
    third = trainer.fetch_fragments_and_estimate_advantages(1)
    assert third["version"].unique().tolist() == [2]
    assert not trainer._prefetch  # the last iteration fetches nothing ahead
    stats = ray.get(buffer.stats.remote())
    assert stats["replay/chunks_served"] == 3 and np.isclose(stats["replay/version"], 2)


def test_prefetch_batches_is_the_fetch_ahead_depth(local_ray, tmp_path) -> None:
    trainer, add, _ = setup(local_ray, tmp_path, prefetch_batches=2, num_iterations=4, max_staleness=2)
    add("a", 0, version=0)
    trainer.iteration = 1
    trainer.fetch_fragments_and_estimate_advantages(1)
    # Iterations 2 and 3, judged at the versions iterations 1 and 2 will have published.
    assert [entry[:2] for entry in trainer._prefetch] == [(2, 1), (3, 1)]
    add("b", 0, version=0)
    add("c", 0, version=1)
    assert trainer._prefetch[0][2].result(timeout=60)["version"].unique().tolist() == [0]
    assert trainer._prefetch[1][2].result(timeout=60)["version"].unique().tolist() == [1]


def test_each_fetch_names_the_iteration_it_is_for_so_ranks_of_one_iteration_get_disjoint_chunks(
    local_ray, tmp_path
) -> None:
    """Two ranks on one buffer (max_reuse 2, 4 chunks, 2 per iteration). Rank A fetches iteration 1
    and, ahead, iteration 2, before rank B fetches iteration 1: B must not get A's iteration-1
    chunks, which it would if A's early fetch were filed under the iteration A was in."""
    a, add, store = setup(local_ray, tmp_path, max_staleness=1, max_reuse=2, num_iterations=2)
    b = RecordingTrainer(
        rollout_manager=None,
        policy_generator=tk.mlp_policy,
        env_generator=tk.cartpole,
        config=a.config,
        run_dir=str(tmp_path / "run_b"),
    )
    b.setup_rank(local=True)
    b._buffer, b._store = a._buffer, store
    for index in range(4):
        add("s", index, version=0)
    logprobs = {i: frag[F.LOGPROB] for i, frag in enumerate(store.get_many([F.fragment_key("s", i) for i in range(4)]))}

    def chunks(batch: dict) -> set[int]:
        return {i for row in batch[F.LOGPROB].numpy() for i, ref in logprobs.items() if np.array_equal(row, ref)}

    served = {}
    for name, trainer in (("a", a), ("b", b)):
        trainer.iteration = 1
        served[name, 1] = chunks(trainer.fetch_fragments_and_estimate_advantages(2))
        ((iteration, _, ahead),) = trainer._prefetch
        served[name, iteration] = chunks(ahead.result(timeout=60))
    assert served["a", 1] | served["b", 1] == {0, 1, 2, 3}  # every chunk once in iteration 1
    assert served["a", 2] | served["b", 2] == {0, 1, 2, 3}  # and once in iteration 2


def test_the_first_fetch_after_a_resume_honours_max_staleness(local_ray, tmp_path) -> None:
    """The buffer is rebuilt at version 0; the trainer resumed at version 5 must not train on
    version-0 data with max_staleness 1 (the fetch waits for fresh data instead)."""
    import concurrent.futures

    trainer, add, _ = setup(local_ray, tmp_path, max_staleness=1, prefetch_batches=0)
    add("old", 0, version=0)
    add("new", 0, version=5)
    trainer.iteration, trainer.version = 1, 5
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(trainer.fetch_fragments_and_estimate_advantages, 2)
        done, _ = concurrent.futures.wait([future], timeout=3)
        assert not done  # a stale chunk would have been served at once
        add("newer", 0, version=5)
        batch = future.result(timeout=60)
    assert batch["version"].unique().tolist() == [5]


def test_a_fragment_whose_checksum_does_not_match_is_dropped_and_counted(local_ray, tmp_path) -> None:
    trainer, add, store = setup(local_ray, tmp_path, prefetch_batches=0, max_staleness=5)
    add("a", 0, version=0)
    key = F.fragment_key("a", 0)
    # Another stream's payload written over this key (what reused stream keys did on resume).
    other = fragment("x", 7, version=3)
    other.update({F.STREAM: "a", F.INDEX: 0})
    store.put(key, other)
    add("b", 0, version=0)
    trainer.iteration = 1
    batch = trainer.fetch_fragments_and_estimate_advantages(1)
    assert trainer.corrupt_fragments == 1 and trainer.perf["trainer/corrupt_fragments"] == 1.0
    assert batch["version"].unique().tolist() == [0]


def test_a_trainer_waiting_for_chunks_fails_after_progress_timeout_saying_why(
    local_ray, tmp_path, caplog, monkeypatch
) -> None:
    ray = local_ray
    from mineonline_core.errors import RunFailedError
    from mineonline_core.rollout.buffer import ReplayBuffer
    from mineonline_core.services.storehost import StoreClient, start_store_host
    from mineonline_core.trainer import fetch

    host = start_store_host(store_cls=MemoryStore, path="unused", num_shards=1, resume=False)
    store = StoreClient.connect(host, store_cls=MemoryStore, path="unused", num_shards=1)
    buffer = (
        ray.remote(ReplayBuffer)
        .options(num_cpus=0)
        .remote(store_client=store, max_chunks=16, max_reuse=1, max_staleness=0)
    )
    config = load_config(
        cartpole_config(
            run_name="starved",
            output_dir=str(tmp_path),
            progress_timeout=2.5,
            policy_config={"hidden_sizes": [32, 32]},
            rollout_config={"fragment_length": 8},
            train_config={
                "batch_size_per_gpu": 1,
                "batches_per_iteration": 1,
                "context_length": 8,
                "gradient_accumulation": 1,
            },
        )
    ).config
    trainer = RecordingTrainer(
        rollout_manager=None,
        policy_generator=tk.mlp_policy,
        env_generator=tk.cartpole,
        config=config,
        run_dir=str(tmp_path / "run"),
    )
    trainer.setup_rank(local=True)
    trainer._buffer, trainer._store = buffer, store
    monkeypatch.setattr(fetch, "SAMPLE_WAIT_S", 1.0)  # report every second instead of every 30
    with caplog.at_level("WARNING", logger="mineonline_core.trainer.fetch"):
        with pytest.raises(
            RunFailedError, match=r"within progress_timeout=2.5s: .*No rollout worker delivered a fragment"
        ):
            trainer.fetch_chunks(2)
    waits = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert len(waits) == 2 and "0 of the 2 chunks asked for are eligible" in waits[0]
