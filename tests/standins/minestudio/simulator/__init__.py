"""Stand-in for ``minestudio.simulator``: a MinecraftSim with the real one's I/O structure."""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np


class MinecraftSim(gymnasium.Env):
    def __init__(self, obs_size=(128, 128), action_type="agent", timestep_limit=1000, callbacks=(), **kwargs: Any) -> None:
        assert action_type == "agent", "the stand-in models agent actions only"
        self.obs_size, self.timestep_limit, self.callbacks, self.kwargs = tuple(obs_size), timestep_limit, list(callbacks), kwargs
        self.t, self.kills = 0, 0
        self.rng = np.random.default_rng(kwargs.get("seed", 0))

    @property
    def observation_space(self) -> gymnasium.spaces.Dict:
        h, w = self.obs_size
        return gymnasium.spaces.Dict({"image": gymnasium.spaces.Box(0, 255, (h, w, 3), np.uint8)})

    @property
    def action_space(self) -> gymnasium.spaces.Dict:
        return gymnasium.spaces.Dict({"buttons": gymnasium.spaces.MultiDiscrete([8641]), "camera": gymnasium.spaces.MultiDiscrete([121])})

    def _obs(self) -> tuple[dict, dict]:
        h, w = self.obs_size
        frame = ((np.arange(h)[:, None, None] + np.arange(w)[None, :, None] + 7 * self.t + np.arange(3)) % 256).astype(np.uint8)
        # Event counters as MineStudio reports them (info[event][object]), which its RewardsCallback reads.
        info = {"pov": frame, "location_stats": {"xpos": float(self.t)}, "health": 20.0, "kill_entity": {"cow": self.kills}}
        return {"image": frame}, info

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        self.t, self.kills = 0, 0
        return self._obs()

    def step(self, action: dict) -> tuple[dict, float, bool, bool, dict]:
        buttons, camera = np.asarray(action["buttons"]), np.asarray(action["camera"])
        assert buttons.shape == (1,) and camera.shape == (1,), (buttons.shape, camera.shape)
        assert 0 <= int(buttons[0]) < 8641 and 0 <= int(camera[0]) < 121
        self.t += 1
        reward = float(int(buttons[0]) % 5 == 4)  # "attack" pressed: a cow killed
        self.kills += int(reward)
        obs, info = self._obs()
        done = self.t >= self.timestep_limit
        return obs, reward, done, done, info
