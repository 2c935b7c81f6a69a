"""One trainer rank in the driver's process on a chosen device (``trainer/device.py``): the device
logic that maps Ray's leased GPU to this process, the lease that keeps the rank's GPU share out of
the rollout workers' reach, the fall-back to Ray Train when the driver sees no GPU, and a whole
in-process run on an explicit device (the CPU standing in for the GPU a GPU machine would give)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from mineonline_ppo import PPOTrainer

from mineonline_core.config import load_config
from mineonline_core.contracts import fragment as F
from mineonline_core.driver.localcluster import start_local_cluster
from mineonline_core.errors import ConfigError
from mineonline_core.services.gpulease import lease_gpu
from mineonline_core.services.names import NAMESPACE
from mineonline_core.testing.kit import cartpole, mlp_policy
from mineonline_core.trainer import checkpoint as ckpt
from mineonline_core.trainer.device import rank_device
from mineonline_core.trainer.loop import TrainLoop


@pytest.fixture
def gpu_ray():
    """A local cluster that declares one GPU (Ray's books only: this machine has none)."""
    import ray

    start_local_cluster(num_cpus=2, num_gpus=1, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_rank_device_maps_rays_gpu_to_this_process() -> None:
    assert rank_device(gpu_ids=["1"], visible_devices=None, device_count=2) == (torch.device("cuda", 1), "Ray's GPU 1")
    # The driver sees GPUs 2 and 3 as its devices 0 and 1; Ray names them by the node's numbering.
    assert rank_device(gpu_ids=["3"], visible_devices="2,3", device_count=2)[0] == torch.device("cuda", 1)
    assert rank_device(gpu_ids=["GPU-b"], visible_devices="GPU-a,GPU-b", device_count=2)[0] == torch.device("cuda", 1)
    device, why = rank_device(gpu_ids=["0"], visible_devices="2,3", device_count=2)
    assert device is None and "Ray's GPU 0 is not one of the driver's CUDA devices" in why
    device, why = rank_device(gpu_ids=["0"], visible_devices=None, device_count=0)
    assert device is None and "sees no CUDA device" in why
    assert rank_device(gpu_ids=[], visible_devices=None, device_count=1)[0] is None


def online(tmp_path, **train) -> dict:
    return {
        "run_name": "device",
        "output_dir": str(tmp_path),
        "seed": 1,
        "rollout_config": {
            "num_rollout_workers": 1,
            "num_cpus_per_worker": 0.5,
            "fragment_length": 16,
            "worker_config": {"num_envs": 2, "batch_size": 2},
            "replay_buffer_config": {
                "fragments_per_chunk": 1,
                "max_staleness": 2,
                "max_reuse": 2,
                "max_chunks": 64,
                "database_config": {"backend": "memory"},
            },
        },
        "train_config": {
            "num_workers": 1,
            "num_gpus_per_worker": 0.5,
            "num_cpus_per_worker": 0.5,
            "num_iterations": 3,
            "vf_warmup": 0,
            "batch_size_per_gpu": 2,
            "batches_per_iteration": 2,
            "gradient_accumulation": 1,
            "context_length": 16,
            "save_interval": 3,
            "record_video_interval": 0,
            "learning_rate": 1e-2,
            **train,
        },
        "logger_config": {"loggers": []},
    }


def trainer_for(data: dict, manager=None) -> PPOTrainer:
    cfg = load_config(data).config
    return TrainLoop(
        algorithm=PPOTrainer,
        rollout_manager=manager,
        policy_generator=mlp_policy,
        env_generator=None,
        config=cfg,
        run_dir=str(cfg.run_dir()),
    )


def test_the_lease_holds_the_ranks_gpu_share_and_a_driver_without_cuda_hands_it_to_ray_train(
    gpu_ray, tmp_path, caplog
) -> None:
    ray = gpu_ray
    lease, gpu_ids = lease_gpu(0.5)
    try:
        assert gpu_ids == ["0"]
        assert ray.available_resources().get("GPU", 0.0) == pytest.approx(0.5)  # booked: no rollout worker gets it
    finally:
        ray.kill(lease)
    deadline = time.monotonic() + 60  # a killed actor's resources return asynchronously
    while ray.available_resources().get("GPU", 0.0) < 1.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("GPU", 0.0) == pytest.approx(1.0)

    assert torch.cuda.device_count() == 0  # this machine: the driver cannot train on a GPU
    trainer = trainer_for(online(tmp_path))
    assert not trainer.uses_ray_train()  # one rank: in the driver's process if it can
    with caplog.at_level(logging.WARNING, logger="mineonline_core.trainer.ranks"):
        assert trainer._driver_device() == (None, None)
    assert any(
        "runs on Ray Train" in r.getMessage() and "sees no CUDA device" in r.getMessage() for r in caplog.records
    )
    with pytest.raises(
        ConfigError, match=r"use_ray_train is false with num_gpus_per_worker 0.5.*sees no CUDA device.*Fix"
    ):
        trainer_for(online(tmp_path, use_ray_train=False))._driver_device()
    assert trainer_for(online(tmp_path, num_gpus_per_worker=0))._driver_device() == (torch.device("cpu"), None)


def test_one_rank_fits_in_process_on_an_explicit_device(gpu_ray, tmp_path) -> None:
    """The whole in-process loop on the device ``fit`` is given: every version reaches the rollout
    worker, which then acts with exactly the trainer's final weights."""
    ray = gpu_ray
    from mineonline_core.rollout.manager import launch_rollout_manager

    data = online(tmp_path)
    cfg = load_config(data).config
    manager = launch_rollout_manager(policy_generator=mlp_policy, env_generator=lambda: cartpole(50), config=cfg)
    try:
        ray.get(manager.wait_ready.remote(120), timeout=150)
        trainer = trainer_for(data, manager)
        # "cpu:0", not the default "cpu": the device the rank was set up on is the one fit was given.
        result = trainer.fit(device=torch.device("cpu", 0))
        assert trainer.in_process and trainer.device == torch.device("cpu", 0)
        assert not (cfg.run_dir() / "ray_train").exists()  # no Ray Train controller or worker group
        assert (result["iteration"], result["version"]) == (3, 3)
        assert trainer._broadcast is None  # fit waited for the last broadcast
        final = ckpt.load_checkpoint(ckpt.latest_checkpoint(trainer.save_dir))["model"]

        deadline = time.monotonic() + 120
        while [w["version"] for w in ray.get(manager.status.remote())["workers"]] != [
            3
        ] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [w["version"] for w in ray.get(manager.status.remote())["workers"]] == [3]
        buffer, store = ray.get([manager.get_buffer.remote(), manager.get_store_client.remote()])
        chunks = []
        while not any(c["version"] == 3 for c in chunks) and time.monotonic() < deadline:
            chunks = ray.get(buffer.sample.remote(1, 3, 60), timeout=90)
            ray.get(buffer.release.remote([c["chunk_id"] for c in chunks]))
        (frag,) = store.get_many([k for c in chunks if c["version"] == 3 for k in c["keys"]][:1])
        assert (frag[F.VERSION] == 3).all()
        policy = mlp_policy()
        policy.load_state_dict(final)
        with torch.no_grad():
            latents, _ = policy(
                input={"obs": torch.tensor(frag[F.OBS]["obs"])[None]},
                state_in=None,  # the MLP has no recurrent state
                context={"first": torch.tensor(frag[F.FIRST])[None]},
            )
            logp = policy.pi_head.logprob(torch.tensor(frag[F.ACTION])[None], latents["pi_logits"])[0]
        torch.testing.assert_close(logp, torch.tensor(frag[F.LOGPROB]), atol=1e-5, rtol=1e-5)
    finally:
        ray.get(manager.shutdown.remote(), timeout=120)
