"""The V-trace recursion against a per-step loop written from IMPALA's eq. (1), and its identities."""

from __future__ import annotations

import math

import pytest
import torch

from mineonline_core.trainer.gae import compute_gae
from mineonline_vtrace import vtrace, vtrace_loss

N, L, GAMMA = 3, 12, 0.9


def _inputs(seed: int = 0, *, log_ratio_scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(N, L, generator=g) * 2
    terminated = torch.zeros(N, L, dtype=torch.bool)
    truncated = torch.zeros(N, L, dtype=torch.bool)
    terminated[0, 4], truncated[1, 6], terminated[2, L - 1], truncated[0, 9] = True, True, True, True
    bootstrap = torch.where(truncated, torch.randn(N, L, generator=g), torch.zeros(N, L))
    return dict(
        behaviour_logprob=behaviour,
        target_logprob=behaviour + log_ratio_scale * torch.randn(N, L, generator=g),
        reward=torch.randn(N, L, generator=g),
        value=torch.randn(N, L, generator=g),
        next_value=torch.randn(N, generator=g),
        terminated=terminated,
        truncated=truncated,
        bootstrap=bootstrap,
    )


def _paper(inp: dict, *, discount: float, rho_bar: float, c_bar: float) -> tuple[torch.Tensor, torch.Tensor]:
    """v_s and rho_s (r_s + gamma v_{s+1} - V(x_s)), step by step, from the definitions in §4.1-4.2."""
    ratio = (inp["target_logprob"] - inp["behaviour_logprob"]).exp()
    vs, adv = torch.zeros(N, L), torch.zeros(N, L)

    def ends(i: int, t: int) -> bool:
        return bool(inp["terminated"][i, t] or inp["truncated"][i, t])

    def end_value(i: int, t: int) -> float:
        """What follows step t when nothing of its episode follows it in the chunk."""
        if inp["terminated"][i, t]:
            return 0.0
        if inp["truncated"][i, t]:
            return float(inp["bootstrap"][i, t])
        return float(inp["next_value"][i])  # the chunk's last step: V(x_L)

    for i in range(N):
        V = [float(v) for v in inp["value"][i]]
        for s in range(L):
            total, t = V[s], s
            while True:
                v_next = end_value(i, t) if ends(i, t) or t == L - 1 else V[t + 1]
                rho_t = min(rho_bar, float(ratio[i, t]))
                delta = rho_t * (float(inp["reward"][i, t]) + discount * v_next - V[t])
                traces = math.prod(min(c_bar, float(ratio[i, k])) for k in range(s, t))
                total += discount ** (t - s) * traces * delta
                if ends(i, t) or t == L - 1:
                    break
                t += 1
            vs[i, s] = total
        for s in range(L):
            v_next = end_value(i, s) if ends(i, s) or s == L - 1 else float(vs[i, s + 1])
            rho_s = min(rho_bar, float(ratio[i, s]))
            adv[i, s] = rho_s * (float(inp["reward"][i, s]) + discount * v_next - V[s])
    return vs, adv


@pytest.mark.parametrize("rho_bar,c_bar", [(1.0, 1.0), (2.0, 0.5), (0.7, 1.3), (math.inf, math.inf)])
@pytest.mark.parametrize("seed", [0, 1])
def test_recursion_matches_the_sum_of_eq_1(rho_bar, c_bar, seed):
    inp = _inputs(seed)
    out = vtrace(**inp, discount=GAMMA, rho_bar=rho_bar, c_bar=c_bar)
    vs, adv = _paper(inp, discount=GAMMA, rho_bar=rho_bar, c_bar=c_bar)
    assert torch.allclose(out.vs, vs, atol=1e-4), (out.vs - vs).abs().max()
    assert torch.allclose(out.pg_advantage, adv, atol=1e-4), (out.pg_advantage - adv).abs().max()
    ratio = (inp["target_logprob"] - inp["behaviour_logprob"]).exp()
    assert torch.allclose(out.rho, ratio.clamp(max=rho_bar))
    assert (ratio > rho_bar).any() or rho_bar == math.inf  # the truncation is exercised


def test_on_policy_without_truncation_is_the_n_step_return():
    """pi == mu, rho_bar = c_bar = inf: v_s is the bootstrapped n-step return, GAE's lambda = 1 return."""
    inp = _inputs(2)
    inp["target_logprob"] = inp["behaviour_logprob"].clone()
    out = vtrace(**inp, discount=GAMMA, rho_bar=math.inf, c_bar=math.inf)
    gae_inputs = {k: inp[k] for k in ("reward", "value", "next_value", "terminated", "truncated", "bootstrap")}
    advantage, returns = compute_gae(**gae_inputs, discount=GAMMA, gae_lambda=1.0)
    assert torch.allclose(out.vs, returns, atol=1e-5)
    # Written out for the episode that runs to the chunk's end in row 1 (steps 7..L-1):
    r = inp["reward"][1]
    expected = sum(GAMMA ** (t - 7) * r[t] for t in range(7, L)) + GAMMA ** (L - 7) * inp["next_value"][1]
    assert out.vs[1, 7].item() == pytest.approx(expected.item(), abs=1e-5)
    # On-policy, the §4.2 advantage is r_s + gamma v_{s+1} - V(x_s), which with lambda = 1 is GAE's.
    assert torch.allclose(out.pg_advantage, advantage, atol=1e-5)


def test_zero_traces_give_one_step_targets():
    """c_bar = 0 cuts every trace: v_s = V(x_s) + rho_s (r_s + gamma V(x_{s+1}) - V(x_s))."""
    inp = _inputs(3)
    out = vtrace(**inp, discount=GAMMA, rho_bar=1.0, c_bar=0.0)
    one_step, _ = compute_gae(
        **{k: inp[k] for k in ("reward", "value", "next_value", "terminated", "truncated", "bootstrap")},
        discount=GAMMA,
        gae_lambda=0.0,
    )
    assert torch.allclose(out.vs - inp["value"], out.rho * one_step, atol=1e-5)


def test_importance_weights_scale_the_targets():
    """A behaviour policy twice as likely as pi on every action halves every rho and c."""
    inp = _inputs(4)
    inp["target_logprob"] = inp["behaviour_logprob"] - math.log(2.0)
    out = vtrace(**inp, discount=GAMMA)
    assert torch.allclose(out.rho, torch.full((N, L), 0.5))
    half, _ = _paper({**inp}, discount=GAMMA, rho_bar=1.0, c_bar=1.0)
    on = vtrace(**{**inp, "target_logprob": inp["behaviour_logprob"]}, discount=GAMMA)
    assert torch.allclose(out.vs, half, atol=1e-5) and not torch.allclose(out.vs, on.vs, atol=1e-2)


def test_loss_weights_the_policy_gradient_by_pi_over_mu_at_the_current_parameters():
    from mineonline_core.contracts.policy import CategoricalHead

    head = CategoricalHead(4, 3)
    logits = torch.log_softmax(torch.randn(2, 5, 3), -1).requires_grad_(True)
    action = torch.randint(0, 3, (2, 5))
    logprob = head.logprob(action, logits).detach()
    delta, target = torch.randn(2, 5), torch.randn(2, 5)
    kw = dict(
        pi_head=head,
        pi_logits=logits,
        vpred=torch.zeros(2, 5),
        action=action,
        value_target=target,
        pg_delta=delta,
        rho_bar=1.0,
        vf_coef=0.5,
        entropy_coef=0.0,
    )
    # mu twice as likely as pi: rho = 0.5; mu half as likely: rho = 2, truncated to rho_bar = 1.
    for shift, rho in ((math.log(2.0), 0.5), (-math.log(2.0), 1.0)):
        loss, stats = vtrace_loss(**kw, behaviour_logprob=logprob + shift)
        assert stats["policy_loss"].item() == pytest.approx(-(rho * delta * logprob).mean().item(), rel=1e-5)
        assert stats["value_loss"].item() == pytest.approx(0.5 * (target**2).mean().item(), rel=1e-5)
        # No gradient through rho: d loss / d logprob is -rho * delta / numel (vpred is no function of the logits).
        (grad,) = torch.autograd.grad(loss, logits)
        expected = torch.zeros_like(logits).scatter_(-1, action[..., None], (-rho * delta / delta.numel())[..., None])
        assert torch.allclose(grad, expected, atol=1e-6)
