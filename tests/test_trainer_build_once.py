"""The driver builds the policy once (issue 33 row 8): ``resolve`` answers its checks from the meta
build, ``preflight`` builds it at the run's seed, the rank in the driver's process takes that build and
the KL reference is a copy of it, with the weights and RNG state separate builds would give."""

from __future__ import annotations

import torch

from mineonline_core.config import load_config
from mineonline_core.driver.resolve import resolve
from mineonline_core.registry import get_plugin_manager
from mineonline_core.testing.kit import cartpole, mlp_policy
from mineonline_core.trainer import build_loop

BUILDS: list[str] = []  # the device each call of counting_policy built on


def counting_policy() -> torch.nn.Module:
    BUILDS.append(torch.empty(()).device.type)  # "meta" inside the budget's shape-only build
    return mlp_policy(seed=int(torch.randint(0, 1000, ()).item()) if torch.empty(()).device.type != "meta" else 0)


def _trainer(tmp_path, **train):  # type: ignore[no-untyped-def]
    loaded = load_config(
        {
            "output_dir": str(tmp_path),
            "seed": 5,
            "train_config": {"kl_divergence_coef_rho": 0.1, "zero_initial_vf": True, **train},
        }
    )
    loaded.policy_generator, loaded.env_generator = counting_policy, cartpole
    resolved = resolve(loaded, get_plugin_manager())
    return build_loop(
        resolved.trainer_cls,
        rollout_manager=None,
        policy_generator=resolved.policy_generator,
        env_generator=resolved.env_generator,
        config=resolved.config,
        run_dir=str(tmp_path),
        options=resolved.trainer_options,
    )


def _fresh(trainer) -> tuple[torch.nn.Module, torch.Tensor]:  # type: ignore[no-untyped-def]
    """What a build of its own at the run's seed gives, and the RNG state it leaves."""
    torch.manual_seed(trainer.config.seed)
    policy = trainer.policy_generator()
    return policy, torch.random.get_rng_state()


def test_resolve_preflight_rank_and_reference_share_one_build(tmp_path) -> None:
    BUILDS.clear()
    trainer = _trainer(tmp_path)
    trainer.preflight()
    trainer.setup_rank(local=True)
    assert trainer.reference is not None
    assert [b for b in BUILDS if b != "meta"] == ["cpu"]
    # The same numbers as separate builds: the reference is the generator's policy at the seed (its
    # value head not zeroed by init_policy), the trained policy that build after init_policy.
    fresh, _ = _fresh(trainer)
    torch.testing.assert_close(trainer.reference.state_dict(), fresh.state_dict(), rtol=0, atol=0)
    fresh, _ = _fresh(trainer)
    trainer.algorithm.init_policy(fresh)
    torch.testing.assert_close(trainer.policy.state_dict(), fresh.state_dict(), rtol=0, atol=0)
    assert trainer.reference is not trainer.policy
    assert not any(p.requires_grad for p in trainer.reference.parameters())


def test_a_rank_in_another_process_builds_its_own(tmp_path) -> None:
    import pickle

    BUILDS.clear()
    trainer = _trainer(tmp_path)
    trainer.preflight()
    rank = pickle.loads(pickle.dumps(trainer))  # what Ray Train sends to a rank
    assert rank._built is None
    rank.setup_rank(local=True)
    fresh, _ = _fresh(trainer)
    torch.testing.assert_close(rank.reference.state_dict(), fresh.state_dict(), rtol=0, atol=0)
