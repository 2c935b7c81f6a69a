"""Resolve a loaded config into the components a run needs, before Ray starts.

Everything a user can get wrong is checked here, cheaply and up front: component names, each
component's own options (the trainer's: the ``train_config`` keys the core does not own), the env
and policy generators (serialisable, and they run), and the consistency of the config with itself.
``mineonline check`` stops after this step.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from typing import Any, Callable

from pydantic import BaseModel

from mineonline_core.config import LoadedConfig, OnlineConfig, check_consistency
from mineonline_core.config.secrets import REDACTED, is_secret_key, redact
from mineonline_core.config.generators import import_generator
from mineonline_core.config.messages import validate_options, validate_trainer_options
from mineonline_core.config.trainer_keys import set_aside_foreign_keys
from mineonline_core.errors import ConfigError, MineOnlineError, closest
from mineonline_core.registry import PluginManager

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ResolvedRun:
    """A validated config with every component resolved to a class and validated options."""

    config: OnlineConfig
    env_generator: Callable[[], Any]
    policy_generator: Callable[[], Any]
    trainer_cls: type
    store_cls: type
    store_options: BaseModel
    loggers: list[tuple[type, BaseModel]]
    observation_space: Any
    action_space: Any
    source_text: str | None = None
    source_path: str | None = None
    memory: Any = None  # budget.MemoryEstimate, when the generators were probed
    trainer_options: BaseModel | None = None  # the trainer's own train_config keys, validated


def _picklable(obj: Any, what: str) -> None:
    from ray import cloudpickle

    try:
        cloudpickle.dumps(obj)
    except Exception as exc:  # noqa: BLE001 - any pickling failure means the same thing to the user
        raise ConfigError(
            f"{what} cannot be serialised to send it to Ray workers ({type(exc).__name__}: {exc}). Fix: define "
            f"it at module level in the config file and avoid capturing open files, locks or live objects."
        ) from None


def _call(generator: Callable[[], Any], what: str) -> Any:
    try:
        return generator()
    except MineOnlineError:
        raise
    except Exception as exc:  # noqa: BLE001 - report the user's own error, whatever it is
        raise ConfigError(
            f"{what} raised {type(exc).__name__}: {exc}. It runs in every rollout worker and trainer rank, so "
            f"it must work here first. Fix the generator (run it in a Python shell to see the full traceback)."
        ) from exc


def _build_policy(policy_cls: type, options: BaseModel, observation_space: Any, action_space: Any) -> Any:
    return policy_cls.build(options, observation_space=observation_space, action_space=action_space)


def _prepared_policy(policy_generator: Callable[[], Any], use_normalized_vf: bool, normalization: Any = None) -> Any:
    from mineonline_core.contracts.policy import prepare_policy

    policy = prepare_policy(policy_generator(), use_normalized_vf=use_normalized_vf)
    # train_config.normalize_observations/_rewards: statistics the policy owns (contracts/normalize.py).
    return normalization.attach(policy) if normalization is not None else policy


def resolve_trainer(loaded: LoadedConfig, pm: PluginManager) -> tuple[type, BaseModel]:
    """The selected trainer class and its options: the ``train_config`` keys the core does not own,
    validated against its ``Config`` (an unknown key names the key, the trainer and close matches).
    Keys another installed trainer owns are set aside with one warning (``config/trainer_keys.py``)."""
    trainer_cls = pm.lookup("trainer", loaded.config.trainer_name)
    check_overrides(trainer_cls)
    trainers = [(name, cls) for name, cls, _ in pm.registries["trainer"].items()]
    warning = set_aside_foreign_keys(trainer_cls, loaded.config.train_config, trainers)
    if warning:
        log.warning(warning)
    return trainer_cls, validate_trainer_options(trainer_cls, loaded.config.train_config, origins=loaded.origins)


def check_overrides(trainer_cls: type) -> None:
    """Refuse a trainer class that redefines a method of the loop or of ``Algorithm`` not marked ``@hook``:
    the loop never calls it as its author meant (or the class replaces the loop's machinery), and the run
    would train on without a word. The trainer conformance suite checks the same for a plugin's tests."""
    from mineonline_core.trainer.algorithm import hook_names, unmarked_overrides
    from mineonline_core.trainer.base import BaseTrainer

    found = unmarked_overrides(trainer_cls, machinery=(BaseTrainer,))
    if found:
        raise ConfigError(
            f"trainer_name={trainer_cls.name}: {trainer_cls.__module__}.{trainer_cls.__qualname__} overrides "
            f"{', '.join(found)}, which {'is' if len(found) == 1 else 'are'} not marked @hook: the training "
            f"loop's own, which a trainer does not replace. Move that logic into a hook "
            f"({', '.join(hook_names())}) or rename the method."
        )


def resolve(loaded: LoadedConfig, pm: PluginManager, *, probe: bool = True, isolate: bool = False) -> ResolvedRun:
    """Resolve every component of ``loaded`` with ``pm``; raise one clear error for the first problem.

    ``probe`` builds the env (for its spaces) and the policy; with ``isolate`` the env is built, reset
    and stepped in a subprocess with the workers' time limits (``envcheck.probe_env``), as
    ``mineonline run`` and ``mineonline check`` do."""
    cfg = loaded.config
    trainer_cls, trainer_options = resolve_trainer(loaded, pm)
    db = cfg.rollout_config.replay_buffer_config.database_config
    store_cls = pm.lookup("replay_store", db.backend)
    store_options = validate_options(
        store_cls, db.model_extra, section="rollout_config.replay_buffer_config.database_config"
    )

    logger_names = ["console", *[n for n in cfg.logger_config.loggers if n != "console"]]
    logger_classes = [pm.lookup("logger", n) for n in logger_names]
    extra = dict(cfg.logger_config.model_extra or {})
    consumed = {field for cls in logger_classes for field in cls.Config.model_fields}
    unknown = sorted(set(extra) - consumed)
    if unknown:
        hint = closest(unknown[0], sorted(consumed))
        raise ConfigError(
            f"logger_config.{unknown[0]}: no selected logger ({', '.join(logger_names)}) uses this key (value "
            f"{REDACTED if is_secret_key(unknown[0]) else redact(extra[unknown[0]])!r})."
            + (f" Did you mean {hint!r}?" if hint else "")
            + f" Keys the selected loggers accept: {', '.join(sorted(consumed)) or 'none'}."
        )
    logger_data = {"project": cfg.logger_config.project, "name": cfg.logger_config.name, **extra}
    loggers = [(cls, validate_options(cls, logger_data, section="logger_config")) for cls in logger_classes]

    gens = resolve_generators(
        loaded,
        pm,
        probe=probe,
        isolate=isolate,
        store_cls=store_cls,
        reference=trainer_cls.has_reference(trainer_options),
    )
    check_consistency(cfg)
    return ResolvedRun(
        config=cfg,
        env_generator=gens.env_generator,
        policy_generator=gens.policy_generator,
        trainer_cls=trainer_cls,
        store_cls=store_cls,
        store_options=store_options,
        loggers=loggers,
        observation_space=gens.observation_space,
        action_space=gens.action_space,
        source_text=loaded.source_text,
        source_path=loaded.source_path,
        memory=gens.memory,
        trainer_options=trainer_options,
    )


@dataclasses.dataclass
class Generators:
    """The env and policy generators of a config, and the env's spaces when probed."""

    env_generator: Callable[[], Any]
    policy_generator: Callable[[], Any]
    observation_space: Any = None
    action_space: Any = None
    memory: Any = None  # budget.MemoryEstimate when probed


def resolve_generators(
    loaded: LoadedConfig,
    pm: PluginManager,
    *,
    probe: bool = True,
    isolate: bool = False,
    store_cls: type | None = None,
    reference: bool = False,
) -> Generators:
    """The env and policy generators alone (what ``mineonline eval`` needs: no trainer, store or logger).
    ``store_cls`` sizes the replay part of the memory estimate, ``reference`` (the trainer keeps a KL
    reference policy) its reference copies."""
    from mineonline_core.contracts.envs import env_generator_from_config

    cfg = loaded.config
    env_generator = loaded.env_generator
    if env_generator is None and cfg.env_generator is not None:
        env_generator = import_generator(cfg.env_generator, key="env_generator")
    if env_generator is None:
        if cfg.env_config is None:
            raise ConfigError(
                "env_config: the config names no env. Fix: add env_config: {name: gymnasium, id: CartPole-v1} "
                "(see `mineonline plugins` for env names), or use a Python config module defining env_generator()."
            )
        env_cls = pm.lookup("env", cfg.env_config.name)
        env_generator = env_generator_from_config(
            env_cls, validate_options(env_cls, cfg.env_config.model_extra, section="env_config")
        )
    elif cfg.env_config is not None:
        raise ConfigError(
            "env_config: the config module defines env_generator and the config sets env_config too. Fix: keep one."
        )
    _picklable(env_generator, "env_generator")

    observation_space = action_space = None
    if probe and isolate:
        from mineonline_core.driver.envcheck import probe_env

        wc = cfg.rollout_config.worker_config
        # The policy is built next, which imports torch (most of a second): import it while the env probes.
        observation_space, action_space = probe_env(
            env_generator,
            startup_timeout=max(wc.step_timeout, 120.0),
            step_timeout=wc.step_timeout,
            meanwhile=lambda: importlib.import_module("torch"),
        )
    elif probe:
        from mineonline_core.contracts.envs import adapt_env

        env = adapt_env(_call(env_generator, "env_generator()"))
        observation_space, action_space = env.observation_space, env.action_space
        env.close()

    policy_generator = loaded.policy_generator
    if policy_generator is None and cfg.policy_generator is not None:
        policy_generator = import_generator(cfg.policy_generator, key="policy_generator")
    if policy_generator is None:
        if cfg.policy_config is None:
            raise ConfigError(
                "policy_config: the config names no policy. Fix: add policy_config: {name: mlp} (vector observations), "
                "{name: cnn_gru} (images) or {name: vpt, model_path: ...}, or define policy_generator() in a "
                "Python config."
            )
        policy_cls = pm.lookup("policy", cfg.policy_config.name)
        options = validate_options(
            policy_cls, cfg.policy_config.model_extra, section="policy_config", origins=loaded.origins
        )
        policy_generator = functools.partial(_build_policy, policy_cls, options, observation_space, action_space)
    elif cfg.policy_config is not None:
        raise ConfigError(
            "policy_config: the config module defines policy_generator and the config sets policy_config too. "
            "Fix: keep one."
        )
    # Every process that builds the policy (rollout workers, trainer ranks, the KL reference) must agree
    # on the value head's scale, so the run-wide settings are applied inside the generator itself.
    from mineonline_core.contracts.normalize import normalization_for

    normalization = normalization_for(
        normalize_observations=cfg.train_config.normalize_observations,
        normalize_rewards=cfg.train_config.normalize_rewards,
        observation_space=observation_space,
    )
    policy_generator = functools.partial(
        _prepared_policy, policy_generator, cfg.train_config.use_normalized_vf, normalization
    )
    _picklable(policy_generator, "policy_generator")
    memory = None
    if probe:
        from mineonline_core.driver.budget import estimate_memory

        memory = estimate_memory(cfg, policy_generator, observation_space, action_space, store_cls, reference=reference)
        memory.check_policy_fits()  # measured on the meta device: a huge network is refused, not allocated
        from mineonline_core.config.precision import PrecisionChoice, float16_problem

        # The meta build answers what the checks here ask (the class, its flags); a real build, seconds for
        # VPT-2x, only when the generator cannot build on the meta device, so that its error shows before Ray.
        policy = memory.policy if memory.policy is not None else _call(policy_generator, "policy_generator()")
        problem = float16_problem(PrecisionChoice.from_config(cfg.train_config), policy)
        if problem:  # before Ray: a float16 overflow would otherwise surface at the first training step
            raise ConfigError(problem)

    return Generators(env_generator, policy_generator, observation_space, action_space, memory)
