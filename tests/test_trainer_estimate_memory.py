"""The estimate pass holds one window's graph at a time (issue 33 row 3): it records gradients as the
update does, so a window's activations stay alive as long as anything references its outputs, and a
window still alive while the next one runs doubles the pass's peak (an OOM for the flagship on an
80 GB card). ``GraphTracker`` tags every tensor autograd saves with the forward call that saved it."""

from __future__ import annotations

from mineonline_core.testing.graphs import GraphTracker
from mineonline_core.testing.kit import TinyImageEnv, chunks_of, cnn_policy, local_loop, rollout_fragments
from mineonline_core.trainer.batch import assemble_chunks, current_policy_outputs


def test_the_estimate_pass_keeps_one_windows_graph_at_a_time() -> None:
    policy = cnn_policy()
    streams = rollout_fragments(
        policy, lambda i: TinyImageEnv(seed=i), num_envs=2, fragment_length=8, fragments_per_env=2
    )
    batch = assemble_chunks(chunks_of(streams, 2))
    with GraphTracker(policy) as tracker:
        out = current_policy_outputs(policy, batch, context_length=4, batch_size=1)
    # Two micro-batches of one chunk, four windows of 4 steps each, plus each one's next_obs step.
    assert tracker.call == 10
    assert all(tracker.call_bytes[c] > 0 for c in range(1, 11))  # the graphs were recorded (grad mode on)
    assert tracker.max_calls_alive == 1
    assert tracker.peak_bytes == tracker.window_bytes
    assert tracker.live_bytes == 0  # nothing outlives the pass
    assert not any(t.requires_grad for t in out.values())


def test_the_update_keeps_one_windows_graph_at_a_time(tmp_path) -> None:
    """Each window's backward frees its graph before the next window's forward (truncated BPTT)."""
    from mineonline_ppo import PPOTrainer

    from mineonline_core.config import OnlineConfig

    config = OnlineConfig(
        train_config={
            "context_length": 4,
            "batch_size_per_gpu": 2,
            "batches_per_iteration": 1,
            "kl_divergence_coef_rho": 0.0,
        }
    )
    trainer = local_loop(PPOTrainer, config, run_dir=str(tmp_path), policy=cnn_policy)
    trainer.iteration = 1
    streams = rollout_fragments(
        trainer.policy, lambda i: TinyImageEnv(seed=i), num_envs=2, fragment_length=8, fragments_per_env=2
    )
    batch = trainer.algorithm.estimate(batch=assemble_chunks(chunks_of(streams, 2)))
    with GraphTracker(trainer.policy) as tracker:
        trainer.train(batch)
    assert tracker.call == 4  # four windows of one micro-batch
    assert tracker.max_calls_alive == 1
    assert tracker.live_bytes == 0
