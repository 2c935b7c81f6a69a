"""The handle Protocols left in ``mineonline_core/services/handles.py`` stay true to their actors.

Everywhere else a handle is typed ``ActorHandle[TheActor]`` and its methods are the class's own. These
few Protocols exist only where the class cannot be imported (the trainer, beside ``rollout/``; the
rollout worker, the inference server and the rollout start-up, which their manager imports). Nothing
runs them and no type checker runs in CI, so this test does: each listed method exists on its actor
class with the same parameters (names, kinds, defaults); each is called by the core; and no module that
may import the actor's class uses the Protocol instead."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from mineonline_core.rollout.buffer import ReplayBuffer
from mineonline_core.rollout.inference import InferenceServer
from mineonline_core.rollout.manager import RolloutManager
from mineonline_core.rollout.worker import RolloutWorker
from mineonline_core.services import handles

CORE = Path(__file__).resolve().parents[1] / "mineonline_core"

#: Protocol -> the classes whose actors it describes.
DESCRIBES: dict[type, tuple[type, ...]] = {
    handles.WeightReceiverHandle: (RolloutWorker, InferenceServer),
    handles.ReplayBufferHandle: (ReplayBuffer,),
    handles.RolloutManagerHandle: (RolloutManager,),
}
#: Protocol -> the modules that may use it: those that cannot import its actor's class.
USED_BY: dict[type, tuple[str, ...]] = {
    handles.WeightReceiverHandle: ("trainer/",),
    handles.ReplayBufferHandle: ("trainer/",),
    handles.RolloutManagerHandle: ("trainer/", "rollout/worker.py", "rollout/inference.py", "rollout/startup.py"),
}


def protocols() -> list[type]:
    return [
        obj
        for obj in vars(handles).values()
        if inspect.isclass(obj) and obj.__module__ == handles.__name__ and getattr(obj, "_is_protocol", False)
    ]


def methods(protocol: type) -> dict[str, object]:
    return {k: v for k, v in vars(protocol).items() if inspect.isfunction(v) and not k.startswith("_")}


def parameters(function: object) -> list[tuple[str, object, object]]:
    """``(name, kind, default)`` of each parameter but ``self`` and the ``_ray_trace_ctx`` that
    ``@ray.remote`` adds to a class it decorates."""
    params = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.kind, p.default) for p in params if not p.name.startswith("_ray_")]


def sources() -> dict[str, str]:
    return {str(p.relative_to(CORE)): p.read_text() for p in CORE.rglob("*.py") if p.name != "handles.py"}


def test_every_handle_protocol_is_checked():
    assert set(protocols()) - {handles.Remote} == set(DESCRIBES) == set(USED_BY)


@pytest.mark.parametrize("protocol", list(DESCRIBES), ids=lambda p: p.__name__)
def test_each_method_exists_on_the_actor_with_its_parameters(protocol):
    listed = methods(protocol)
    assert listed, f"{protocol.__name__} lists no method"
    for cls in DESCRIBES[protocol]:
        for name, stub in listed.items():
            real = getattr(cls, name, None)
            assert callable(real), f"{protocol.__name__}.{name}: {cls.__name__} has no method {name!r}"
            assert parameters(stub) == parameters(real), (
                f"{protocol.__name__}.{name} says {inspect.signature(stub)}, "
                f"{cls.__name__}.{name} is {inspect.signature(real)}"
            )


@pytest.mark.parametrize("protocol", list(DESCRIBES), ids=lambda p: p.__name__)
def test_each_listed_method_is_called_where_the_protocol_is_used(protocol):
    text = "\n".join(s for path, s in sources().items() if path.startswith(USED_BY[protocol]))
    unused = [name for name in methods(protocol) if not re.search(rf"\.{name}\.remote\(", text)]
    assert unused == [], f"{protocol.__name__} lists methods its users never call: {unused}"


@pytest.mark.parametrize("protocol", list(DESCRIBES), ids=lambda p: p.__name__)
def test_a_module_that_can_import_the_actor_names_the_actor(protocol):
    users = [path for path, s in sources().items() if re.search(rf"\b{protocol.__name__}\b", s)]
    assert [path for path in users if not path.startswith(USED_BY[protocol])] == []
