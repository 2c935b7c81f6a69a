"""Weights from the trainer to rollout (``services/weights.py``, ``trainer/snapshot.py``): bfloat16 and
float16 state dicts cross the wire bit-exactly; one receiver loads them into the in-process policy and
the inference server, refusing weights that do not fit with one clear error; on CUDA the trainer copies
a version to pinned host buffers on a side stream and waits for it on the broadcast thread only, and the
receiver copies each tensor once, asynchronously, from pinned buffers, with one wait per load.

This machine has no GPU: the CUDA paths run on the CPU with ``torch.cuda``'s streams, events and pinned
allocation replaced by fakes that record what the code asked of them, in order."""

from __future__ import annotations

import pickle

import pytest
import torch

from mineonline_core.services import weights as W
from mineonline_core.services.weights import PackedWeights, WeightReceiver, WeightsMismatchError, pack_state
from mineonline_core.testing.fakecuda import FakeCuda

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class Mixed(torch.nn.Module):
    """Parameters of ``dtype``, a float32 one beside them and an int64 buffer: three flat buffers."""

    def __init__(self, dtype: torch.dtype, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = torch.nn.Linear(5, 7).to(dtype)
        self.norm = torch.nn.BatchNorm1d(7).to(dtype)  # num_batches_tracked: int64, 0-dim
        self.scale = torch.nn.Parameter(torch.randn(3))

    def initial_state(self, batch_size: int) -> None:
        return None  # stateless; LocalPolicy and the server ask


def trained(dtype: torch.dtype, seed: int) -> Mixed:
    """A model whose values include the edge cases a cast or a rounding would change."""
    model = Mixed(dtype, seed)
    with torch.no_grad():
        model.body.weight.view(-1)[:4] = torch.tensor([-0.0, torch.finfo(dtype).tiny / 4, torch.finfo(dtype).max, 1e-3])
        model.norm.num_batches_tracked.fill_(seed + 7)
    return model


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_bit_equal(model: torch.nn.Module, source: torch.nn.Module) -> None:
    got, want = model.state_dict(), source.state_dict()
    assert list(got) == list(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(bits(got[key]), bits(want[key])), key


def through_the_object_store(weights: PackedWeights) -> PackedWeights:
    """What ``ray.put`` and ``ray.get`` do: pickle protocol 5, the arrays out of band, read-only on arrival."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(weights, protocol=5, buffer_callback=buffers.append)
    assert buffers, "the arrays must travel out of band (zero-copy on the reader's side)"
    return pickle.loads(data, buffers=[memoryview(bytes(b.raw())) for b in buffers])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_state_dict_crosses_the_wire_and_loads_bit_exactly(dtype: torch.dtype) -> None:
    source, model = trained(dtype, seed=1), Mixed(dtype, seed=2)
    arrived = through_the_object_store(pack_state(source.state_dict()))
    assert all(not a.flags.writeable for a in arrived.flats)  # read-only views, as Ray hands them over
    receiver = WeightReceiver(device="cpu")
    receiver.load(model, arrived, version=5)
    assert_bit_equal(model, source)
    assert receiver.version == 5
    model.load_state_dict(arrived)  # a mapping of tensors: whatever takes a state dict takes it


def test_weights_that_do_not_fit_are_refused_naming_every_difference_and_leave_the_model_as_it_was() -> None:
    model = trained(torch.float32, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: v.clone() + 1 for k, v in trained(torch.float32, seed=3).state_dict().items()}
    state.pop("norm.bias")
    state["body.weight"] = torch.zeros(7, 6)
    state["scale"] = state["scale"].double()
    state["head.weight"] = torch.zeros(2)
    with pytest.raises(WeightsMismatchError) as info:
        WeightReceiver(device="cpu").load(model, state, what="the rollout policy")
    message = str(info.value)
    assert "do not fit the rollout policy" in message
    assert "missing keys (1): norm.bias" in message and "unexpected keys (1): head.weight" in message
    assert "'body.weight': sent (7, 6) torch.float32, model (7, 5) torch.float32" in message
    assert "'scale': sent (3,) torch.float64, model (3,) torch.float32" in message
    for key, value in model.state_dict().items():  # checked before a single value was copied
        assert torch.equal(value, before[key]), key


def test_the_in_process_policy_loads_bfloat16_weights_and_a_reference_through_the_receiver() -> None:
    from mineonline_core.config.precision import PrecisionChoice
    from mineonline_core.rollout.localpolicy import LocalPolicy

    local = LocalPolicy(policy=Mixed(torch.bfloat16), device=torch.device("cpu"), precision=PrecisionChoice().on("cpu"))
    source, reference = trained(torch.bfloat16, seed=4), trained(torch.bfloat16, seed=5)
    local.set_reference(through_the_object_store(pack_state(reference.state_dict())))
    local.set_weights(through_the_object_store(pack_state(source.state_dict())), 9)
    new_reference, version = local.swap()
    assert version == 9
    assert_bit_equal(local.policy, source)
    assert_bit_equal(new_reference, reference)
    with pytest.raises(WeightsMismatchError, match="do not fit the rollout policy"):
        local.set_weights(pack_state(Mixed(torch.float16).state_dict()), 10)
    assert local.swap() == (None, None)  # a refused load is never swapped in


def test_the_inference_server_loads_bfloat16_weights_through_the_receiver(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from mineonline_core.config import OnlineConfig
    from mineonline_core.rollout.inference import InferenceServer

    monkeypatch.setattr(ray, "get", lambda ref: ref)  # the "refs" below are the objects themselves
    server = InferenceServer(
        policy_generator=lambda: Mixed(torch.bfloat16), config=OnlineConfig().rollout_config, manager=None
    )
    try:
        source = trained(torch.bfloat16, seed=6)
        server.update_weights([through_the_object_store(pack_state(source.state_dict()))], 4)
        assert server._loaded.wait(30)
        server.health()
        assert server.version == 4 and server._receiver.version == 4
        assert_bit_equal(server.policy, source)
    finally:
        server.shutdown()


def test_on_cuda_the_receiver_copies_each_tensor_once_asynchronously_from_pinned_buffers_and_waits_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeCuda()
    fake.install(monkeypatch)
    receiver = WeightReceiver(device="cuda")  # bare, as the inference server names its device
    model = Mixed(torch.bfloat16)
    n = len(model.state_dict())
    first, second = trained(torch.bfloat16, seed=1), trained(torch.bfloat16, seed=2)
    sent = [
        (1, first, through_the_object_store(pack_state(first.state_dict()))),  # the broadcast's format
        (2, second, {k: v.clone() for k, v in second.state_dict().items()}),  # any state dict
    ]
    fake.take()
    for version, source, weights in sent:
        receiver.load(model, weights, version=version)
        log = fake.take()
        loads = [i for i, e in enumerate(log) if e[0] == "copy" and e[1]]
        assert [log[i] for i in loads] == [("copy", True, "side0")] * n  # each tensor once, on the side stream
        assert ("copy", False, "side0") not in log  # the host-to-host staging copies are not on it
        wait = log.index(("wait_stream", "side0", "default"))  # the module's last readers come first
        (done,) = [i for i, e in enumerate(log) if e[0] == "record"]
        (sync,) = [i for i, e in enumerate(log) if e[0] == "event_sync"]
        assert wait < loads[0] and loads[-1] < done < sync and log[sync][1] == log[done][1]  # one wait, at the end
        assert ("device_sync",) not in log
        assert fake.async_unpinned == 0  # every asynchronous copy reads a pinned buffer, never the sender's memory
        # The loading thread sleeps in its wait instead of spinning a core the env processes need for the copy.
        assert {e.id: e for e in fake.events}[log[sync][1]].blocking
        assert_bit_equal(model, source)
        assert receiver.version == version
    groups, _ = W.layout(model.state_dict())
    assert fake.pinned == [(numel, dtype, True) for _, dtype, numel in groups]  # pinned once, for both versions
