"""The five kinds of component a plugin registers, one record each.

Everything the core says about a kind comes from its ``Kind`` here: the registration hook spec and its
docstring (``hookspecs.py``), the check of a registered class and the unknown-name error
(``registry.py``), the listing of ``mineonline plugins`` and the kind table in ``docs/plugins.md``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of component: what registers it, what it subclasses and which config key selects it."""

    name: str  # the registry's key: "trainer", "replay_store", ...
    plural: str  # as listings and errors name several: "trainers", "replay stores"
    hook: str  # the registration hook spec's name
    base: str  # the defining module and class; exported by ``mineonline_core`` under the class's name
    config_key: str  # the full dotted config key whose value names the component
    example: str  # a registered name, for the docs
    contract: str  # what a class of this kind provides beyond ``name`` and ``Config``
    many: bool = False  # the config key holds a list of names (several loggers at once)
    # Names whose distribution is known, for the "pip install" hint of an unknown-name error.
    distributions: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        """The kind in a sentence: ``replay store``."""
        return self.name.replace("_", " ")

    @property
    def base_module(self) -> str:
        return self.base.rpartition(".")[0]

    @property
    def base_name(self) -> str:
        return self.base.rpartition(".")[2]

    @property
    def exported_base(self) -> str:
        """The base class as a plugin imports it (plugins import only ``mineonline_core``'s exports)."""
        return f"mineonline_core.{self.base_name}"

    def distribution(self, name: str) -> str | None:
        """The distribution that ships the well-known component ``name``, if it is one."""
        return dict(self.distributions).get(name)


KINDS: tuple[Kind, ...] = (
    Kind(
        name="trainer",
        plural="trainers",
        hook="mineonline_register_trainers",
        base="mineonline_core.trainer.algorithm.Algorithm",
        config_key="trainer_name",
        example="PPOTrainer",
        contract="its ``Config`` is a ``mineonline_core.TrainerOptions`` validating the trainer's own "
        "``train_config`` keys, the ones the core does not own",
        distributions=(("PPOTrainer", "mineonline-ppo"),),
    ),
    Kind(
        name="replay_store",
        plural="replay stores",
        hook="mineonline_register_replay_stores",
        base="mineonline_core.contracts.store.FragmentStore",
        config_key="rollout_config.replay_buffer_config.database_config.backend",
        example="lmdb",
        contract="its ``Config`` validates the backend's extra ``database_config`` keys",
        distributions=(("lmdb", "mineonline-lmdb-buffer"),),
    ),
    Kind(
        name="logger",
        plural="loggers",
        hook="mineonline_register_loggers",
        base="mineonline_core.contracts.logger.Logger",
        config_key="logger_config.loggers",
        many=True,
        example="wandb",
        contract="its ``Config`` validates the keys of ``logger_config`` it consumes",
        distributions=(("wandb", "mineonline-wandb-logger"),),
    ),
    Kind(
        name="policy",
        plural="policies",
        hook="mineonline_register_policies",
        base="mineonline_core.contracts.policy.Policy",
        config_key="policy_config.name",
        example="mlp",
        contract="it implements ``build(options, *, observation_space, action_space)``; selected in runs "
        "without a Python module",
        distributions=(("vpt", "mineonline-vpt-policy"),),
    ),
    Kind(
        name="env",
        plural="env factories",
        hook="mineonline_register_envs",
        base="mineonline_core.contracts.envs.EnvFactory",
        config_key="env_config.name",
        example="crafter",
        contract="it implements ``build(options) -> gymnasium.Env``; selected in runs without a Python module",
    ),
)

BY_NAME: dict[str, Kind] = {kind.name: kind for kind in KINDS}
