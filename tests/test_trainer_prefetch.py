"""The trainer fetches the next iteration's chunks while the current one trains, and the buffer
holds that early fetch to ``max_staleness`` at the version the chunks will be trained at."""

from __future__ import annotations


import numpy as np
import pytest

from mineonline_core import fragment as F
from mineonline_core.config import load_config
from mineonline_core.store import MemoryStore
from mineonline_core.testing import kit as tk
from mineonline_core.trainer.base import BaseTrainer
from mineonline_core.rollout.worker import fragment_meta

pytest_plugins = ["mineonline_core.testing.fixtures"]


class RecordingTrainer(BaseTrainer):
    name = "recording"

    def setup_model_and_optimizer(self, policy):
        return policy, None

    def train(self, batch: dict) -> dict[str, float]:
        return {}


def fragment(stream: str, index: int, version: int) -> dict:
    (frag,) = tk.rollout_fragments(tk.mlp_policy(), lambda i: tk.cartpole(50), num_envs=1,
                                   fragment_length=8, fragments_per_env=1, version=version, seed=index)["0.0.0"]  # fmt: skip
    frag.update({F.STREAM: stream, F.INDEX: index})
    return frag


def test_next_chunks_are_fetched_during_training_and_never_staler_than_allowed(local_ray, tmp_path) -> None:
    ray = local_ray
    from mineonline_core.rollout.buffer import ReplayBuffer
    from mineonline_core.storehost import StoreClient, start_store_host

    host = start_store_host(store_cls=MemoryStore, path="unused", num_shards=1, resume=False)
    store = StoreClient.connect(host, store_cls=MemoryStore, path="unused", num_shards=1)
    buffer = ray.remote(ReplayBuffer).options(num_cpus=0).remote(
        store_client=store, max_chunks=16, max_reuse=1, max_staleness=0)  # fmt: skip

    def add(stream: str, index: int, version: int) -> None:
        frag = fragment(stream, index, version)
        meta = fragment_meta(frag)
        store.put(meta["key"], frag)
        ray.get(buffer.add_fragment.remote(meta))

    config = load_config({
        "run_name": "prefetch", "output_dir": str(tmp_path), "env_config": {"name": "gymnasium", "id": "CartPole-v1"},
        "policy_config": {"name": "mlp", "hidden_sizes": [32, 32]}, "logger_config": {"loggers": []},
        "rollout_config": {"fragment_length": 8},
        "train_config": {"num_iterations": 3, "vf_warmup": 0, "batch_size_per_gpu": 1, "batches_per_iteration": 1,
                         "context_length": 8, "gradient_accumulation": 1},
    }).config  # fmt: skip
    trainer = RecordingTrainer(rollout_manager=None, policy_generator=tk.mlp_policy, env_generator=tk.cartpole,
                               config=config, run_dir=str(tmp_path / "run"))  # fmt: skip
    trainer.setup_rank(local=True)
    trainer._buffer, trainer._store = buffer, store

    add("a", 0, version=0)
    trainer.iteration = 1
    first = trainer.fetch_fragments_and_estimate_advantages(1)
    assert first["version"].unique().tolist() == [0]
    ahead = trainer._prefetch
    assert ahead is not None  # asked for while iteration 1 trains, for version 1
    add("b", 0, version=0)  # fresh now, but one version too old for iteration 2: never served to it
    add("c", 0, version=1)
    trainer.version, trainer.iteration = 1, 2  # iteration 1 published version 1
    second = trainer.fetch_fragments_and_estimate_advantages(1)
    assert ahead[1].done()
    assert second["version"].unique().tolist() == [1]
    assert second["staleness"].max().item() == 0
    trainer.version, trainer.iteration = 2, 3
    ray.get(buffer.set_version.remote(2))
    add("d", 0, version=2)
    third = trainer.fetch_fragments_and_estimate_advantages(1)
    assert third["version"].unique().tolist() == [2]
    assert trainer._prefetch is None  # the last iteration fetches nothing ahead
    stats = ray.get(buffer.stats.remote())
    assert stats["replay/chunks_served"] == 3 and np.isclose(stats["replay/version"], 2)


def test_a_trainer_waiting_for_chunks_fails_after_progress_timeout_saying_why(local_ray, tmp_path, caplog, monkeypatch) -> None:
    ray = local_ray
    from mineonline_core.errors import RunFailedError
    from mineonline_core.rollout.buffer import ReplayBuffer
    from mineonline_core.storehost import StoreClient, start_store_host
    from mineonline_core.trainer import base

    host = start_store_host(store_cls=MemoryStore, path="unused", num_shards=1, resume=False)
    store = StoreClient.connect(host, store_cls=MemoryStore, path="unused", num_shards=1)
    buffer = ray.remote(ReplayBuffer).options(num_cpus=0).remote(store_client=store, max_chunks=16, max_reuse=1, max_staleness=0)
    config = load_config({
        "run_name": "starved", "output_dir": str(tmp_path), "progress_timeout": 2.5,
        "env_config": {"name": "gymnasium", "id": "CartPole-v1"}, "policy_config": {"name": "mlp", "hidden_sizes": [32, 32]},
        "logger_config": {"loggers": []}, "rollout_config": {"fragment_length": 8},
        "train_config": {"batch_size_per_gpu": 1, "batches_per_iteration": 1, "context_length": 8, "gradient_accumulation": 1},
    }).config  # fmt: skip
    trainer = RecordingTrainer(rollout_manager=None, policy_generator=tk.mlp_policy, env_generator=tk.cartpole,
                               config=config, run_dir=str(tmp_path / "run"))  # fmt: skip
    trainer.setup_rank(local=True)
    trainer._buffer, trainer._store = buffer, store
    monkeypatch.setattr(base, "SAMPLE_WAIT_S", 1.0)  # report every second instead of every 30
    with caplog.at_level("WARNING", logger="mineonline_core.trainer.base"):
        with pytest.raises(RunFailedError, match=r"within progress_timeout=2.5s: .*No rollout worker delivered a fragment"):
            trainer.fetch_chunks(2)
    waits = [r.getMessage() for r in caplog.records if "has waited" in r.getMessage()]
    assert len(waits) == 2 and "0 of the 2 chunks asked for are eligible" in waits[0]
