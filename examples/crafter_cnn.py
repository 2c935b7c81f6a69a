"""Crafter on 2 CPU cores: Moon et al.'s PPO hyperparameters with the Nature CNN (`cnn`).

The tuned PPO of ``crafter_ppo_resnet.py`` (8 envs x 512 steps per iteration, 3 epochs x 8 minibatches,
lr 3e-4, entropy 0.01, gamma 0.95, GAE lambda 0.65, advantages normalised over the batch, value targets
normalised) with SB3's ``CnnPolicy`` network in place of the IMPALA-ResNet, which a 2-core CPU cannot
afford at 1M steps. One seed on this project's 2-core machine: Crafter score 8.6 % over all training
episodes up to 1M env steps (the paper's rule), 10.3 % over the last 20 episodes, in 67 minutes
(benchmarks/RESULTS.md, issue 19)::

    python benchmarks/bench_learning.py --env crafter --config examples/crafter_cnn.py --steps 1000000 --seeds 0 1 2
"""


def env_generator():
    import crafter

    from mineonline_core.builtin.envs import CrafterAchievements, adapt_env

    return CrafterAchievements(adapt_env(crafter.Env(size=(64, 64), length=10000)))


online_dict = {
    "trainer_name": "PPOTrainer",
    # By name rather than a policy_generator, so that the width is an override away.
    "policy_config": {"name": "cnn"},
    "detach_rollout_manager": False,
    "rollout_config": {
        "num_rollout_workers": 1,
        "num_gpus_per_worker": 0.0,
        "num_cpus_per_worker": 0.5,
        "fragment_length": 64,
        "to_send_queue_size": 8,
        "worker_config": {"num_envs": 8, "batch_size": 8, "restart_interval": 0, "video_fps": 10, "video_output_dir": "videos"},
        "replay_buffer_config": {
            "max_chunks": 256,
            "max_reuse": 1,  # the 3 passes over a chunk are the epochs of its iteration
            "max_staleness": 1,
            "fragments_per_report": 64,
            "fragments_per_chunk": 1,
            "database_config": {"backend": "memory"},
        },
        "episode_statistics_config": {"window": 20},
    },
    "train_config": {
        "num_workers": 1,
        "num_gpus_per_worker": 0.0,
        "num_cpus_per_worker": 1.0,
        "num_iterations": 400,  # an upper bound: max_env_steps ends the run at 1M collected steps
        "max_env_steps": 1_000_000,
        "vf_warmup": 0,
        "learning_rate": 3e-4,
        "anneal_lr_linearly": False,
        "weight_decay": 0.0,
        "adam_eps": 1e-8,
        "batch_size_per_gpu": 8,
        "batches_per_iteration": 8,
        "gradient_accumulation": 1,
        "epochs_per_iteration": 3,
        "context_length": 64,
        "discount": 0.95,
        "gae_lambda": 0.65,
        "ppo_clip": 0.2,
        "clip_vloss": False,
        "max_grad_norm": 0.5,
        "zero_initial_vf": False,  # keep the policy's own small value-head init
        "ppo_policy_coef": 1.0,
        "ppo_vf_coef": 0.5,
        "kl_divergence_coef_rho": 0.0,
        "entropy_bonus_coef": 0.01,
        "normalize_advantage_full_batch": True,
        "use_normalized_vf": True,
        "save_interval": 25,
        "keep_interval": 125,
        "record_video_interval": 0,
        "save_path": "checkpoints",
        "use_amp": False,
    },
    "logger_config": {"loggers": [], "project": "mineonline-crafter"},
}
