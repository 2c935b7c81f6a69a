"""GAE against a hand-computed reference: termination, truncation with bootstrap, and an env crash."""

from __future__ import annotations

import torch

from mineonline_core.trainer.gae import compute_gae

G, LAM = 0.9, 0.8


def gae(reward, value, next_value, terminated, truncated, bootstrap):
    t = lambda x, d=torch.float32: torch.tensor([x], dtype=d)  # noqa: E731
    adv, ret = compute_gae(
        reward=t(reward),
        value=t(value),
        next_value=torch.tensor([next_value]),
        terminated=t(terminated, torch.bool),
        truncated=t(truncated, torch.bool),
        bootstrap=t(bootstrap),
        discount=G,
        gae_lambda=LAM,
    )
    return adv[0].tolist(), ret[0].tolist()


def test_no_episode_end_bootstraps_from_next_value():
    adv, ret = gae([1, 2, 3], [0.5, 0.4, 0.3], 2.0, [0, 0, 0], [0, 0, 0], [0, 0, 0])
    d2 = 3 + G * 2.0 - 0.3
    d1 = 2 + G * 0.3 - 0.4
    d0 = 1 + G * 0.4 - 0.5
    expected = [d0 + G * LAM * (d1 + G * LAM * d2), d1 + G * LAM * d2, d2]
    assert torch.allclose(torch.tensor(adv), torch.tensor(expected), atol=1e-6)
    assert torch.allclose(torch.tensor(ret), torch.tensor(expected) + torch.tensor([0.5, 0.4, 0.3]), atol=1e-6)


def test_termination_stops_the_recursion_and_bootstraps_nothing():
    # Step 1 is a true terminal: its target is the reward alone; step 2 starts a new episode.
    adv, _ = gae([1, 5, 2], [0.1, 0.2, 0.7], 9.0, [0, 1, 0], [0, 0, 0], [0, 0, 0])
    d2 = 2 + G * 9.0 - 0.7
    d1 = 5 - 0.2
    d0 = 1 + G * 0.2 - 0.1
    assert torch.allclose(torch.tensor(adv), torch.tensor([d0 + G * LAM * d1, d1, d2]), atol=1e-6)


def test_truncation_bootstraps_from_the_stored_value_and_restarts():
    # A time limit at step 1: bootstrap from the stored value 4.0, not from value[2] (next episode).
    adv, _ = gae([1, 1, 1], [0.1, 0.2, 0.3], 0.5, [0, 0, 0], [0, 1, 0], [0, 4.0, 0])
    d2 = 1 + G * 0.5 - 0.3
    d1 = 1 + G * 4.0 - 0.2
    d0 = 1 + G * 0.2 - 0.1
    assert torch.allclose(torch.tensor(adv), torch.tensor([d0 + G * LAM * d1, d1, d2]), atol=1e-6)


def test_crash_at_last_step_uses_bootstrap_not_next_value():
    # An env crash is a truncation whose bootstrap is the value of the last observation (here the
    # step's own value 0.3); next_value (the reset observation of a rebuilt env) must be ignored.
    adv, _ = gae([1, 1, 0], [0.1, 0.2, 0.3], 100.0, [0, 0, 0], [0, 0, 1], [0, 0, 0.3])
    d2 = 0 + G * 0.3 - 0.3
    d1 = 1 + G * 0.3 - 0.2
    d0 = 1 + G * 0.2 - 0.1
    expected = [d0 + G * LAM * (d1 + G * LAM * d2), d1 + G * LAM * d2, d2]
    assert torch.allclose(torch.tensor(adv), torch.tensor(expected), atol=1e-6)


def test_terminal_at_last_step_ignores_next_value():
    adv, ret = gae([3.0], [1.0], 50.0, [1], [0], [0])
    assert adv == [2.0] and ret == [3.0]


def test_batch_rows_are_independent():
    torch.manual_seed(0)
    n, length = 3, 7
    kw = dict(
        reward=torch.randn(n, length),
        value=torch.randn(n, length),
        next_value=torch.randn(n),
        terminated=torch.rand(n, length) < 0.2,
        truncated=torch.rand(n, length) < 0.2,
        bootstrap=torch.randn(n, length),
        discount=G,
        gae_lambda=LAM,
    )
    adv, _ = compute_gae(**kw)
    for i in range(n):
        row = {k: (v[i : i + 1] if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        row_adv, _ = compute_gae(**row)
        assert torch.allclose(adv[i], row_adv[0])
