"""The core's own components, registered through the same hooks as any plugin."""

from __future__ import annotations

from mineonline_core.contracts.hookspecs import Register, hookimpl


@hookimpl
def mineonline_register_replay_stores(register: Register) -> None:
    from mineonline_core.contracts.store import MemoryStore

    register(MemoryStore)


@hookimpl
def mineonline_register_loggers(register: Register) -> None:
    from mineonline_core.builtin.console import ConsoleLogger

    register(ConsoleLogger)


@hookimpl
def mineonline_register_policies(register: Register) -> None:
    from mineonline_core.builtin.models import (
        CNNPolicy,
        ImpalaResNetPolicy,
        MLPPolicy,
        RecurrentCNNPolicy,
        RecurrentMLPPolicy,
    )

    register(MLPPolicy)
    register(RecurrentMLPPolicy)
    register(CNNPolicy)
    register(RecurrentCNNPolicy)
    register(ImpalaResNetPolicy)


@hookimpl
def mineonline_register_envs(register: Register) -> None:
    from mineonline_core.builtin.envs import CrafterEnv, GymnasiumEnv, MineStudioEnv

    register(GymnasiumEnv)
    register(CrafterEnv)
    register(MineStudioEnv)
