"""Crafter with PPO and a recurrent CNN policy: a MineStudio-style config module.

``mineonline run examples/crafter.py`` reads the same three names as MineStudio's ``run.py``:
``env_generator``, ``policy_generator`` and ``online_dict``. It fits a 2-core laptop: one rollout
worker with 4 Crafter envs, one CPU train worker. ``make demo`` runs it for a short budget
(30 iterations, see ``DEMO_OVERRIDES`` in the Makefile); ``benchmarks/bench_learning.py --env crafter`` measures it.
"""

from mineonline_core.builtin.models import RecurrentCNNPolicy


def env_generator():
    # Crafter's old-gym 4-tuple API is adapted by the core (terminated = death, truncated = time limit).
    import crafter

    from mineonline_core.builtin.envs import CrafterAchievements, adapt_env

    return CrafterAchievements(adapt_env(crafter.Env(size=(64, 64), length=10000)))


def policy_generator():
    return RecurrentCNNPolicy(image_shape=(64, 64, 3), num_actions=17, channels=[32, 64, 64], hidden_size=256)


online_dict = {
    "trainer_name": "PPOTrainer",
    "detach_rollout_manager": False,
    "rollout_config": {
        "num_rollout_workers": 1,
        "num_gpus_per_worker": 0.0,
        "num_cpus_per_worker": 0.5,
        "fragment_length": 64,
        "to_send_queue_size": 4,
        "worker_config": {"num_envs": 4, "batch_size": 4, "restart_interval": 0, "video_fps": 10, "video_output_dir": "videos"},
        "replay_buffer_config": {
            "max_chunks": 256,
            "max_reuse": 2,
            "max_staleness": 2,
            "fragments_per_report": 40,
            "fragments_per_chunk": 2,  # 128-step sequences, trained from the first fragment's state_in
            "database_config": {"backend": "memory"},
        },
        "episode_statistics_config": {"window": 20},
    },
    "train_config": {
        "num_workers": 1,
        "num_gpus_per_worker": 0.0,
        "num_cpus_per_worker": 1.0,
        "num_iterations": 400,  # 400 x 8 chunks x 128 steps ~ 400k steps of data (reused at most twice)
        "vf_warmup": 0,
        "learning_rate": 3e-4,
        "anneal_lr_linearly": False,
        "weight_decay": 0.0,
        "adam_eps": 1e-5,
        "batch_size_per_gpu": 4,
        "batches_per_iteration": 2,
        "gradient_accumulation": 1,
        "epochs_per_iteration": 2,
        "context_length": 64,
        "discount": 0.99,
        "gae_lambda": 0.95,
        "ppo_clip": 0.2,
        "clip_vloss": False,
        "max_grad_norm": 0.5,
        "zero_initial_vf": True,
        "ppo_policy_coef": 1.0,
        "ppo_vf_coef": 0.5,
        "kl_divergence_coef_rho": 0.0,
        "entropy_bonus_coef": 0.01,
        "coef_rho_decay": 0.9995,
        "log_ratio_range": 50,
        "normalize_advantage_full_batch": True,
        "use_normalized_vf": True,
        "save_interval": 50,
        "keep_interval": 200,
        "record_video_interval": 0,
        "enable_ref_update": False,
        "fix_decoder": False,
        "resume": None,
        "resume_optimizer": True,
        "save_path": "checkpoints",
        "use_amp": False,
    },
    "logger_config": {"loggers": [], "project": "mineonline-crafter"},
}
