"""DESIGN §5.3: for version-0 data the trainer's sequence forward reproduces the rollout's behaviour
log-probs and values, through fragments with episode resets, with context_length < fragment_length."""

from __future__ import annotations

import pytest
import torch

from mineonline_core.contracts import fragment as F
from mineonline_core.trainer.batch import assemble_chunks, denormalized_value, estimate_advantages
from mineonline_core.trainer.sequence import forward_sequence, windows
from mineonline_core.testing import kit as tk
from mineonline_core.testing.kit import TinyImageEnv, cartpole, chunks_of, cnn_policy, mlp_policy, rollout_fragments


def test_windows_cover_the_sequence():
    assert windows(10, 4) == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert windows(8, 8) == [slice(0, 8)]


@pytest.mark.parametrize(
    "make_policy,env_fn",
    [(mlp_policy, lambda i: cartpole(max_steps=12)), (cnn_policy, lambda i: TinyImageEnv(seed=i))],
    ids=["mlp", "cnn_gru"],
)
def test_forward_reproduces_behaviour(make_policy, env_fn):
    policy = make_policy()
    with torch.no_grad():  # a non-trivial normaliser, so denormalisation is exercised too
        policy.value_head.normalizer.update(torch.tensor([3.0, 5.0, 9.0]))
    streams = rollout_fragments(policy, env_fn, num_envs=3, fragment_length=8, fragments_per_env=4)
    batch = assemble_chunks(chunks_of(streams, fragments_per_chunk=2))
    assert batch[F.OBS][next(iter(batch[F.OBS]))].shape[:2] == (6, 16)
    # The data contains episode starts inside fragments, not only at position 0.
    assert batch[F.FIRST][:, 1:].sum() > 0
    with torch.no_grad():
        latents, _ = forward_sequence(policy, batch[F.OBS], batch[F.STATE_IN], batch[F.FIRST], context_length=5)
        logprob = policy.pi_head.logprob(batch[F.ACTION], latents["pi_logits"])
        value = denormalized_value(policy, latents["vpred"])
    assert torch.allclose(logprob, batch[F.LOGPROB], atol=1e-5), (logprob - batch[F.LOGPROB]).abs().max()
    assert torch.allclose(value, batch[F.VPRED], atol=1e-5), (value - batch[F.VPRED]).abs().max()
    out = estimate_advantages(policy, batch, version=3, context_length=5, discount=0.99, gae_lambda=0.95)
    assert torch.allclose(out[F.VALUE], batch[F.VPRED], atol=1e-5)
    assert out[F.STALENESS].unique().tolist() == [3.0]
    assert out[F.ADVANTAGE].shape == (6, 16) and torch.isfinite(out[F.RETURN]).all()


def test_state_carries_across_windows_for_recurrent_policy():
    # Without resets, window boundaries must not change the output (the state is carried over).
    policy = cnn_policy()
    streams = rollout_fragments(
        policy, lambda i: TinyImageEnv(seed=i, mean_length=1000), num_envs=1, fragment_length=6, fragments_per_env=2
    )
    batch = assemble_chunks(chunks_of(streams, 2))
    with torch.no_grad():
        a, _ = forward_sequence(policy, batch[F.OBS], batch[F.STATE_IN], batch[F.FIRST], context_length=12)
        b, _ = forward_sequence(policy, batch[F.OBS], batch[F.STATE_IN], batch[F.FIRST], context_length=5)
    assert torch.allclose(a["pi_logits"], b["pi_logits"], atol=1e-6)


@pytest.mark.parametrize(
    "make_policy,env_fn", [(mlp_policy, "cartpole"), (cnn_policy, "image")], ids=["mlp", "cnn_gru"]
)
def test_forward_reproduces_the_real_collector(make_policy, env_fn):
    """The same invariant on fragments cut by the rollout's own FragmentCollector (env subprocesses,
    batched inference over fewer envs than exist, so envs step out of lock-step)."""
    import functools

    fn = functools.partial(cartpole, 10) if env_fn == "cartpole" else functools.partial(TinyImageEnv, 0, 5)
    policy = make_policy()
    collector = tk.collector(policy=policy, env_fns=[fn] * 3, fragment_length=8, batch_size=2, seed=0, step_timeout=60)
    try:
        fragments = collector.collect(12)
    finally:
        collector.close()
    streams: dict[str, list[dict]] = {}
    for frag in sorted(fragments, key=lambda f: (f[F.STREAM], f[F.INDEX])):
        streams.setdefault(frag[F.STREAM], []).append(frag)
    chunks = [
        c for c in chunks_of(streams, 2) if [f[F.INDEX] for f in c] == list(range(c[0][F.INDEX], c[0][F.INDEX] + 2))
    ]
    assert chunks, "expected consecutive fragment pairs"
    batch = assemble_chunks(chunks)
    assert batch[F.FIRST][:, 1:].any()
    with torch.no_grad():
        latents, _ = forward_sequence(policy, batch[F.OBS], batch[F.STATE_IN], batch[F.FIRST], context_length=5)
        logprob = policy.pi_head.logprob(batch[F.ACTION], latents["pi_logits"])
        value = denormalized_value(policy, latents["vpred"])
    assert torch.allclose(logprob, batch[F.LOGPROB], atol=1e-5), (logprob - batch[F.LOGPROB]).abs().max()
    assert torch.allclose(value, batch[F.VPRED], atol=1e-5), (value - batch[F.VPRED]).abs().max()
