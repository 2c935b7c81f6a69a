"""Reading OpenAI's released ``.model`` and ``.weights`` files safely.

``.model`` files are pickles downloaded from the internet. A pickle can name any importable callable
(``os.system``) and have the unpickler call it, so they are read with an unpickler that resolves no
global at all beyond a few inert builtin containers; anything else is refused before it runs.
``.weights`` files are read with ``torch.load(weights_only=True)`` and loaded strictly.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mineonline_core.errors import MineOnlineError
from mineonline_core.contracts.policy import state_dict_mismatch


class VPTModelFileError(MineOnlineError):
    """A ``.model`` file is unreadable, unsafe or describes an architecture this plugin cannot build."""


class VPTWeightsError(MineOnlineError):
    """A ``.weights`` file is unreadable or does not match the architecture of its ``.model`` file."""


# Globals a benign model-args pickle may need; constructing any of them runs no user code.
_SAFE_GLOBALS = {
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "complex"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise VPTModelFileError(
            f"policy_config.model_path: {self._path!r} is not a plain VPT model-args file: its pickle "
            f"references the global '{module}.{name}', which could run arbitrary code, so it was "
            f"refused and nothing in it was executed. Released VPT .model files hold only dicts, lists, "
            f"strings and numbers; download the file again from OpenAI's Video-Pre-Training release."
        )

    def persistent_load(self, pid: Any) -> Any:
        raise VPTModelFileError(
            f"policy_config.model_path: {self._path!r} uses pickle persistent ids ({pid!r}); a VPT "
            f".model file holds only builtin containers and scalars. Check the path."
        )


def _dig(d: Any, path: tuple[str, ...], file: str) -> Any:
    for i, key in enumerate(path):
        if not isinstance(d, Mapping) or key not in d:
            where = "".join(f"[{k!r}]" for k in path[: i + 1])
            raise VPTModelFileError(
                f"policy_config.model_path: {file!r} has no entry d{where}; a VPT .model file is a dict "
                f"with the policy kwargs at d['model']['args']['net']['args']. Check that the path names "
                f"a .model file (not a .weights file)."
            )
        d = d[key]
    return d


def read_model_file(path: str | os.PathLike) -> tuple[dict, dict]:
    """The policy kwargs and the action-head options stored in a VPT ``.model`` file.

    Only ``d["model"]["args"]["net"]["args"]`` and ``d["model"]["args"]["pi_head_opts"]`` are read;
    any other key is ignored.
    """
    path = os.fspath(os.path.expanduser(path))
    try:
        with open(path, "rb") as f:
            data = _RestrictedUnpickler(f, path).load()
    except VPTModelFileError:
        raise
    except FileNotFoundError:
        raise VPTModelFileError(
            f"policy_config.model_path: {path!r} does not exist. Give the path of a VPT .model file "
            f"(for example foundation-model-1x.model), absolute or relative to the working directory."
        ) from None
    except Exception as exc:  # noqa: BLE001 - any parse failure is the same user error
        raise VPTModelFileError(
            f"policy_config.model_path: {path!r} is not a readable pickle ({type(exc).__name__}: {exc}). "
            f"Check that the file is a complete VPT .model file."
        ) from None
    kwargs = _dig(data, ("model", "args", "net", "args"), path)
    if not isinstance(kwargs, Mapping):
        raise VPTModelFileError(f"policy_config.model_path: {path!r}: d['model']['args']['net']['args'] is not a dict.")
    head_opts = data["model"]["args"].get("pi_head_opts") or {}
    return dict(kwargs), dict(head_opts)


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A state dict from a ``.weights`` file, through torch's weights-only unpickler."""
    path = os.fspath(os.path.expanduser(path))
    if not os.path.exists(path):
        raise VPTWeightsError(
            f"policy_config.weights_path: {path!r} does not exist. Give the path of the .weights file "
            f"released with the .model file, or leave weights_path unset for random initialisation."
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise VPTWeightsError(
            f"policy_config.weights_path: {path!r} could not be read as a weights-only torch file "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Released VPT "
            f".weights files hold tensors only; check that the file is complete and not a .model file."
        ) from None
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise VPTWeightsError(f"policy_config.weights_path: {path!r} does not hold a dict of tensors.")
    return dict(state)


def load_weights_strict(module: nn.Module, state: Mapping[str, torch.Tensor], *, source: str) -> None:
    """Load ``state`` into ``module``; any missing, unexpected or mis-shaped key is an error naming it."""
    mismatch = state_dict_mismatch(module, dict(state))
    if mismatch:
        raise VPTWeightsError(
            f"policy_config.weights_path: {source!r} does not match the architecture built from the "
            f".model file ({mismatch}). Use the .weights file released together with this .model "
            f"file (for example foundation-model-1x.weights with foundation-model-1x.model)."
        )
    module.load_state_dict(state, strict=True)
