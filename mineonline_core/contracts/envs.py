"""The env contract: what an env plugin implements and what the rollout loop relies on.

An env plugin registers an ``EnvFactory`` subclass (``mineonline_register_envs``) with a ``name``
(what ``env_config.name`` selects), a pydantic ``Config`` of its options (the other keys of
``env_config``, validated before Ray starts) and a ``build(options)`` classmethod. ``build`` returns a
gymnasium env that honours, in the env's own subprocess:

* ``observation_space`` is a ``gymnasium.spaces.Dict``; every observation lies in it, with fixed
  shapes (fragments stack them). By convention ``{"image": uint8 (H, W, 3)}`` or ``{"obs": float32}``.
* ``reset(seed=None, options=None) -> (obs, info)``; with a seed, the same seed gives the same first
  observation where the env can be seeded.
* ``step(action) -> (obs, reward, terminated, truncated, info)`` for any action of
  ``action_space``: ``reward`` a finite float; ``terminated`` a true end (nothing to bootstrap);
  ``truncated`` a cut (time limit: the value of ``obs`` is bootstrapped); after either the loop
  calls ``reset``. ``info["achievements"]`` (at an episode's end) and ``info["task"]`` are optional.
* ``close()`` releases the env's resources and may be called once, after any of the above.

``mineonline_core.builtin.envs.adapt_env`` turns old-gym and MineStudio envs into such an env;
``mineonline_core.testing.env_conformance`` checks a factory against this contract.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, ClassVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # gymnasium is imported by the env's own process, not by whoever reads the contract
    import gymnasium


class EnvFactory:
    """Base class of registered envs: ``build(options)`` returns a gymnasium env (see the module docs)."""

    #: The name ``env_config.name`` selects.
    name: ClassVar[str] = ""

    class Config(BaseModel):
        """The factory's options: the keys of ``env_config`` other than ``name``."""

        model_config = ConfigDict(extra="forbid")

    @classmethod
    def build(cls, options: BaseModel) -> gymnasium.Env:
        """A new env (a ``gymnasium.Env``) for ``options``, an instance of ``cls.Config``."""
        raise NotImplementedError


def env_generator_from_config(env_cls: type[EnvFactory], options: BaseModel) -> Callable[[], gymnasium.Env]:
    """A picklable zero-argument env generator for a registered env and its validated options."""
    return functools.partial(env_cls.build, options)
