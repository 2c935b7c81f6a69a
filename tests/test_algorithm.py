"""A trainer plugin subclasses ``Algorithm``: a few marked hooks, the loop's state read through a read-only
context, and a conformance suite that refuses a class redefining anything unmarked."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from mineonline_ppo import PPOTrainer

from mineonline_core.config import OnlineConfig, load_config
from mineonline_core.driver.resolve import resolve_trainer
from mineonline_core.errors import ConfigError
from mineonline_core.registry import PluginManager
from mineonline_core.testing.fixtures import registered
from mineonline_core.testing.kit import local_loop
from mineonline_core.testing.trainer_conformance import TrainerConformance
from mineonline_core.trainer import Algorithm, BaseTrainer, TrainLoop
from mineonline_core.trainer.algorithm import hook_names, hook_table, with_hook_table
from tests.conftest import cartpole_config
from tests.test_plugins import plugin_module

PAGE = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


class Loss(Algorithm):
    name = "Loss"

    def compute_loss(self, *, batch: dict, outputs: dict) -> tuple[torch.Tensor, dict]:
        return outputs["vpred"].mean(), {}


class RedefinesTrain(Loss):
    """Means to change the update, but ``train`` is the loop's: the loop would never call this."""

    name = "RedefinesTrain"

    def train(self, batch: dict) -> dict:
        return {}


class OverridesFetch(BaseTrainer):
    """The base class before ``Algorithm``: a loop itself, so redefining ``fetch_chunks`` replaces machinery."""

    name = "OverridesFetch"

    def compute_loss(self, *, batch: dict, outputs: dict) -> tuple[torch.Tensor, dict]:
        return outputs["vpred"].mean(), {}

    def fetch_chunks(self, num_chunks: int, for_version: int | None = None, for_iteration: int | None = None) -> dict:
        return {}


def _conformance(cls: type) -> TrainerConformance:
    return type(f"Test{cls.__name__}", (TrainerConformance,), {"trainer_cls": cls})()


def _assert_names_the_method_and_the_hooks(message: str, method: str) -> None:
    assert f"overrides {method}, which is not marked @hook" in message, message
    assert "Move that logic into a hook (compute_loss, estimate," in message and "on_checkpoint)" in message


@pytest.mark.parametrize(("cls", "method"), [(RedefinesTrain, "train"), (OverridesFetch, "fetch_chunks")])
def test_the_conformance_suite_refuses_a_class_that_redefines_an_unmarked_method(cls: type, method: str) -> None:
    with pytest.raises(ConfigError) as info:
        _conformance(cls).test_overrides_only_the_marked_hooks()
    _assert_names_the_method_and_the_hooks(str(info.value), method)


@pytest.mark.parametrize(("cls", "method"), [(RedefinesTrain, "train"), (OverridesFetch, "fetch_chunks")])
def test_a_run_refuses_such_a_class_when_it_resolves_the_trainer(
    plugin_manager: PluginManager, cls: type, method: str
) -> None:
    """The check a run makes before Ray starts (``mineonline run`` and ``check`` resolve the trainer first)."""
    loaded = load_config(cartpole_config(trainer_name=cls.name))
    bad = plugin_module("bad", mineonline_register_trainers=lambda register: register(cls))
    with registered(plugin_manager, bad), pytest.raises(ConfigError) as info:
        resolve_trainer(loaded, plugin_manager)
    assert str(info.value).startswith(f"trainer_name={cls.name}: tests.test_algorithm.{cls.__name__} overrides")
    _assert_names_the_method_and_the_hooks(str(info.value), method)


def test_a_class_that_overrides_only_hooks_passes() -> None:
    _conformance(Loss).test_overrides_only_the_marked_hooks()
    _conformance(PPOTrainer).test_overrides_only_the_marked_hooks()


def test_a_plugin_authors_surface_is_the_marked_hooks_and_four_names() -> None:
    public = {n for c in Algorithm.__mro__[:-1] for n in [*vars(c), *c.__annotations__] if not n.startswith("_")}
    assert public == {"name", "Config", "options", "ctx", *hook_names()}
    assert len(public) <= 20 and hook_names()[0] == "compute_loss"


def test_the_committed_hook_table_is_generated_from_the_marks() -> None:
    page = PAGE.read_text(encoding="utf-8")
    assert hook_table() in page
    assert page == with_hook_table(page), (
        "docs/plugins.md's hook table is stale: run `mineonline plugins --table --output docs/plugins.md`."
    )
    assert all(f"| `{name}(" in hook_table() for name in hook_names())


def _loop(tmp_path: Path) -> TrainLoop:
    config = OnlineConfig(train_config={"kl_divergence_coef_rho": 0.1})
    loop = local_loop(PPOTrainer, config, run_dir=str(tmp_path))
    return loop


def test_the_context_reads_the_loop_and_cannot_change_it(tmp_path: Path) -> None:
    loop = _loop(tmp_path)
    ctx = loop.algorithm.ctx
    assert ctx.policy is loop.policy and ctx.reference is loop.reference is not None and ctx.options is loop.options
    loop.iteration = 3
    assert ctx.iteration == 3 and loop.algorithm.rho == pytest.approx(0.1 * 0.9995**2)
    with pytest.raises(AttributeError, match="read-only"):
        ctx.iteration = 4


def test_the_loop_pickles_with_its_algorithm_and_without_live_state(tmp_path: Path) -> None:
    loop = _loop(tmp_path)
    assert set(vars(loop.algorithm)) == {"options", "ctx"}  # an algorithm keeps nothing of the loop's
    copy = pickle.loads(pickle.dumps(loop))
    assert copy.policy is None and copy.reference is None and copy.optimizer is None
    assert copy.algorithm.ctx._loop is copy and copy.algorithm.options == loop.options
