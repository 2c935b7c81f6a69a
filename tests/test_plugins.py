"""The plugin system: discovery, failures, duplicates, unknown names and every hook spec."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import importlib_metadata
import pytest

from mineonline_core import hookimpl
from mineonline_core.contracts import hookspecs
from mineonline_core.errors import DuplicateComponentError, InvalidComponentError, UnknownComponentError
from mineonline_core.contracts.kinds import BY_NAME
from mineonline_core.registry import PluginManager, get_plugin_manager
from mineonline_core.contracts.store import MemoryStore
from mineonline_core.testing.fixtures import registered

ROOT = Path(__file__).resolve().parents[1]


class FakeDist:
    def __init__(self, name: str, version: str) -> None:
        self.metadata = {"Name": name}
        self.version = version


class FakeEntryPoint:
    """Stands in for an installed plugin's entry point, as pluggy's own tests monkeypatch metadata."""

    def __init__(self, name: str, plugin: object, dist: str = "mineonline-fake", version: str = "1.2.3") -> None:
        self.name, self._plugin, self.dist, self.group = name, plugin, FakeDist(dist, version), "mineonline"

    def load(self) -> object:
        if isinstance(self._plugin, Exception):
            raise self._plugin
        return self._plugin


def make_store(name: str) -> type:
    return type(f"{name.title()}Store", (MemoryStore,), {"name": name})


def plugin_module(name: str, **hooks: object) -> types.ModuleType:
    module = types.ModuleType(name)
    for hook_name, function in hooks.items():
        setattr(module, hook_name, hookimpl(function))
    return module


@pytest.fixture
def entry_points(monkeypatch: pytest.MonkeyPatch) -> list[FakeEntryPoint]:
    points: list[FakeEntryPoint] = []
    monkeypatch.setattr(importlib_metadata, "entry_points", lambda group: [p for p in points if p.group == group])
    return points


def test_core_defaults_are_registered(plugin_manager: PluginManager) -> None:
    assert {"memory"} <= set(plugin_manager.registries["replay_store"].names())
    assert {"console"} <= set(plugin_manager.registries["logger"].names())
    assert {"mlp", "cnn_gru"} <= set(plugin_manager.registries["policy"].names())
    assert {"gymnasium", "crafter", "minestudio"} <= set(plugin_manager.registries["env"].names())
    assert plugin_manager.registries["logger"].origin("console").distribution == "mineonline-core"


def test_entry_point_discovery(entry_points: list[FakeEntryPoint]) -> None:
    store = make_store("fast")
    entry_points.append(
        FakeEntryPoint(
            "fast", plugin_module("fast", mineonline_register_replay_stores=lambda register: register(store))
        )
    )
    pm = get_plugin_manager()
    assert pm.lookup("replay_store", "fast") is store
    origin = pm.registries["replay_store"].origin("fast")
    assert (origin.distribution, origin.version, origin.plugin) == ("mineonline-fake", "1.2.3", "fast")


def test_broken_plugin_does_not_break_others(entry_points: list[FakeEntryPoint]) -> None:
    store = make_store("good")
    entry_points.append(FakeEntryPoint("broken", ImportError("No module named 'lmdb'"), dist="mineonline-broken"))
    entry_points.append(
        FakeEntryPoint(
            "good", plugin_module("good", mineonline_register_replay_stores=lambda register: register(store))
        )
    )
    pm = get_plugin_manager()
    assert pm.lookup("replay_store", "good") is store
    (failure,) = pm.load_failures
    assert (failure.entry_point, failure.distribution) == ("broken", "mineonline-broken")
    assert "No module named 'lmdb'" in failure.error
    with pytest.raises(UnknownComponentError) as info:
        pm.lookup("replay_store", "lmdb")
    assert "mineonline-broken" in str(info.value) and "No module named 'lmdb'" in str(info.value)


def test_duplicate_name_names_both_origins(entry_points: list[FakeEntryPoint]) -> None:
    entry_points.append(
        FakeEntryPoint(
            "first",
            plugin_module("first", mineonline_register_replay_stores=lambda register: register(make_store("dup"))),
            dist="dist-one",
        )
    )
    entry_points.append(
        FakeEntryPoint(
            "second",
            plugin_module("second", mineonline_register_replay_stores=lambda register: register(make_store("dup"))),
            dist="dist-two",
        )
    )
    with pytest.raises(DuplicateComponentError) as info:
        get_plugin_manager()
    assert "dist-one" in str(info.value) and "dist-two" in str(info.value) and "'dup'" in str(info.value)


def test_misspelled_hook_is_caught_at_startup(entry_points: list[FakeEntryPoint]) -> None:
    module = plugin_module("typo", mineonline_register_trainer=lambda register: None)
    entry_points.append(FakeEntryPoint("typo", module))
    with pytest.raises(Exception, match="mineonline_register_trainer"):
        get_plugin_manager()


def test_unknown_name_message(plugin_manager: PluginManager) -> None:
    with pytest.raises(UnknownComponentError) as info:
        plugin_manager.lookup("replay_store", "memroy")
    message = str(info.value)
    assert "rollout_config.replay_buffer_config.database_config.backend" in message
    assert "Did you mean 'memory'" in message
    assert "mineonline-core" in message and "pip install" in message


def test_component_without_name_is_rejected(plugin_manager: PluginManager) -> None:
    nameless = type("Nameless", (MemoryStore,), {"name": ""})
    with pytest.raises(InvalidComponentError, match="no string class attribute 'name'"):
        with registered(
            plugin_manager,
            plugin_module("nameless", mineonline_register_replay_stores=lambda register: register(nameless)),
        ):
            pass


@pytest.mark.parametrize("kind", sorted(BY_NAME))
def test_a_class_that_is_not_a_component_is_refused_naming_the_plugin_and_the_base(
    plugin_manager: PluginManager, kind: str
) -> None:
    class NotAComponent:
        name = "Bogus"

    module = plugin_module("bogus", **{BY_NAME[kind].hook: lambda register: register(NotAComponent)})
    with pytest.raises(InvalidComponentError) as info:
        with registered(plugin_manager, module, name="bogus", distribution="mineonline-bogus", version="0.3"):
            pass
    base_module, base = BY_NAME[kind].base_module, BY_NAME[kind].base_name
    message = str(info.value)
    assert "mineonline-bogus 0.3 (plugin 'bogus')" in message and "NotAComponent" in message
    assert f"does not subclass {base_module}.{base}" in message and "'Config' is not a pydantic model" in message
    assert "no string class attribute 'name'" not in message  # it has one
    assert "Bogus" not in plugin_manager.registries[kind] and not plugin_manager.is_registered(module)  # none of it


def test_a_trainer_with_a_config_that_is_not_a_pydantic_model_is_refused(plugin_manager: PluginManager) -> None:
    from mineonline_core.trainer import BaseTrainer

    bare = type("NotATrainer", (), {"name": "Bogus"})  # the issue's own example
    wrong_config = type("DictConfigTrainer", (BaseTrainer,), {"name": "DictConfig", "Config": dict})
    for cls, expected in (
        (bare, "does not subclass mineonline_core.trainer.algorithm.Algorithm"),
        (wrong_config, "'Config' is not a pydantic model class"),
    ):
        module = plugin_module("bad", mineonline_register_trainers=lambda register, cls=cls: register(cls))
        with pytest.raises(InvalidComponentError, match=expected):
            with registered(plugin_manager, module):
                pass
        assert cls.name not in plugin_manager.registries["trainer"]


def test_an_installed_plugin_with_an_invalid_class_is_a_load_failure(entry_points: list[FakeEntryPoint]) -> None:
    bare = type("NotATrainer", (), {"name": "Bogus"})
    entry_points.append(
        FakeEntryPoint(
            "bogus",
            plugin_module("bogus", mineonline_register_trainers=lambda register: register(bare)),
            dist="mineonline-bogus",
        )
    )
    pm = get_plugin_manager()
    (failure,) = pm.load_failures
    assert failure.distribution == "mineonline-bogus" and "does not subclass" in failure.error
    with pytest.raises(UnknownComponentError, match="mineonline-bogus"):
        pm.lookup("trainer", "Bogus")


def test_cli_unknown_trainer_is_one_message_without_traceback() -> None:
    cli = Path(sys.executable).parent / "mineonline"
    proc = subprocess.run(
        [str(cli), "check", str(ROOT / "examples" / "cartpole.yaml"), "trainer_name=PPOTrainr"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "PPOTrainer" in proc.stderr and "trainer_name" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_plugins_lists_defaults() -> None:
    cli = Path(sys.executable).parent / "mineonline"
    proc = subprocess.run([str(cli), "plugins"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for name in ("memory", "console", "mlp", "cnn_gru", "gymnasium", "crafter"):
        assert name in proc.stdout


# --- one test per hook spec (test_every_hookspec_has_a_test keeps this list complete) ----------


def _register_one(pm: PluginManager, hook: str, kind: str, cls: type) -> None:
    with registered(pm, plugin_module("one", **{hook: lambda register: register(cls)})):
        assert pm.lookup(kind, cls.name) is cls
    assert cls.name not in pm.registries[kind]


def test_hook_mineonline_register_trainers(plugin_manager: PluginManager) -> None:
    from mineonline_core.trainer.base import BaseTrainer

    _register_one(
        plugin_manager, "mineonline_register_trainers", "trainer", type("T", (BaseTrainer,), {"name": "HookTrainer"})
    )


def test_hook_mineonline_register_replay_stores(plugin_manager: PluginManager) -> None:
    _register_one(plugin_manager, "mineonline_register_replay_stores", "replay_store", make_store("hookstore"))


def test_hook_mineonline_register_loggers(plugin_manager: PluginManager) -> None:
    from mineonline_core.contracts.logger import Logger

    cls = type("L", (Logger,), {"name": "hooklogger", "log_metrics": lambda self, metrics, step: None})
    _register_one(plugin_manager, "mineonline_register_loggers", "logger", cls)


def test_hook_mineonline_register_policies(plugin_manager: PluginManager) -> None:
    from mineonline_core.builtin.models import MLPPolicy

    _register_one(
        plugin_manager, "mineonline_register_policies", "policy", type("P", (MLPPolicy,), {"name": "hookpolicy"})
    )


def test_hook_mineonline_register_envs(plugin_manager: PluginManager) -> None:
    from mineonline_core.builtin.envs import GymnasiumEnv

    _register_one(plugin_manager, "mineonline_register_envs", "env", type("E", (GymnasiumEnv,), {"name": "hookenv"}))


def test_hook_mineonline_run_start(plugin_manager: PluginManager) -> None:
    seen: list[tuple] = []
    with registered(
        plugin_manager,
        plugin_module("start", mineonline_run_start=lambda config, run_dir: seen.append((config, run_dir))),
    ):
        plugin_manager.hook.mineonline_run_start(config="cfg", run_dir="/tmp/run")
    assert seen == [("cfg", "/tmp/run")]


def test_hook_mineonline_run_finish(plugin_manager: PluginManager) -> None:
    seen: list[str] = []
    with registered(plugin_manager, plugin_module("finish", mineonline_run_finish=lambda status: seen.append(status))):
        plugin_manager.hook.mineonline_run_finish(config="cfg", run_dir="/tmp/run", status="completed")
    assert seen == ["completed"]


def test_every_hookspec_has_a_test_and_a_docstring() -> None:
    specs = [name for name in dir(hookspecs) if name.startswith("mineonline_")]
    assert len(specs) == 7
    for name in specs:
        assert f"test_hook_{name}" in globals(), f"hook spec {name} has no test"
        assert len((getattr(hookspecs, name).__doc__ or "").split()) > 15, f"hook spec {name} is not documented"
