"""The VPT network: ImpalaCNN, recurrent transformer blocks with memory, and the output layers.

Module and parameter names follow the layout of OpenAI's released ``.weights`` files (see
``/work/shared/fixtures/vpt_public/README.md`` section 2), so those files load with ``strict=True``.

Recurrent state: a list with one ``(state_mask, (K, V))`` tuple per block. ``state_mask`` is bool
(B, 1, maxlen): True where the stored frame belongs to the current episode; ``K``/``V`` (B, maxlen,
hid) are the key/value projections of the most recent ``maxlen`` frames. Rows of a finished episode
stay in K/V after a reset; only the mask hides them (as in VPT).

Episode starts (``first``) are honoured at every step of a call, so one call over T steps computes
exactly what T calls of one step compute. ``honor_all_firsts=False`` reproduces OpenAI's chunked
forward, which looks at ``first[:, 0]`` only; it exists for checks against their reference outputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

State = list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]


def fan_in_init_(weight: torch.Tensor, scale: float = 1.0) -> None:
    """Gaussian weights with each output unit's weight vector rescaled to norm ``scale``."""
    with torch.no_grad():
        weight.normal_()
        norms = weight.flatten(1).norm(dim=1).clamp(min=1e-12)
        weight.mul_((scale / norms).view(-1, *([1] * (weight.dim() - 1))))


class NormConv(nn.Module):
    """[GroupNorm(1)] -> Conv3x3 -> ReLU; the bias is kept only when there is no norm."""

    def __init__(self, c_in: int, c_out: int, *, norm: bool) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(1, c_in) if norm else None
        self.layer = nn.Conv2d(c_in, c_out, 3, padding=1, bias=not norm)
        fan_in_init_(self.layer.weight)
        if self.layer.bias is not None:
            nn.init.zeros_(self.layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        return F.relu(self.layer(x))


class NormLinear(nn.Module):
    """[LayerNorm] -> Linear -> [ReLU]."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        norm: bool = True,
        bias: bool = False,
        relu: bool = True,
        init_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_in) if norm else None
        self.layer = nn.Linear(d_in, d_out, bias=bias)
        self.relu = relu
        fan_in_init_(self.layer.weight, init_scale)
        if bias:
            nn.init.zeros_(self.layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        x = self.layer(x)
        return F.relu(x) if self.relu else x


class ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv0 = NormConv(channels, channels, norm=True)
        self.conv1 = NormConv(channels, channels, norm=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(self.conv0(x))


class DownStack(nn.Module):
    """firstconv -> MaxPool(3, stride 2, pad 1) -> GroupNorm -> 2 residual blocks; halves H and W."""

    def __init__(self, c_in: int, c_out: int, *, first: bool) -> None:
        super().__init__()
        self.firstconv = NormConv(c_in, c_out, norm=not first)
        self.n = nn.GroupNorm(1, c_out)
        self.blocks = nn.ModuleList([ResidualBlock(c_out), ResidualBlock(c_out)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.n(F.max_pool2d(self.firstconv(x), 3, stride=2, padding=1))
        for block in self.blocks:
            x = block(x)
        return x


class ImpalaCNN(nn.Module):
    """Three down-stacks and a dense layer; works for any H, W divisible by 8."""

    def __init__(self, *, img_hw: tuple[int, int], chans: Sequence[int], out_size: int = 256) -> None:
        super().__init__()
        h, w = img_hw
        if h % 8 or w % 8:
            raise ValueError(f"image height and width must be divisible by 8, got {h}x{w}")
        c_in = 3
        stacks = []
        for i, c in enumerate(chans):
            stacks.append(DownStack(c_in, c, first=i == 0))
            c_in = c
        self.stacks = nn.ModuleList(stacks)
        scale = 2 ** len(chans)
        self.dense = NormLinear(c_in * math.ceil(h / scale) * math.ceil(w / scale), out_size)
        # Gradient checkpointing: store only the CNN's input and output and recompute its activations
        # in backward, ``checkpoint_frames`` frames at a time. The CNN holds most of VPT's activation
        # memory (1x: tens of MB per frame); the recompute costs one more CNN forward.
        self.gradient_checkpointing = False
        self.checkpoint_frames = 32

    def _stacks(self, x: torch.Tensor) -> torch.Tensor:
        for stack in self.stacks:
            x = stack(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gradient_checkpointing and torch.is_grad_enabled():
            parts = x.split(self.checkpoint_frames)
            x = torch.cat([checkpoint(self._stacks, part, use_reentrant=False) for part in parts])
        else:
            x = self._stacks(x)
        return self.dense(x.flatten(1))  # (C, H, W) flattening order


class ImgProcess(nn.Module):
    def __init__(self, *, img_hw: tuple[int, int], chans: Sequence[int], hidsize: int) -> None:
        super().__init__()
        self.cnn = ImpalaCNN(img_hw=img_hw, chans=chans)
        self.linear = NormLinear(256, hidsize)

    def forward(self, img: torch.Tensor, intermediates: dict | None = None) -> torch.Tensor:
        b, t = img.shape[:2]
        x = img.reshape(b * t, *img.shape[2:]).permute(0, 3, 1, 2)  # NHWC uint8 -> NCHW
        x = x.to(self.linear.layer.weight.dtype) / 255.0  # no mean/std normalisation, as in VPT
        x = self.cnn(x).reshape(b, t, -1)
        if intermediates is not None:
            intermediates["cnn_out"] = x
        return self.linear(x)


class MaskedAttention(nn.Module):
    """Multi-head attention over the last ``maxlen`` frames, with a learned relative-position bias.

    Logits are ``q.k / hd`` (not 1/sqrt(hd), as in VPT) plus ``sum_n R[i, head, n] * b_nd[n, d]`` where
    d is the distance from query to key.
    """

    N_BIAS = 10

    def __init__(self, hidsize: int, heads: int, maxlen: int, *, init_scale: float = 1.0) -> None:
        super().__init__()
        if hidsize % heads:
            raise ValueError(f"hidsize {hidsize} is not divisible by attention_heads {heads}")
        self.heads, self.maxlen, self.hd = heads, maxlen, hidsize // heads
        # Small but non-zero, so that r_layer receives gradients from the first step.
        self.b_nd = nn.Parameter(torch.randn(self.N_BIAS, maxlen) * 0.02)
        self.q_layer = nn.Linear(hidsize, hidsize)
        self.k_layer = nn.Linear(hidsize, hidsize, bias=False)
        self.v_layer = nn.Linear(hidsize, hidsize, bias=False)
        self.proj_layer = nn.Linear(hidsize, hidsize)
        self.r_layer = nn.Linear(hidsize, self.N_BIAS * heads)
        for layer, scale in (
            (self.q_layer, 1.0),
            (self.k_layer, 1.0),
            (self.v_layer, 1.0),
            (self.proj_layer, init_scale),
            (self.r_layer, 1.0),
        ):
            fan_in_init_(layer.weight, scale)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)

    def forward(
        self, h: torch.Tensor, allowed: torch.Tensor, dist: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, t, _ = h.shape
        k_all = torch.cat([kv[0].to(h.dtype), self.k_layer(h)], dim=1)  # (B, maxlen + t, hid)
        v_all = torch.cat([kv[1].to(h.dtype), self.v_layer(h)], dim=1)
        q = self.q_layer(h)

        def split(x: torch.Tensor) -> torch.Tensor:  # channel = head * hd + j
            return x.view(b, x.shape[1], self.heads, self.hd).transpose(1, 2)

        r = self.r_layer(h).view(b, t, self.heads, self.N_BIAS)
        rel_by_dist = torch.einsum("bthn,nd->bhtd", r, self.b_nd.to(h.dtype))  # (B, heads, t, maxlen)
        rel = rel_by_dist.gather(-1, dist.expand(b, self.heads, t, dist.shape[-1]))
        # The fill comes from the range of the dtype attention computes in: -1e9 overflows float16
        # (max 65504). Every query sees at least its own frame, so no row is all fill.
        bias = rel.to(q.dtype).masked_fill(~allowed[:, None], torch.finfo(q.dtype).min)
        out = F.scaled_dot_product_attention(split(q), split(k_all), split(v_all), attn_mask=bias, scale=1.0 / self.hd)
        out = self.proj_layer(out.transpose(1, 2).reshape(b, t, -1))
        # The state keeps its own dtype (float32) whatever autocast computed in.
        return out, (k_all[:, -self.maxlen :].to(kv[0].dtype), v_all[:, -self.maxlen :].to(kv[1].dtype))


class _AttentionHolder(nn.Module):
    """Holds the attention as ``orc_block`` so parameter names match VPT's ``r.orc_block.*``."""

    def __init__(self, attention: MaskedAttention) -> None:
        super().__init__()
        self.orc_block = attention


class TransformerBlock(nn.Module):
    """``h = LN(x); a = h + Attn(h); out = a + mlp1(mlp0(a))`` (the residual adds h, not x)."""

    def __init__(self, hidsize: int, heads: int, maxlen: int, *, pointwise_ratio: int, n_blocks: int) -> None:
        super().__init__()
        residual_scale = n_blocks**-0.5  # keeps the residual stream's scale independent of depth
        self.mlp0 = NormLinear(hidsize, hidsize * pointwise_ratio)
        self.mlp1 = NormLinear(
            hidsize * pointwise_ratio, hidsize, norm=False, bias=True, relu=False, init_scale=residual_scale
        )
        self.pre_r_ln = nn.LayerNorm(hidsize)
        self.r = _AttentionHolder(MaskedAttention(hidsize, heads, maxlen, init_scale=residual_scale))

    def forward(self, x, allowed, dist, kv):  # type: ignore[no-untyped-def]
        h = self.pre_r_ln(x)
        attn, kv_out = self.r.orc_block(h, allowed, dist, kv)
        a = h + attn
        return a + self.mlp1(self.mlp0(a)), kv_out


class RecurrentLayer(nn.Module):
    def __init__(self, hidsize: int, heads: int, maxlen: int, n_layers: int, pointwise_ratio: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            TransformerBlock(hidsize, heads, maxlen, pointwise_ratio=pointwise_ratio, n_blocks=n_layers)
            for _ in range(n_layers)
        )


def attention_masks(
    first: torch.Tensor, state_mask: torch.Tensor, maxlen: int, *, honor_all_firsts: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which keys each query may see, the query-to-key distances, and the next state mask.

    Keys are ``maxlen`` state columns (oldest first) followed by the call's ``t`` frames. A key is
    allowed iff it lies in the band ``0 <= d < maxlen`` (d = maxlen + i - j) and belongs to the
    query's episode: a state column needs ``state_mask`` and no episode start in steps 0..i; a frame
    of the call needs no episode start after it up to i.
    """
    b, t = first.shape
    device = first.device
    if honor_all_firsts:
        episode = first.long().cumsum(1)  # (B, t): episodes started within the call so far
    else:
        episode = first[:, :1].long().expand(b, t)
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(maxlen + t, device=device)[None, :]
    dist = maxlen + i - j
    band = (dist >= 0) & (dist < maxlen)
    fresh = episode == 0  # (B, t): still in the episode the state belongs to
    state_ok = state_mask.expand(b, t, maxlen) & fresh[:, :, None]
    frame_ok = episode[:, :, None] == episode[:, None, :]  # (B, t_query, t_key)
    allowed = band[None] & torch.cat([state_ok, frame_ok], dim=-1)
    # The next state mask: which of the last maxlen frames belong to the episode of the final step.
    last = episode[:, -1:]
    next_mask = torch.cat([state_mask[:, 0] & fresh[:, -1:], episode == last], dim=-1)[:, -maxlen:]
    dist = dist.clamp(0, maxlen - 1)[None, None]  # (1, 1, t, maxlen + t) gather index
    return allowed, dist, next_mask[:, None]


class VPTNet(nn.Module):
    """Image -> ImpalaCNN -> linear -> transformer blocks -> ReLU -> lastlayer -> final LayerNorm."""

    def __init__(
        self,
        *,
        img_shape: Sequence[int],
        hidsize: int,
        impala_width: int,
        impala_chans: Sequence[int],
        n_recurrence_layers: int,
        attention_heads: int,
        attention_memory_size: int,
        timesteps: int,
        pointwise_ratio: int = 4,
        use_pre_lstm_ln: bool = False,
        honor_all_firsts: bool = True,
    ) -> None:
        super().__init__()
        self.maxlen = attention_memory_size - timesteps
        if self.maxlen <= 0:
            raise ValueError(f"attention_memory_size ({attention_memory_size}) must exceed timesteps ({timesteps})")
        self.hidsize, self.honor_all_firsts = hidsize, honor_all_firsts
        self.img_shape = tuple(int(d) for d in img_shape)
        chans = [impala_width * c for c in impala_chans]
        self.img_process = ImgProcess(img_hw=(int(img_shape[0]), int(img_shape[1])), chans=chans, hidsize=hidsize)
        self.pre_lstm_ln = nn.LayerNorm(hidsize) if use_pre_lstm_ln else None
        self.recurrent_layer = RecurrentLayer(
            hidsize, attention_heads, self.maxlen, n_recurrence_layers, pointwise_ratio
        )
        self.lastlayer = NormLinear(hidsize, hidsize)
        self.final_ln = nn.LayerNorm(hidsize)

    def initial_state(self, batch_size: int) -> State:
        p = self.final_ln.weight
        kv = lambda: torch.zeros(batch_size, self.maxlen, self.hidsize, dtype=p.dtype, device=p.device)  # noqa: E731
        mask = lambda: torch.zeros(batch_size, 1, self.maxlen, dtype=torch.bool, device=p.device)  # noqa: E731
        return [(mask(), (kv(), kv())) for _ in self.recurrent_layer.blocks]

    def forward(
        self, img: torch.Tensor, first: torch.Tensor, state: State, intermediates: dict | None = None
    ) -> tuple[torch.Tensor, State]:
        """``img`` uint8 (B, T, H, W, 3), ``first`` bool (B, T) -> latent (B, T, hid), next state."""
        first = first.to(device=img.device, dtype=torch.bool)
        x = self.img_process(img, intermediates)
        if intermediates is not None:
            intermediates["img_embed"] = x
        if self.pre_lstm_ln is not None:
            x = self.pre_lstm_ln(x)
        new_state: State = []
        cache: dict[int, tuple] = {}
        for idx, (block, (mask, kv)) in enumerate(zip(self.recurrent_layer.blocks, state)):
            if mask is None:  # OpenAI's initial state stores None for "nothing visible"
                mask = torch.zeros(img.shape[0], 1, self.maxlen, dtype=torch.bool, device=img.device)
            key = id(mask)  # blocks usually share one mask object: build the masks once
            if key not in cache:
                cache[key] = attention_masks(first, mask.bool(), self.maxlen, honor_all_firsts=self.honor_all_firsts)
            allowed, dist, next_mask = cache[key]
            x, kv_out = block(x, allowed, dist, kv)
            new_state.append((next_mask, kv_out))
            if intermediates is not None:
                intermediates[f"block{idx}_out"] = x
        x = self.lastlayer(F.relu(x))
        if intermediates is not None:
            intermediates["lastlayer_out"] = x
        x = self.final_ln(x)
        if intermediates is not None:
            intermediates["latent"] = x
        return x, new_state
