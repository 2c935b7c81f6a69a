"""Minecraft without Java: a fake game engine under MineStudio's real ``MinecraftSim``.

``minestudio.simulator.MinecraftSim`` drives the game through MineRL: its constructor calls
``check_engine()`` (is the Java build there?) and ``HumanSurvival(...).make()``, which launches
Minecraft and returns an env speaking MineRL's protocol: ``seed(int)``, ``reset() -> obs``,
``step(env_action) -> (obs, reward, done, info)``, ``execute_cmd(chat) -> step``,
``action_space.no_op()``, ``close()``. ``FakeMinecraftEngine`` speaks that protocol over a tiny world
(a field, mobs summoned by chat commands, attacks that kill them and count in ``kill_entity``), so
everything above the engine runs MineStudio's own code: ``MinecraftSim.reset/step``, its callbacks
(``SummonMobsCallback``, ``CommandsCallback``, ``FastResetCallback``, ``JudgeResetCallback``,
``RewardsCallback``, ``MaskActionsCallback``), the agent-to-env action mapping and the frame resize.

``fake_engine()`` swaps the engine in at that one seam, ``minestudio.simulator.entry``, while a
simulator is being built; ``with_fake_engine(env_generator)`` is a picklable env generator that does
it inside whichever process builds the env (env subprocesses, Ray workers), so a MineStudio config
module runs unchanged on this machine.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import re
import sys
import types
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator

import gymnasium
import numpy as np

# MineRL HumanSurvival's keyboard actions (``SIMPLE_KEYBOARD_ACTION`` plus the hotbar); the engine
# ignores other keys of an env action, as MineRL's ``_process_action`` does (e.g. VPT's ``drop``).
KEYS = (
    "forward",
    "back",
    "left",
    "right",
    "jump",
    "sneak",
    "sprint",
    "attack",
    "use",
    "pickItem",
    "inventory",
    *(f"hotbar.{i}" for i in range(1, 10)),
)
STATS = ("use_item", "pickup", "break_item", "craft_item", "mine_block", "damage_dealt", "custom", "kill_entity")
MOB_HEALTH = {"cow": 10.0, "pig": 10.0, "sheep": 8.0, "chicken": 4.0, "zombie": 20.0}
MOB_COLOUR = {"cow": (92, 64, 40), "pig": (240, 160, 160), "sheep": (230, 230, 230), "chicken": (250, 250, 250)}
REACH, HALF_FOV = 4.0, 35.0
_SUMMON = re.compile(r"summon minecraft:(\w+) ~(-?[\d.]+) ~(-?[\d.]+) ~(-?[\d.]+)")
_GIVE = re.compile(r"^/give @p minecraft:(\w+)(?: (\d+))?")
_TELEPORT = re.compile(r"^/teleportbiome @a \w+ (-?\d+) ~\S* (-?\d+)")


class _ActionSpace(gymnasium.spaces.Dict):
    """MineRL HumanSurvival's action space, with MineRL's ``no_op()``."""

    def __init__(self) -> None:
        spaces: dict[str, gymnasium.Space] = {key: gymnasium.spaces.Discrete(2) for key in KEYS}
        spaces["camera"] = gymnasium.spaces.Box(-180.0, 180.0, (2,), np.float32)
        spaces["chat"] = gymnasium.spaces.Text(max_length=4096)
        spaces["voxels"] = spaces["mobs"] = gymnasium.spaces.Box(-50, 50, (6,), np.int32)
        super().__init__(spaces)

    def no_op(self) -> dict[str, Any]:
        out: dict[str, Any] = {key: 0 for key in KEYS}
        out.update(camera=np.zeros(2, np.float32), chat="", voxels=np.zeros(6, np.int32), mobs=np.zeros(6, np.int32))
        return out


def _pressed(action: dict[str, Any], key: str) -> int:
    return int(np.asarray(action.get(key, 0)).reshape(-1)[0] != 0)


class FakeMinecraftEngine:
    """What ``HumanSurvival(...).make()`` returns, without Minecraft. ``commands`` keeps the chat
    commands received and ``last_action`` the last env action, for tests to inspect."""

    def __init__(self, *, resolution: tuple[int, int] = (640, 360), inventory: dict | None = None) -> None:
        self.width, self.height = int(resolution[0]), int(resolution[1])
        self.action_space = _ActionSpace()
        self.commands: deque[str] = deque(maxlen=1000)
        self.last_action: dict[str, Any] | None = None
        self.resets = self.steps = 0
        self._start_inventory = dict(inventory or {})
        self._seed: int | None = None
        self._world: dict[str, Any] | None = None

    # -- MineRL's protocol ---------------------------------------------------------------------

    def seed(self, seed: int | None = None) -> None:
        assert isinstance(seed, int) or seed is None, "Seed must be an int!"  # MineRL's own check
        self._seed = seed

    def reset(self) -> dict[str, Any]:
        self.resets += 1
        self._world = {
            "x": 0.0,
            "z": 0.0,
            "yaw": 0.0,
            "pitch": 0.0,
            "health": 20.0,
            "mobs": [],
            "slot": 0,
            "inventory": [None] * 36,
            "stats": {k: {} for k in STATS},
        }
        for item, count in self._start_inventory.items():
            self._give(str(item), int(count))
        return self._observe()[0]

    def step(self, action: dict[str, Any]) -> tuple[dict[str, Any], float, bool, dict[str, Any]]:
        if self._world is None:
            raise RuntimeError("the Minecraft engine was stepped before reset()")
        self._check(action)
        self.last_action, self.steps = action, self.steps + 1
        w = self._world
        chat = action.get("chat", "")
        if chat:
            self._command(chat)
        for i in range(1, 10):
            if _pressed(action, f"hotbar.{i}"):
                w["slot"] = i - 1
        pitch, yaw = (float(v) for v in np.asarray(action.get("camera", (0.0, 0.0)), np.float64))
        w["pitch"], w["yaw"] = float(np.clip(w["pitch"] + pitch, -90.0, 90.0)), (w["yaw"] + yaw) % 360.0
        move = 0.2 * (_pressed(action, "forward") - _pressed(action, "back"))
        w["x"] += move * math.sin(math.radians(w["yaw"]))
        w["z"] += move * math.cos(math.radians(w["yaw"]))
        if _pressed(action, "attack"):
            self._attack()
        obs, info = self._observe()
        return obs, 0.0, False, info

    def execute_cmd(self, command: str) -> tuple[dict[str, Any], float, bool, dict[str, Any]]:
        action = self.action_space.no_op()
        action["chat"] = command
        return self.step(action)

    def close(self) -> None:
        self._world = None

    # -- the world -----------------------------------------------------------------------------

    def _check(self, action: dict[str, Any]) -> None:
        """Reject what Minecraft could not execute: the types and ranges of MineRL's action space."""
        for key in KEYS:
            value = np.asarray(action.get(key, 0))
            if value.size != 1 or int(value.reshape(-1)[0]) not in (0, 1):
                raise ValueError(f"env action {key}={action[key]!r}: a key is one 0 or 1")
        camera = np.asarray(action.get("camera", (0.0, 0.0)), np.float64)
        if camera.shape != (2,) or not np.all(np.isfinite(camera)) or np.abs(camera).max() > 180.0:
            raise ValueError(f"env action camera={camera!r}: [pitch, yaw] degrees in [-180, 180]")
        if not isinstance(action.get("chat", ""), str):
            raise ValueError(f"env action chat={action['chat']!r}: a chat command is a string")

    def _command(self, chat: str) -> None:
        self.commands.append(chat)
        w = self._world
        if chat.startswith("/kill @e[type=!player]"):
            w["mobs"] = []
        elif chat.strip() == "/kill":
            w["health"] = 20.0  # the player dies and respawns
        elif (m := _SUMMON.search(chat)) is not None:
            name, dx, _, dz = m.group(1), *map(float, m.group(2, 3, 4))
            w["mobs"].append({"name": name, "x": w["x"] + dx, "z": w["z"] + dz, "health": MOB_HEALTH.get(name, 10.0)})
        elif (m := _GIVE.match(chat)) is not None:
            self._give(m.group(1), int(m.group(2) or 1))
        elif (m := _TELEPORT.match(chat)) is not None:
            w["x"], w["z"], w["mobs"] = float(m.group(1)), float(m.group(2)), []

    def _give(self, item: str, count: int) -> None:
        slots = self._world["inventory"]
        for i, slot in enumerate(slots):
            if slot is None or slot["type"] == item:
                slots[i] = {"type": item, "quantity": (0 if slot is None else slot["quantity"]) + count}
                return

    def _attack(self) -> None:
        w = self._world
        held = w["inventory"][w["slot"]]
        damage = 6.0 if held is not None and held["type"].endswith("_sword") else 1.0
        for mob in sorted(w["mobs"], key=self._distance):
            if self._distance(mob) <= REACH and abs(self._bearing(mob)) <= HALF_FOV:
                mob["health"] -= damage
                w["stats"]["damage_dealt"][mob["name"]] = w["stats"]["damage_dealt"].get(mob["name"], 0) + damage
                if mob["health"] <= 0:
                    w["mobs"].remove(mob)
                    kills = w["stats"]["kill_entity"]
                    kills[mob["name"]] = kills.get(mob["name"], 0) + 1
                return

    def _distance(self, mob: dict) -> float:
        return math.hypot(mob["x"] - self._world["x"], mob["z"] - self._world["z"])

    def _bearing(self, mob: dict) -> float:
        w = self._world
        angle = math.degrees(math.atan2(mob["x"] - w["x"], mob["z"] - w["z"])) - w["yaw"]
        return (angle + 180.0) % 360.0 - 180.0

    def _render(self) -> np.ndarray:
        h, w_px = self.height, self.width
        frame = np.empty((h, w_px, 3), np.uint8)
        horizon = int(np.clip(h / 2 + self._world["pitch"] / 90.0 * h / 2, 0, h))
        frame[:horizon] = (120, 170, 250)
        frame[horizon:] = (70, 140, 50)
        for mob in self._world["mobs"]:
            bearing, dist = self._bearing(mob), max(self._distance(mob), 0.5)
            if abs(bearing) < HALF_FOV:
                cx, size = int(w_px / 2 + bearing / HALF_FOV * w_px / 2), int(min(h / 2, 2.0 * h / dist / 4))
                frame[max(horizon - size, 0) : horizon + size // 2, max(cx - size, 0) : cx + size] = MOB_COLOUR.get(
                    mob["name"], (200, 0, 0)
                )
        return frame

    def _observe(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Fresh dicts every call (callbacks keep the previous ``info`` to diff statistics)."""
        w = self._world
        inventory = {i: dict(s) if s else {"type": "air", "quantity": 0} for i, s in enumerate(w["inventory"])}
        held = w["inventory"][w["slot"]]
        equipped = {
            "mainhand": {"type": held["type"] if held else "air", "damage": 0, "maxDamage": 0},
            **{
                part: {"type": "air", "damage": 0, "maxDamage": 0}
                for part in ("offhand", "head", "chest", "legs", "feet")
            },
        }
        pos = {"x": w["x"], "y": 64.0, "z": w["z"], "pitch": w["pitch"], "yaw": w["yaw"]}
        obs = {
            "pov": self._render(),
            "inventory": inventory,
            "equipped_items": equipped,
            **{k: dict(v) for k, v in w["stats"].items()},
            "player_pos": pos,
            "is_gui_open": False,
        }
        location = {"xpos": w["x"], "ypos": 64.0, "zpos": w["z"], "pitch": w["pitch"], "yaw": w["yaw"], "biome_id": 1}
        info = {"is_gui_open": False, "location_stats": location, "health": w["health"], "food_level": 20}
        return obs, info


class FakeHumanSurvival:
    """Stands where ``minestudio.simulator.entry.HumanSurvival`` (MineRL's env spec) stands."""

    def __init__(
        self, *args: Any, resolution: tuple[int, int] = (640, 360), inventory: dict | None = None, **kwargs: Any
    ) -> None:
        self.resolution, self.inventory, self.kwargs = tuple(resolution), inventory, kwargs

    def make(self, fake: bool = False, **kwargs: Any) -> FakeMinecraftEngine:
        return FakeMinecraftEngine(resolution=self.resolution, inventory=self.inventory)


@contextlib.contextmanager
def fake_engine() -> Iterator[None]:
    """Simulators built inside this block run on ``FakeMinecraftEngine`` (this process only)."""
    from minestudio.simulator import entry

    saved = entry.HumanSurvival, entry.check_engine
    entry.HumanSurvival, entry.check_engine = FakeHumanSurvival, lambda *args, **kwargs: None
    try:
        yield
    finally:
        entry.HumanSurvival, entry.check_engine = saved


def _build_with_fake_engine(env_generator: Callable[[], Any]) -> Any:
    with fake_engine():
        return env_generator()


def with_fake_engine(env_generator: Callable[[], Any]) -> Callable[[], Any]:
    """``env_generator``, building its ``MinecraftSim`` on the fake engine in whatever process calls it."""
    return functools.partial(_build_with_fake_engine, env_generator)


def import_minestudio_vpt() -> types.ModuleType:
    """``minestudio.models.vpt`` (MineStudio's own ``VPTPolicy`` and ``load_vpt_policy``), imported
    without running ``minestudio/models/__init__.py``. That file also imports the ROCKET-1 and GROOT
    policies, which import torchvision, and torchvision's package-index wheels are built against CUDA
    torch (``torchvision/_C.so`` needs ``libc10_cuda.so``), so it cannot import beside CPU torch. The
    VPT subpackage itself needs no torchvision; every module of it runs as shipped."""
    if "minestudio.models" not in sys.modules:
        import minestudio

        package = types.ModuleType("minestudio.models")
        package.__path__ = [str(Path(minestudio.__file__).resolve().parent / "models")]
        sys.modules["minestudio.models"] = package
    return importlib.import_module("minestudio.models.vpt")
