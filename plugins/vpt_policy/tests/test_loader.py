"""Loading .model/.weights files: malicious pickles refused unexecuted, mismatches named."""

from __future__ import annotations

import os
import pickle
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from mineonline_core.errors import MineOnlineError
from mineonline_vpt import VPTModelFileError, VPTWeightsError, load_vpt_policy
from mineonline_vpt.loader import read_model_file

FIXTURES = (
    Path(
        os.environ.get("MINEONLINE_VPT_FIXTURES") or Path(__file__).resolve().parents[3].parent / "shared" / "fixtures"
    )
    / "vpt_public"
)
needs_fixture = pytest.mark.skipif(not (FIXTURES / "public.model").exists(), reason="VPT public fixture not present")

SMALL_KWARGS = {
    "attention_heads": 2,
    "attention_mask_style": "clipped_causal",
    "attention_memory_size": 6,
    "timesteps": 2,
    "hidsize": 16,
    "img_shape": [128, 128, 3],
    "impala_chans": [4, 4, 4],
    "impala_width": 1,
    "impala_kwargs": {"post_pool_groups": 1},
    "init_norm_kwargs": {"batch_norm": False, "group_norm_groups": 1},
    "n_recurrence_layers": 1,
    "pointwise_ratio": 2,
    "pointwise_use_activation": False,
    "recurrence_is_residual": True,
    "recurrence_type": "transformer",
    "use_pointwise_layer": True,
    "use_pre_lstm_ln": False,
    "only_img_input": True,
    "diff_mlp_embedding": False,
}


def write_model(path: Path, kwargs: dict, **extra) -> Path:
    with open(path, "wb") as f:
        pickle.dump({"model": {"args": {"net": {"args": kwargs}, "pi_head_opts": {"temperature": 2}}}, **extra}, f)
    return path


class _Exploit:
    """Pickles to a call of os.system that would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_model_pickle_is_refused_and_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.model"
    with open(bad, "wb") as f:
        pickle.dump({"model": {"args": {"net": {"args": _Exploit(marker)}}}}, f)
    with pytest.raises(VPTModelFileError) as info:
        load_vpt_policy(bad)
    message = str(info.value)
    assert "system" in message and str(bad) in message and "refused" in message
    assert isinstance(info.value, MineOnlineError)
    assert not marker.exists()
    # The plain pickle module would have run it: the file really is an exploit.
    pickle.loads(bad.read_bytes())
    assert marker.exists()


def test_eval_and_import_gadgets_are_refused(tmp_path: Path) -> None:
    for payload in (b"cbuiltins\neval\n(V1+1\ntR.", b"c__builtin__\n__import__\n(Vos\ntR."):
        path = tmp_path / "gadget.model"
        path.write_bytes(payload)
        with pytest.raises(VPTModelFileError, match="refused"):
            read_model_file(path)


def test_unknown_keys_are_ignored_and_int_temperature_accepted(tmp_path: Path) -> None:
    path = write_model(
        tmp_path / "m.model", {**SMALL_KWARGS, "some_future_flag": [1, 2]}, version=3, local_args=OrderedDict(a=1)
    )
    policy = load_vpt_policy(path)
    assert policy.pi_head.temperature == 2.0 and policy.net.maxlen == 4
    assert policy.state_dict()["net.recurrent_layer.blocks.0.r.orc_block.b_nd"].shape == (10, 4)


def test_structural_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(VPTModelFileError, match="does not exist"):
        load_vpt_policy(tmp_path / "nope.model")
    odd = tmp_path / "odd.model"
    with open(odd, "wb") as f:
        pickle.dump({"model": {"args": {}}}, f)
    with pytest.raises(VPTModelFileError, match=r"\['net'\]"):
        load_vpt_policy(odd)
    lstm = write_model(tmp_path / "lstm.model", {**SMALL_KWARGS, "recurrence_type": "multi_layer_lstm"})
    with pytest.raises(VPTModelFileError, match="recurrence_type"):
        load_vpt_policy(lstm)


def test_weights_mismatch_names_missing_unexpected_and_misshaped_keys(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m.model", SMALL_KWARGS)
    state = load_vpt_policy(model).state_dict()
    del state["net.final_ln.bias"]
    state["net.extra.weight"] = torch.zeros(3)
    state["value_head.linear.weight"] = torch.zeros(1, 17)
    torch.save(state, tmp_path / "bad.weights")
    with pytest.raises(VPTWeightsError) as info:
        load_vpt_policy(model, tmp_path / "bad.weights")
    message = str(info.value)
    assert "missing keys: net.final_ln.bias" in message
    assert "unexpected keys: net.extra.weight" in message
    assert "value_head.linear.weight (file (1, 17), model (1, 16))" in message


def test_weights_file_with_code_is_refused(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m.model", SMALL_KWARGS)
    marker = tmp_path / "pwned"
    with open(tmp_path / "evil.weights", "wb") as f:
        pickle.dump(_Exploit(marker), f)
    with pytest.raises(VPTWeightsError, match="weights-only"):
        load_vpt_policy(model, tmp_path / "evil.weights")
    assert not marker.exists()


def test_roundtrip_weights_load_strictly(tmp_path: Path) -> None:
    model = write_model(tmp_path / "m.model", SMALL_KWARGS)
    torch.manual_seed(0)
    src = load_vpt_policy(model)
    torch.save(src.state_dict(), tmp_path / "ok.weights")
    dst = load_vpt_policy(model, tmp_path / "ok.weights")
    for (k, a), (k2, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert k == k2 and torch.equal(a, b)


@needs_fixture
def test_public_fixture_loads_all_118_keys() -> None:
    policy = load_vpt_policy(FIXTURES / "public.model", FIXTURES / "public.weights")
    state = torch.load(FIXTURES / "public.weights", weights_only=True)
    assert list(policy.state_dict()) == list(state) and len(state) == 118
    assert all(torch.equal(policy.state_dict()[k], v) for k, v in state.items())
    normalizer = policy.value_head.normalizer
    assert not any(p.requires_grad for p in normalizer.parameters())


MANIFEST = FIXTURES.parent / "vpt_manifest.json"


@pytest.mark.skipif(not MANIFEST.exists(), reason="VPT manifest not present")
def test_random_weights_of_the_real_1x_layout_load_strictly(tmp_path: Path) -> None:
    """A .weights file with every key and shape of the released foundation-model-1x (random values)."""
    import json

    entry = json.loads(MANIFEST.read_text())["models"]["foundation-model-1x"]
    model = write_model(tmp_path / "1x.model", entry["policy_kwargs"])
    generator = torch.Generator().manual_seed(0)
    state = OrderedDict((e["key"], torch.randn(e["shape"], generator=generator) * 0.02) for e in entry["state_dict"])
    state["value_head.normalizer.running_mean_sq"] = state["value_head.normalizer.running_mean"] ** 2 + 1.0
    torch.save(state, tmp_path / "1x.weights")
    policy = load_vpt_policy(model, tmp_path / "1x.weights")
    loaded = policy.state_dict()
    assert list(loaded) == list(state) and all(torch.equal(loaded[k], v) for k, v in state.items())
    del state["net.final_ln.weight"]
    torch.save(state, tmp_path / "short.weights")
    with pytest.raises(VPTWeightsError, match="net.final_ln.weight"):
        load_vpt_policy(model, tmp_path / "short.weights")
