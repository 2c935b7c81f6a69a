"""``VPTPolicy``: the VPT network with its action and value heads, as a mineonline ``Policy``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from mineonline_core.errors import ConfigError
from mineonline_core.contracts.policy import CategoricalHead, Policy, ValueHead
from mineonline_vpt.actions import N_BUTTONS, N_CAMERA
from mineonline_vpt.heads import DictActionHead, minecraft_head
from mineonline_vpt.loader import VPTModelFileError, load_weights_strict, read_model_file, read_weights
from mineonline_vpt.network import State, VPTNet

# Architecture keys of a VPT .model file this implementation reproduces, with the only values it
# supports; a file asking for anything else is refused rather than silently computed differently.
_FIXED_FLAGS = {
    "attention_mask_style": "clipped_causal",
    "recurrence_type": "transformer",
    "use_pointwise_layer": True,
    "pointwise_use_activation": False,
    "recurrence_is_residual": True,
}
_ARCH_KEYS = (
    "hidsize",
    "impala_width",
    "impala_chans",
    "n_recurrence_layers",
    "attention_heads",
    "attention_memory_size",
    "timesteps",
    "pointwise_ratio",
)


class VPTPolicyConfig(BaseModel):
    """Options of ``policy_config`` when ``policy_config.name`` is ``vpt``."""

    model_config = ConfigDict(extra="forbid")

    model_path: str | None = Field(
        None, description="An OpenAI VPT .model file; it fixes the architecture, so the size keys below are refused."
    )
    weights_path: str | None = Field(None, description="The matching .weights file; omitted: random initialisation.")
    hidsize: int = Field(256, gt=0, description="Width of the transformer (1024 in foundation-model-1x).")
    impala_width: int = Field(1, gt=0, description="Multiplier of impala_chans.")
    impala_chans: list[int] = Field([16, 32, 32], min_length=1, description="ImpalaCNN channels per down-stack.")
    n_recurrence_layers: int = Field(2, gt=0, description="Number of transformer blocks.")
    attention_heads: int = Field(4, gt=0, description="Attention heads; must divide hidsize.")
    attention_memory_size: int = Field(128, gt=0, description="Memory length plus timesteps (VPT's convention).")
    timesteps: int = Field(64, ge=0, description="Subtracted from attention_memory_size to give the memory length.")
    pointwise_ratio: int = Field(4, gt=0, description="Hidden width of each block's MLP, in multiples of hidsize.")
    temperature: float = Field(1.0, gt=0, description="Logits are divided by this before the softmax.")
    normalize_value: bool = Field(True, description="Predict values normalised by a running mean/std.")
    image_key: str = Field("image", description="The observation key holding uint8 (H, W, 3) frames.")
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute the ImpalaCNN's activations in backward: far less training memory, ~1/3 more compute.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> VPTPolicyConfig:
        if self.hidsize % self.attention_heads:
            raise ValueError(
                f"policy_config.attention_heads={self.attention_heads} must divide hidsize={self.hidsize}; "
                f"pick e.g. attention_heads={max(h for h in range(1, 9) if self.hidsize % h == 0)}."
            )
        if self.attention_memory_size <= self.timesteps:
            raise ValueError(
                f"policy_config.attention_memory_size={self.attention_memory_size} must exceed timesteps="
                f"{self.timesteps}: the memory holds attention_memory_size - timesteps frames."
            )
        return self


def _image_shape(observation_space: Any, key: str) -> tuple[int, int, int] | None:
    if observation_space is None:
        return None
    spaces = getattr(observation_space, "spaces", None)
    space = spaces.get(key) if isinstance(spaces, Mapping) else observation_space
    shape = getattr(space, "shape", None)
    if space is None or shape is None or len(shape) != 3 or shape[-1] != 3:
        raise ConfigError(
            f"policy_config.image_key: the observation space has no uint8 (H, W, 3) image under {key!r} "
            f"(got {observation_space}). Set image_key to the key of the RGB frame."
        )
    return int(shape[0]), int(shape[1]), int(shape[2])


def _action_head(action_space: Any, hidsize: int, temperature: float) -> torch.nn.Module:
    """A head matching ``action_space``: Discrete -> categorical; Dict -> one categorical per key."""
    if action_space is None:
        return minecraft_head(hidsize, temperature=temperature)
    n = getattr(action_space, "n", None)
    if n is not None and not hasattr(action_space, "spaces"):
        head = CategoricalHead(hidsize, int(n), temperature=temperature)
        torch.nn.init.orthogonal_(head.linear.weight, gain=0.01)  # near-uniform initial policy
        torch.nn.init.zeros_(head.linear.bias)
        return head
    spaces = getattr(action_space, "spaces", None)
    if isinstance(spaces, Mapping):
        sizes, singleton = {}, {}
        keys = ["camera", "buttons"] if set(spaces) == {"camera", "buttons"} else list(spaces)  # VPT's order
        for key in keys:
            sub = spaces[key]
            if getattr(sub, "n", None) is not None:
                sizes[key], singleton[key] = int(sub.n), False
            elif getattr(sub, "nvec", None) is not None and len(sub.nvec) == 1:
                sizes[key], singleton[key] = int(sub.nvec[0]), True
            else:
                raise ConfigError(
                    f"vpt policy: action key {key!r} has space {sub}; "
                    "only Discrete(n) and MultiDiscrete([n]) are supported."
                )
        return DictActionHead(hidsize, sizes, temperature=temperature, singleton=singleton)
    raise ConfigError(f"vpt policy: unsupported action space {action_space}; use Discrete(n) or a Dict of them.")


def _check_agent_action_space(action_space: Any) -> None:
    """A released VPT model acts in its joint space: buttons (8641) and camera (121)."""
    spaces = getattr(action_space, "spaces", None)
    if action_space is None:
        return
    sizes = {}
    if isinstance(spaces, Mapping):
        for key, sub in spaces.items():
            n = getattr(sub, "n", None)
            nvec = getattr(sub, "nvec", None)
            sizes[key] = int(n) if n is not None else (int(nvec[0]) if nvec is not None and len(nvec) == 1 else None)
    if sizes != {"buttons": N_BUTTONS, "camera": N_CAMERA}:
        raise ConfigError(
            f"policy_config.model_path: a released VPT model acts in VPT's joint action space "
            f"{{buttons: MultiDiscrete([{N_BUTTONS}]), camera: MultiDiscrete([{N_CAMERA}])}} (MinecraftSim's "
            f"agent action space), but the env's action space is {action_space}. Use MinecraftSim's default "
            f"action space, or convert MineRL env actions with mineonline_vpt.actions.env_to_agent/agent_to_env."
        )


class VPTPolicy(Policy):
    """OpenAI's VPT architecture (ImpalaCNN + recurrent transformer) with pi and value heads.

    ``latents["pi_logits"]`` are normalised log-probs per action key; ``latents["vpred"]`` is the
    normalised value (B, T, 1); ``value_head.denormalize`` gives returns.
    """

    name: ClassVar[str] = "vpt"
    Config: ClassVar[type[BaseModel]] = VPTPolicyConfig
    supports_float16: ClassVar[bool] = True  # the attention mask fills from the dtype's range

    def __init__(
        self,
        *,
        net_kwargs: Mapping[str, Any],
        pi_head: torch.nn.Module,
        normalize_value: bool = True,
        image_key: str = "image",
    ) -> None:
        super().__init__()
        self.net = VPTNet(**net_kwargs)
        self.value_head = ValueHead(self.net.hidsize, normalize=normalize_value)
        self.pi_head = pi_head
        self.image_key = image_key

    # ----------------------------------------------------------------------------------- building
    @classmethod
    def from_vpt_kwargs(
        cls,
        policy_kwargs: Mapping[str, Any],
        *,
        temperature: float = 1.0,
        action_space: Any = None,
        honor_all_firsts: bool = True,
    ) -> VPTPolicy:
        """The released architecture described by a ``.model`` file's policy kwargs."""
        for key, value in _FIXED_FLAGS.items():
            if key in policy_kwargs and policy_kwargs[key] != value:
                raise VPTModelFileError(
                    f"VPT policy kwargs: {key}={policy_kwargs[key]!r} is not supported (only {value!r})."
                )
        norm = dict(policy_kwargs.get("init_norm_kwargs") or {})
        if norm.get("batch_norm") or norm.get("group_norm_groups", 1) != 1:
            raise VPTModelFileError(
                f"VPT policy kwargs: init_norm_kwargs={norm} is not supported (only group_norm_groups=1)."
            )
        if (policy_kwargs.get("impala_kwargs") or {}).get("post_pool_groups", 1) != 1:
            raise VPTModelFileError("VPT policy kwargs: impala_kwargs.post_pool_groups other than 1 is not supported.")
        missing = [k for k in _ARCH_KEYS if k not in policy_kwargs and k != "pointwise_ratio"]
        if missing:
            raise VPTModelFileError(f"VPT policy kwargs lack {missing}; is this a VPT .model file?")
        net_kwargs = {k: policy_kwargs[k] for k in _ARCH_KEYS if k in policy_kwargs}
        net_kwargs["img_shape"] = list(policy_kwargs.get("img_shape", (128, 128, 3)))
        net_kwargs["use_pre_lstm_ln"] = bool(policy_kwargs.get("use_pre_lstm_ln", False))
        net_kwargs["honor_all_firsts"] = honor_all_firsts
        head = _action_head(action_space, int(policy_kwargs["hidsize"]), temperature)
        return cls(net_kwargs=net_kwargs, pi_head=head)

    @classmethod
    def build(
        cls, options: BaseModel | Mapping[str, Any], *, observation_space: Any = None, action_space: Any = None
    ) -> VPTPolicy:
        opts = options if isinstance(options, VPTPolicyConfig) else VPTPolicyConfig.model_validate(dict(options))
        image_shape = _image_shape(observation_space, opts.image_key)
        if opts.model_path is not None:
            clash = sorted(set(opts.model_fields_set) & {*_ARCH_KEYS, "temperature"})
            if clash:
                raise ConfigError(
                    f"policy_config: {clash} cannot be combined with model_path={opts.model_path!r}; the "
                    f".model file fixes the architecture. Remove those keys, or remove model_path."
                )
            _check_agent_action_space(action_space)
            policy = load_vpt_policy(opts.model_path, opts.weights_path, action_space=action_space)
            want = policy.net.img_shape
            if image_shape is not None and image_shape != want:
                raise ConfigError(
                    f"policy_config.model_path: the VPT model expects {want} images but the env's "
                    f"{opts.image_key!r} observations are {image_shape}; resize frames to {want[:2]} "
                    f"(VPT was trained on cv2.INTER_LINEAR resizes) in the env wrapper."
                )
            policy.net.img_process.cnn.gradient_checkpointing = opts.gradient_checkpointing
            policy.image_key = opts.image_key
            policy.value_head.use_normalizer = opts.normalize_value
            return policy
        if opts.weights_path is not None:
            raise ConfigError("policy_config.weights_path needs policy_config.model_path (the architecture).")
        net_kwargs = {k: getattr(opts, k) for k in _ARCH_KEYS}
        net_kwargs["img_shape"] = list(image_shape or (128, 128, 3))
        head = _action_head(action_space, opts.hidsize, opts.temperature)
        policy = cls(
            net_kwargs=net_kwargs, pi_head=head, normalize_value=opts.normalize_value, image_key=opts.image_key
        )
        policy.net.img_process.cnn.gradient_checkpointing = opts.gradient_checkpointing
        return policy

    # ----------------------------------------------------------------------------------- running
    def initial_state(self, batch_size: int) -> State:
        return self.net.initial_state(batch_size)

    def forward(
        self,
        input: dict,
        state_in: Any = None,
        context: dict | None = None,  # noqa: A002
        intermediates: dict | None = None,
    ) -> tuple[dict, State]:
        img = input[self.image_key] if self.image_key in input else input["img"]
        device = self.net.final_ln.weight.device
        img = torch.as_tensor(img, device=device)
        b, t = img.shape[:2]
        first = (context or {}).get("first")
        first = (
            torch.zeros(b, t, dtype=torch.bool, device=device)
            if first is None
            else torch.as_tensor(first, device=device)
        )
        state = self.initial_state(b) if state_in is None else state_in
        latent, state_out = self.net(img, first, state, intermediates)
        # The heads run in float32 even under autocast: PPO's ratio exp(logp - logp_old) would carry
        # bfloat16's ~1% rounding error otherwise.
        with torch.autocast(device.type, enabled=False):
            latent = latent.to(torch.promote_types(latent.dtype, torch.float32))
            latents = {"pi_logits": self.pi_head(latent), "vpred": self.value_head(latent)}
        return latents, state_out


def load_vpt_policy(
    model_path: str | os.PathLike,
    weights_path: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    *,
    action_space: Any = None,
) -> VPTPolicy:
    """Build the architecture a VPT ``.model`` file describes and, if given, load its ``.weights``."""
    kwargs, head_opts = read_model_file(model_path)
    temperature = float(head_opts.get("temperature", 1.0))
    policy = VPTPolicy.from_vpt_kwargs(kwargs, temperature=temperature, action_space=action_space)
    if weights_path is not None:
        load_weights_strict(policy, read_weights(weights_path), source=os.fspath(weights_path))
    return policy.to(device)
