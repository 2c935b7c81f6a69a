"""VPT's joint action space and the conversions to and from MineRL-style env actions.

The agent acts in two categorical heads: ``buttons`` (8641 joint button combinations: 8640 products
of mutually exclusive groups plus one ``inventory`` action) and ``camera`` (11 x 11 mu-law bins of
pitch and yaw). An env action is a MineRL dict: 0/1 per button key and ``camera = [pitch, yaw]`` in
degrees.

Batching: an env action whose ``camera`` has shape (..., 2) and buttons shape (...) maps to agent
arrays of shape (..., 1) (the singleton axis is the policy's action layout); an unbatched env action
(``camera`` shape (2,)) gives arrays of shape (1,). ``agent_to_env`` accepts ints or arrays with or
without that trailing singleton axis.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

# The order of the 20 factored buttons: the columns of ``BUTTON_TABLE``.
BUTTONS_ALL = (
    "attack",
    "back",
    "forward",
    "jump",
    "left",
    "right",
    "sneak",
    "sprint",
    "use",
    "drop",
    "inventory",
    *(f"hotbar.{i}" for i in range(1, 10)),
)

# Mutually exclusive groups, outermost first in the joint index; option 0 is always "none".
BUTTON_GROUPS: dict[str, tuple[str, ...]] = {
    "hotbar": ("none", *(f"hotbar.{i}" for i in range(1, 10))),
    "fore_back": ("none", "forward", "back"),
    "left_right": ("none", "left", "right"),
    "sprint_sneak": ("none", "sprint", "sneak"),
    "use": ("none", "use"),
    "drop": ("none", "drop"),
    "attack": ("none", "attack"),
    "jump": ("none", "jump"),
    "camera": ("none", "camera"),
}

N_CAMERA_BINS = 11
CAMERA_MAXVAL = 10.0
CAMERA_BINSIZE = 2.0
CAMERA_MU = 10.0
CAMERA_NULL_BIN = N_CAMERA_BINS // 2
N_BUTTONS = math.prod(len(g) for g in BUTTON_GROUPS.values()) + 1  # 8641
N_CAMERA = N_CAMERA_BINS * N_CAMERA_BINS  # 121
INVENTORY_IDX = N_BUTTONS - 1  # 8640
NULL_BUTTONS_IDX = 0
CAMERA_NULL_IDX = CAMERA_NULL_BIN * N_CAMERA_BINS + CAMERA_NULL_BIN  # 60


def _build_button_tables() -> tuple[np.ndarray, np.ndarray]:
    """Factored buttons (8641, 20) int8 and camera-meta-off (8641,) bool for every joint index."""
    column = {name: i for i, name in enumerate(BUTTONS_ALL)}
    factored = np.zeros((N_BUTTONS, len(BUTTONS_ALL)), dtype=np.int8)
    camera_off = np.zeros(N_BUTTONS, dtype=bool)
    # itertools.product varies the last group fastest, which is exactly the joint index order.
    for idx, choice in enumerate(itertools.product(*BUTTON_GROUPS.values())):
        for option in choice[:-1]:
            if option != "none":
                factored[idx, column[option]] = 1
        camera_off[idx] = choice[-1] == "none"
    factored[INVENTORY_IDX, column["inventory"]] = 1
    # Inventory is not marked camera-off in VPT, so its camera index passes through to the env.
    camera_off[INVENTORY_IDX] = False
    return factored, camera_off


BUTTON_TABLE, BUTTON_CAMERA_OFF = _build_button_tables()
CAMERA_TABLE = np.stack(np.divmod(np.arange(N_CAMERA), N_CAMERA_BINS), axis=-1).astype(np.int64)


def discretize_camera(degrees: Any) -> np.ndarray:
    """Mu-law quantisation of camera degrees to bins 0..10 (5 is null); rounds half to even."""
    x = np.clip(np.asarray(degrees, dtype=np.float64), -CAMERA_MAXVAL, CAMERA_MAXVAL)
    v = np.sign(x) * np.log1p(CAMERA_MU * np.abs(x) / CAMERA_MAXVAL) / np.log1p(CAMERA_MU) * CAMERA_MAXVAL
    return np.round((v + CAMERA_MAXVAL) / CAMERA_BINSIZE).astype(np.int64)


def undiscretize_camera(bins: Any) -> np.ndarray:
    """Bin centres in degrees (inverse mu-law)."""
    u = np.asarray(bins, dtype=np.float64) * CAMERA_BINSIZE - CAMERA_MAXVAL
    return np.sign(u) * ((1.0 + CAMERA_MU) ** (np.abs(u) / CAMERA_MAXVAL) - 1.0) / CAMERA_MU * CAMERA_MAXVAL


def _pressed(env_action: dict, key: str, shape: tuple[int, ...]) -> np.ndarray:
    value = env_action.get(key, 0)
    return np.broadcast_to(np.asarray(_as_numpy(value)).astype(np.int64) != 0, shape)


def _as_numpy(x: Any) -> Any:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else x


def env_to_agent(env_action: dict) -> dict[str, np.ndarray]:
    """A MineRL env action (batched or not) to agent indices ``{"buttons", "camera"}`` (..., 1)."""
    camera = np.asarray(_as_numpy(env_action.get("camera", (0.0, 0.0))), dtype=np.float64)
    shape = camera.shape[:-1]
    press = {key: _pressed(env_action, key, shape) for key in BUTTONS_ALL}
    bins = discretize_camera(camera)
    camera_idx = bins[..., 0] * N_CAMERA_BINS + bins[..., 1]

    hotbar = np.zeros(shape, dtype=np.int64)
    for i in range(1, 10):  # the highest pressed hotbar key wins
        hotbar = np.where(press[f"hotbar.{i}"], i, hotbar)
    # Opposite keys cancel; within sprint/sneak the later option (sneak) wins.
    fore_back = np.where(press["forward"] & ~press["back"], 1, np.where(press["back"] & ~press["forward"], 2, 0))
    left_right = np.where(press["left"] & ~press["right"], 1, np.where(press["right"] & ~press["left"], 2, 0))
    sprint_sneak = np.where(press["sneak"], 2, np.where(press["sprint"], 1, 0))
    camera_meta = (bins[..., 0] != CAMERA_NULL_BIN) | (bins[..., 1] != CAMERA_NULL_BIN)
    digits = [
        hotbar,
        fore_back,
        left_right,
        sprint_sneak,
        press["use"],
        press["drop"],
        press["attack"],
        press["jump"],
        camera_meta,
    ]
    buttons = np.zeros(shape, dtype=np.int64)
    for digit, group in zip(digits, BUTTON_GROUPS.values()):
        buttons = buttons * len(group) + digit.astype(np.int64)
    # Inventory excludes everything else, including the camera.
    buttons = np.where(press["inventory"], INVENTORY_IDX, buttons)
    camera_idx = np.where(press["inventory"], CAMERA_NULL_IDX, camera_idx)
    return {"buttons": buttons[..., None].astype(np.int64), "camera": camera_idx[..., None].astype(np.int64)}


def _indices(x: Any) -> np.ndarray:
    arr = np.asarray(_as_numpy(x), dtype=np.int64)
    return arr[..., 0] if arr.ndim >= 1 and arr.shape[-1] == 1 else arr


def agent_to_env(agent_action: dict) -> dict[str, Any]:
    """Agent indices to a MineRL env action: the 20 factored buttons (0/1) and ``camera`` in degrees.

    A button combination with the camera meta-action off forces the camera to [0, 0], whatever the
    camera index says (inventory keeps its camera index, as in VPT).
    """
    buttons = _indices(agent_action["buttons"])
    camera_idx = _indices(agent_action["camera"])
    if buttons.min(initial=0) < 0 or buttons.max(initial=0) >= N_BUTTONS:
        raise ValueError(f"buttons index out of range [0, {N_BUTTONS}): {buttons}")
    if camera_idx.min(initial=0) < 0 or camera_idx.max(initial=0) >= N_CAMERA:
        raise ValueError(f"camera index out of range [0, {N_CAMERA}): {camera_idx}")
    factored = BUTTON_TABLE[buttons]
    bins = np.where(BUTTON_CAMERA_OFF[buttons][..., None], CAMERA_NULL_BIN, CAMERA_TABLE[camera_idx])
    degrees = undiscretize_camera(bins)
    scalar = buttons.ndim == 0
    out: dict[str, Any] = {}
    for i, key in enumerate(BUTTONS_ALL):
        column = factored[..., i].astype(np.int64)
        out[key] = int(column) if scalar else column
    out["camera"] = degrees
    return out
