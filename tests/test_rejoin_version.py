"""A trainer that starts again (a driver's resume, a replacement rank) publishes its checkpoint's weights under a
version past every version the rollout side has seen (``trainer/recovery.py``): otherwise fragments kept in the
store from before the stop would carry versions above the trainer's, and the fetch refuses those as corrupt (a
negative staleness). A real rollout manager, its store host and its LMDB store on a local cluster; the whole
driver kill and resume is ``tests/faults/test_resume.py::test_driver_killed_then_resumed``.
"""

from __future__ import annotations

import functools

from mineonline_core.config import load_config
from mineonline_core.contracts.envs import adapted
from mineonline_core.contracts.fragment import fragment_meta
from mineonline_core.rollout.manager import launch_rollout_manager
from mineonline_core.testing import kit as tk
from mineonline_core.trainer.recovery import rejoin_version
from tests.conftest import cartpole_config
from tests.test_record_checksum import fragment


def test_a_restarted_trainer_numbers_its_versions_past_the_store_and_the_workers(local_ray, tmp_path) -> None:
    ray = local_ray
    config = load_config(
        cartpole_config(
            run_name="rejoin",
            output_dir=str(tmp_path),
            rollout_config={"num_rollout_workers": 1, "num_cpus_per_worker": 0.5, "fragment_length": 8},
            train_config={"num_workers": 1, "num_cpus_per_worker": 0.5, "context_length": 8},
        )
    ).config
    env = adapted(functools.partial(tk.CountingEnv, tag=3.0, episode_len=1000))
    manager = launch_rollout_manager(policy_generator=tk.TinyMLPPolicy, env_generator=env, config=config)
    try:
        assert rejoin_version(manager, 3) == 3  # nothing stored, nothing published: the checkpoint's own
        store = ray.get(manager.get_store_client.remote())
        for version in (5, 7, 2):  # what rollout stored with weights published after the checkpoint
            frag = fragment(f"s{version}", version=version)
            store.put(fragment_meta(frag)["key"], frag)
        assert rejoin_version(manager, 3) == 8  # past the newest stored fragment's version, not the checkpoint's
        assert rejoin_version(manager, 9) == 9  # a checkpoint newer than everything stored keeps its own
        weights = {k: v.numpy() for k, v in tk.TinyMLPPolicy().state_dict().items()}
        ray.get(manager.update_weights.remote([ray.put(weights)], 12))
        assert rejoin_version(manager, 3) == 13  # the workers hold version 12 (a rank that died had published it)
    finally:
        try:
            ray.get(manager.shutdown.remote(), timeout=60)
        finally:
            ray.kill(manager)
