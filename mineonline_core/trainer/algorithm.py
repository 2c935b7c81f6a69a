"""``Algorithm``: what a trainer plugin subclasses, a loss and a few marked hooks.

A trainer plugin is a ``name``, a ``Config`` (a ``TrainerOptions`` model of the trainer's own
``train_config`` keys, validated into ``self.options``) and ``compute_loss``. Every other method a
plugin may override is marked ``@hook`` here and has a default; ``hook_names()`` lists them, the
trainer conformance suite refuses a subclass that overrides anything else (``unmarked_overrides``),
and the hook table of ``docs/plugins.md`` is generated from the marks (``hook_table``).

The core's ``TrainLoop`` (``trainer/loop.py``) holds the algorithm and calls its hooks: fetching,
the estimate, the update loop, broadcasts, checkpoints, evaluation and goals are the loop's, never
the plugin's. The loop's state reaches the algorithm through ``self.ctx``, a read-only
``TrainContext``: the policy, the optimiser, the KL reference, the iteration, the model version,
the rank and the collectives. An algorithm holds only its options, that view, and what its own hooks
keep (numbers, small tensors): the loop pickles it to the Ray Train ranks as it is, with no list of live
attributes to drop (the loop's own live state is the loop's ``_LIVE``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from pydantic import BaseModel
from torch import nn

from mineonline_core.config._fields import Section
from mineonline_core.config.precision import PrecisionChoice, float16_problem
from mineonline_core.contracts.batch import ModelOutputs, TrainBatch
from mineonline_core.errors import ConfigError
from mineonline_core.registry import replace_between
from mineonline_core.trainer.batch import estimate_advantages
from mineonline_core.trainer.device import fused_adamw

_F = TypeVar("_F", bound=Callable[..., Any])
_MARK = "__mineonline_hook__"


def hook(fn: _F) -> _F:
    """Mark ``fn`` as a hook: a method of ``Algorithm`` that a plugin may override (RLlib's
    ``OverrideToImplementCustomLogic``). Everything unmarked is the loop's."""
    target = fn.__func__ if isinstance(fn, classmethod) else fn
    setattr(target, _MARK, True)
    return fn


def is_hook(value: Any) -> bool:
    return bool(getattr(getattr(value, "__func__", value), _MARK, False))


class TrainerOptions(Section):
    """A trainer's own ``train_config`` keys: subclass it, with a ``Field`` description per key.
    Unknown keys are errors and NaN/inf are never valid numbers, as in the core's sections."""


class TrainContext:
    """The loop's state as an algorithm reads it: read-only, current at every hook call.

    ``policy`` is the bare policy (``pi_head``, ``value_head``), ``model`` what forward and backward go
    through (DDP-wrapped on several ranks), ``reference`` the frozen KL reference or None. The
    collectives (``global_mean_std``, ``all_gather``) reach every rank; call them on every rank."""

    __slots__ = ("_loop",)

    def __init__(self, loop: Any) -> None:
        object.__setattr__(self, "_loop", loop)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"TrainContext is read-only: {name} belongs to the loop")

    def __reduce__(self) -> tuple[Any, ...]:
        return TrainContext, (self._loop,)

    policy = property(lambda self: self._loop.policy, doc="The bare policy being trained.")
    model = property(lambda self: self._loop.model, doc="The module forward/backward go through.")
    optimizer = property(lambda self: self._loop.optimizer, doc="The optimiser of setup_model_and_optimizer.")
    reference = property(lambda self: self._loop.reference, doc="The frozen KL reference, or None.")
    options = property(lambda self: self._loop.options, doc="The algorithm's validated Config.")
    train_config = property(lambda self: self._loop.train_config, doc="The run's train_config section.")
    iteration = property(lambda self: self._loop.iteration, doc="The iteration being trained (1-based).")
    version = property(lambda self: self._loop.version, doc="The model version the rollout workers run.")
    learning_rate = property(lambda self: self._loop.learning_rate, doc="This iteration's learning rate.")
    rank = property(lambda self: self._loop.rank, doc="This Ray Train rank (0 on one rank).")
    world_size = property(lambda self: self._loop.world_size, doc="The number of ranks.")
    device = property(lambda self: self._loop.device, doc="This rank's device.")

    def current_policy_outputs(self, *, batch: dict[str, Any]) -> dict[str, Any]:
        """The current model over whole chunks from their stored recurrent states, without gradients, as the
        update's first step runs it: ``logprob``, ``vpred``, ``value`` (N, L) and ``next_value`` (N,)."""
        return self._loop.current_policy_outputs(batch=batch)

    def global_mean_std(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and (unbiased) standard deviation of ``x`` over every rank's values."""
        return self._loop.global_mean_std(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the first axis."""
        return self._loop.all_gather(x)

    def reference_changed(self) -> None:
        """Say after changing the reference's weights: the next broadcast sends them to the rollout workers."""
        self._loop.reference_changed()


class Algorithm:
    """Subclass, set ``name`` and ``Config``, implement ``compute_loss``; override any ``@hook``.

    ``self.options`` is the validated ``Config``; ``self.ctx`` the loop's state (``TrainContext``),
    set by the loop before the first hook runs."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[BaseModel]] = TrainerOptions
    options: Any
    ctx: TrainContext

    def __init__(self, *, options: BaseModel) -> None:
        self.options = options

    # -- the loss ---------------------------------------------------------------------------------

    @hook
    def compute_loss(self, *, batch: TrainBatch, outputs: ModelOutputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss to minimise over one window of one micro-batch, and scalar metrics (unprefixed,
        logged as ``trainer/<name>``). ``batch``: every per-step column sliced to the window (B, T),
        ``batch[Columns.ADVANTAGE]``; ``outputs``: the policy's ``outputs[Outputs.PI_LOGITS]``,
        ``Outputs.VPRED`` (B, T, the value head's units) and ``Outputs.REF_LOGITS`` (or None).
        ``mineonline_core/contracts/batch.py`` gives every key's dtype, shape and units."""
        raise NotImplementedError(f"{type(self).__name__} implements no compute_loss(*, batch, outputs)")

    # -- the data, once per iteration ------------------------------------------------------------

    @hook
    def estimate(self, *, batch: dict[str, Any]) -> dict[str, Any]:
        """Add ``value``, ``advantage`` and ``return`` ((N, L) float32, values denormalised) to this
        iteration's batch, with the model as it is before the update. Default: GAE with
        ``discount`` and ``gae_lambda``, plus ``logprob_prox`` and ``old_vpred`` from the same pass."""
        ctx, train_config = self.ctx, self.ctx.train_config
        return estimate_advantages(
            ctx.model,
            batch,
            version=ctx.version,
            context_length=train_config.context_length,
            discount=train_config.discount,
            gae_lambda=train_config.gae_lambda,
            batch_size=train_config.batch_size_per_gpu,
            autocast=self.autocast,
        )

    @hook
    def prepare_batch(self, *, batch: dict[str, Any]) -> dict[str, Any]:
        """Once per iteration on the whole rank's batch, before the update (every rank: collectives allowed)."""
        return batch

    @hook
    def prepare_minibatch(self, *, batch: dict[str, Any]) -> dict[str, Any]:
        """Once per micro-batch on its rows (whole chunks), before its windows."""
        return batch

    # -- the model --------------------------------------------------------------------------------

    @hook
    def check_policy(self, policy: nn.Module) -> None:
        """Options that mean nothing for this policy are rejected with the key and the fix (on the
        driver before any rank starts, and on each rank). Overrides call ``super()``."""
        train_config = self.ctx.train_config
        if train_config.use_normalized_vf and not hasattr(getattr(policy, "value_head", None), "update_normalizer"):
            raise ConfigError(
                f"train_config.use_normalized_vf: true needs a value head with a running normaliser, but "
                f"{type(policy).__name__}.value_head has no update_normalizer(). Set use_normalized_vf: false."
            )
        problem = float16_problem(PrecisionChoice.from_config(train_config), policy)
        if problem:
            raise ConfigError(problem)

    @hook
    def init_policy(self, policy: nn.Module) -> None:
        """Change the freshly built policy before a checkpoint's weights are loaded into it (PPO's
        ``zero_initial_vf``); runs on every rank with the same seed."""

    @hook
    def setup_model_and_optimizer(self, policy: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Return the module to train (usually ``policy`` itself) and its optimiser. Default: AdamW
        over the parameters that require gradients, with ``learning_rate``, ``adam_eps`` and
        ``weight_decay``."""
        train_config = self.ctx.train_config
        trainable = [p for p in policy.parameters() if p.requires_grad]
        return policy, torch.optim.AdamW(
            trainable,
            lr=train_config.learning_rate,
            eps=train_config.adam_eps,
            weight_decay=train_config.weight_decay,
            fused=fused_adamw(trainable),
        )

    @hook
    @classmethod
    def has_reference(cls, options: BaseModel) -> bool:
        """Whether a run with these options keeps a frozen KL reference (a copy of the initial policy,
        ``ctx.reference``): the loop builds it, rollout runs it, and the pre-Ray memory estimate counts it."""
        return False

    @hook
    def uses_reference(self) -> bool:
        """Whether this iteration runs the KL reference beside the policy (``outputs["ref_logits"]``)."""
        return self.ctx.reference is not None

    @hook
    def autocast(self) -> contextlib.AbstractContextManager:
        """The numerics of every training-side forward (the update's and the estimate pass's)."""
        # One decision for rollout and training (config/precision.py): rollout infers in the same dtype.
        return PrecisionChoice.from_config(self.ctx.train_config).on(self.ctx.device).autocast()

    # -- the update -------------------------------------------------------------------------------

    @hook
    def filter_gradients(self) -> None:
        """Called with unscaled gradients before clipping: set ``param.grad = None`` to leave a parameter out."""

    @hook
    def publishes_version(self, iteration: int) -> bool:
        """Whether ``iteration`` ends with a new model version broadcast to the rollout workers."""
        return True

    @hook
    def iteration_metrics(self) -> dict[str, float]:
        """Extra metrics (``trainer/...``) of the iteration just trained, logged with the loop's."""
        return {}

    # -- checkpoints ------------------------------------------------------------------------------

    @hook
    def trainer_state(self) -> dict[str, Any]:
        """Extra state to checkpoint (tensors, numbers, lists, dicts only)."""
        return {}

    @hook
    def load_trainer_state(self, state: dict[str, Any]) -> None:
        """Restore what ``trainer_state`` returned."""

    @hook
    def on_checkpoint(self, path: Path | None) -> None:
        """Called on every rank after a checkpoint of the current iteration was written."""


def hook_names(cls: type = Algorithm) -> list[str]:
    """The marked hooks of ``cls``, in the order ``Algorithm`` declares them."""
    return [name for name, value in vars(Algorithm).items() if is_hook(value) and hasattr(cls, name)]


def unmarked_overrides(cls: type, *, machinery: tuple[type, ...] = ()) -> list[str]:
    """The names ``cls`` (or a plugin class between it and the core's) defines that a core class also
    defines unmarked: ``Algorithm``'s own attributes, and any class in ``machinery`` (the loop's), which
    an algorithm's method of the same name would only seem to replace."""
    core = (Algorithm, *machinery)
    owned = {c for base in core for c in base.__mro__}
    unmarked: set[str] = set()
    for base in owned:
        unmarked |= {n for n, v in vars(base).items() if not n.startswith("__") and not is_hook(v)}
        unmarked |= {n for n in getattr(base, "__annotations__", {}) if not n.startswith("__")}
    unmarked -= {"name", "Config", *hook_names()}
    found: list[str] = []
    for klass in cls.__mro__:
        if klass in owned or klass is object:
            continue
        found += [n for n in vars(klass) if n in unmarked and n not in found]
    return sorted(found)


def hook_table() -> str:
    """The markdown table of ``Algorithm``'s hooks, from the marks: each hook's signature and its doc's first sentence."""
    import inspect

    rows = ["| Hook | What it is for |", "|---|---|"]
    for name in hook_names():
        fn = getattr(Algorithm, name)
        params = [p for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]
        star = "*, " if params and params[0].kind is inspect.Parameter.KEYWORD_ONLY else ""
        summary = " ".join((fn.__doc__ or "").split()).split(". ")[0].rstrip(".")
        kind = " (classmethod)" if isinstance(vars(Algorithm)[name], classmethod) else ""
        required = " Required." if name == "compute_loss" else ""
        summary = summary.replace("``", "`")
        rows.append(f"| `{name}({star}{', '.join(p.name for p in params)})`{kind} | {summary}.{required} |")
    return "\n".join(rows) + "\n"


# The hook table of docs/plugins.md sits between these lines; `mineonline plugins --table --output FILE`
# rewrites it there with the kind table, and tests/test_algorithm.py checks the committed page.
HOOK_TABLE_BEGIN = (
    "<!-- hook table: generated from the @hook marks of mineonline_core/trainer/algorithm.py by `make docs` -->"
)
HOOK_TABLE_END = "<!-- end of hook table -->"


def with_hook_table(page: str) -> str:
    """``page`` with the text between its hook-table markers replaced by ``hook_table()``."""
    return replace_between(page, HOOK_TABLE_BEGIN, HOOK_TABLE_END, hook_table(), what="hook table")
