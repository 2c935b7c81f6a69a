"""The typed handles (``mineonline_core/services/handles.py``) stay true to the actors they describe.

Nothing runs the Protocols (no type checker in CI), so nothing else would notice one going stale:
each method a Protocol lists must exist on the actor class it describes with the same parameters
(names, kinds, defaults), every Protocol must be checked here, and each listed method must be called
somewhere in the core (a Protocol lists what callers call, not the whole actor)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from mineonline_core.contracts.store import FragmentStore
from mineonline_core.rollout.buffer import ReplayBuffer
from mineonline_core.rollout.inference import InferenceServer
from mineonline_core.rollout.manager import RolloutManager
from mineonline_core.rollout.stats import EpisodeStatistics
from mineonline_core.rollout.worker import RolloutWorker
from mineonline_core.services import handles
from mineonline_core.services.evaluator import Evaluator
from mineonline_core.services.gpulease import GpuLease
from mineonline_core.services.heartbeat import HeartbeatBoard
from mineonline_core.services.loggerhub import LoggerHub
from mineonline_core.services.storehost import StoreClient, StoreHost

CORE = Path(__file__).resolve().parents[1] / "mineonline_core"

#: Protocol -> the classes whose instances (or actors) it describes.
DESCRIBES: dict[type, tuple[type, ...]] = {
    handles.LoggerHubHandle: (LoggerHub,),
    handles.StoreAccess: (StoreClient, FragmentStore),
    handles.StoreHostHandle: (StoreHost,),
    handles.ReplayBufferHandle: (ReplayBuffer,),
    handles.EpisodeStatisticsHandle: (EpisodeStatistics,),
    handles.WeightReceiverHandle: (RolloutWorker, InferenceServer),
    handles.InferenceServerHandle: (InferenceServer,),
    handles.RolloutWorkerHandle: (RolloutWorker,),
    handles.RolloutManagerHandle: (RolloutManager,),
    handles.EvaluatorHandle: (Evaluator,),
    handles.HeartbeatBoardHandle: (HeartbeatBoard,),
    handles.GpuLeaseHandle: (GpuLease.__ray_actor_class__,),  # ``@ray.remote`` at its definition
}


def protocols() -> list[type]:
    return [
        obj
        for obj in vars(handles).values()
        if inspect.isclass(obj) and obj.__module__ == handles.__name__ and getattr(obj, "_is_protocol", False)
    ]


def methods(protocol: type) -> dict[str, object]:
    """The methods ``protocol`` lists, its Protocol bases' included."""
    out: dict[str, object] = {}
    for klass in reversed(protocol.__mro__):
        if klass.__module__ == handles.__name__ and klass is not handles.Remote:
            out.update({k: v for k, v in vars(klass).items() if inspect.isfunction(v) and not k.startswith("_")})
    return out


def parameters(function: object) -> list[tuple[str, object, object]]:
    """``(name, kind, default)`` of each parameter but ``self`` and the ``_ray_trace_ctx`` that
    ``@ray.remote`` adds to a class it decorates."""
    params = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.kind, p.default) for p in params if not p.name.startswith("_ray_")]


def test_every_handle_protocol_is_checked():
    assert set(protocols()) - {handles.Remote} == set(DESCRIBES)


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


def _calls(name: str, *, remote: bool) -> re.Pattern:
    if remote:  # ``handle.name.remote(`` or a client's ``self._call("name", ...)`` (StoreClient, stats)
        return re.compile(rf'\.{name}\.remote\(|_call\([^)\n]*"{name}"')
    return re.compile(rf"_store\.{name}\b")  # the store client is kept as ``_store`` wherever it is used


@pytest.mark.parametrize("protocol", list(DESCRIBES), ids=lambda p: p.__name__)
def test_each_listed_method_is_called_by_the_core(protocol):
    sources = "\n".join(p.read_text() for p in CORE.rglob("*.py") if p.name != "handles.py")
    remote = protocol is not handles.StoreAccess
    unused = [name for name in methods(protocol) if not _calls(name, remote=remote).search(sources)]
    assert unused == [], f"{protocol.__name__} lists methods nothing in the core calls: {unused}"
