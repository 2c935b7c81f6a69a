"""A trainer attempt that starts again (a driver's resume, the attempt that replaces a dead Ray Train rank) takes up
the run where it stands, on a real rollout manager, logging actor and LMDB store on a local cluster:

* it publishes its checkpoint's weights under a version past every version the rollout side has seen
  (``trainer/recovery.py``): otherwise fragments kept in the store from before the stop carry versions above the
  trainer's, and the fetch refuses them as corrupt (a negative staleness);
* the loggers drop what the dead attempt logged after the checkpoint the new one resumes from: one record per
  iteration in ``metrics.jsonl``;
* a resumed run's logging actor counts env steps on from the checkpoint's: the step axis never goes back.

The same through whole runs (a driver killed and resumed, a rank SIGKILLed) are in ``tests/faults/test_resume.py``
and ``tests/test_resume_safety.py``; these take seconds, so the mutation check runs them first.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import torch
from mineonline_ppo import PPOTrainer

from mineonline_core.builtin.console import ConsoleLogger, ConsoleOptions
from mineonline_core.config import load_config
from mineonline_core.contracts.envs import adapted
from mineonline_core.contracts.fragment import fragment_meta
from mineonline_core.driver import api
from mineonline_core.driver.resolve import resolve
from mineonline_core.registry import get_plugin_manager
from mineonline_core.rollout.manager import launch_rollout_manager
from mineonline_core.services import loggerhub
from mineonline_core.testing import kit as tk
from mineonline_core.trainer import checkpoint as ckpt
from mineonline_core.trainer.loop import TrainLoop
from mineonline_core.trainer.recovery import rejoin_version
from tests.conftest import cartpole_config
from tests.test_record_checksum import fragment


def _config(tmp_path: Path, run_name: str, **train: Any) -> Any:
    return load_config(
        cartpole_config(
            run_name=run_name,
            output_dir=str(tmp_path),
            policy_config={"hidden_sizes": [32, 32]},  # tk.mlp_policy's
            rollout_config={
                "num_rollout_workers": 1,
                "num_cpus_per_worker": 0.5,
                "fragment_length": 8,
                "worker_config": {"num_envs": 2, "batch_size": 2},
            },
            train_config={
                "num_workers": 1,
                "num_cpus_per_worker": 0.5,
                "context_length": 8,
                "batch_size_per_gpu": 2,
                "batches_per_iteration": 1,
                "gradient_accumulation": 1,
                "epochs_per_iteration": 1,
                **train,
            },
        )
    ).config


def _stop(ray: Any, manager: Any) -> None:
    try:
        ray.get(manager.shutdown.remote(), timeout=60)
    finally:
        ray.kill(manager)


def test_a_restarted_trainer_numbers_its_versions_past_the_store_and_the_workers(local_ray, tmp_path) -> None:
    ray = local_ray
    env = adapted(functools.partial(tk.CountingEnv, tag=3.0, episode_len=1000))
    manager = launch_rollout_manager(
        policy_generator=tk.TinyMLPPolicy, env_generator=env, config=_config(tmp_path, "rejoin")
    )
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
        _stop(ray, manager)


def test_a_replacement_attempt_drops_what_the_dead_one_logged_past_its_checkpoint(local_ray, tmp_path) -> None:
    ray = local_ray
    config = _config(tmp_path, "rewind", num_iterations=3, save_interval=2)
    run_dir = tmp_path / "rewind"
    hub = loggerhub.start_logger_hub(
        run_name="rewind",
        run_dir=str(run_dir),
        loggers=[(ConsoleLogger, ConsoleOptions())],
        config={},
        num_iterations=3,
        video_dir="videos",
    )
    manager = launch_rollout_manager(
        policy_generator=tk.mlp_policy, env_generator=adapted(tk.cartpole), config=config, logger_hub=hub
    )
    try:
        loop = TrainLoop(
            algorithm=PPOTrainer,
            rollout_manager=manager,
            logger_hub=hub,
            policy_generator=tk.mlp_policy,
            env_generator=tk.cartpole,
            config=config,
            run_dir=str(run_dir),
        )
        loop.preflight()
        loop._fit_started = time.time()  # what fit() notes: the checkpoints this run wrote are written after it
        # The dead attempt: it checkpointed iteration 2, logged iteration 3, and its rank died.
        loop.setup_rank(local=True)
        loop.iteration = 2
        loop.save_checkpoint()
        for iteration in (1, 2, 3):
            ray.get(hub.log_metrics.remote({"trainer/iteration": float(iteration)}))
        # The attempt that replaces it (fit()'s loop counts it), here in this process: the function a Ray Train
        # rank runs, resuming from checkpoint 2 and training iteration 3 again on fragments of the real workers.
        loop.restarts = 1
        assert loop._fit_in_process(torch.device("cpu"))["iteration"] == 3
        assert ray.get(hub.flush.remote(60))
    finally:
        _stop(ray, manager)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    iterations = [r["trainer/iteration"] for r in records if "trainer/iteration" in r]
    assert iterations == [1, 2, 3], f"one record per iteration, whichever attempt trained it: {iterations}"
    assert [r.get("trainer/restarts") for r in records if "trainer/iteration" in r][-1] == 1.0  # the new one's


def test_a_resumed_runs_logging_actor_counts_env_steps_on_from_the_checkpoint(local_ray, tmp_path) -> None:
    ray = local_ray
    first = tk.local_loop(PPOTrainer, _config(tmp_path, "counted"), run_dir=str(tmp_path / "counted"))
    first.iteration, first.env_steps = 1, 737  # iteration 1 of the run ended at env step 737
    first.save_checkpoint()
    checkpoint = ckpt.checkpoint_dir(first.save_dir, 1)
    config = _config(tmp_path, "counted", resume=str(checkpoint))
    resolved = resolve(load_config(config.model_dump()), get_plugin_manager(), probe=False)
    hub = api._start_hub(resolved)  # what the driver starts for the resumed run, before any rollout worker
    try:
        counted = ray.get(hub.env_steps.remote())
        assert counted == 737, f"the resumed run counts env steps from {counted}, not from its checkpoint's 737"
        ray.get(hub.add_env_steps.remote(100))  # rollout's first steps after the resume
        assert ray.get(hub.log_metrics.remote({"rollout/env_steps_per_s": 1.0})) == 837  # the record's step
    finally:
        ray.kill(hub)
