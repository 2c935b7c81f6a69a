"""Episode videos: frames the agent saw, with the return so far and the value estimate, as mp4 bytes.

Rollout workers call ``encode_episode_video`` on the frames of one whole episode and send the bytes
to the ``LoggerHub``, which writes the file under the run directory and hands its path to every
logger. Encoding is H.264 in ``yuv420p`` through imageio-ffmpeg's bundled ffmpeg, so any browser and
wandb can play the result.

The overlay is a strip appended *below* the frame (it never hides what the agent saw) with two
numbers written with Pillow's ``ImageDraw`` in its bundled font: ``R`` the undiscounted return so far
and ``V`` the policy's value estimate.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

_RETURN_COLOUR = (255, 255, 255)
_VALUE_COLOUR = (255, 210, 60)
_STRIP_COLOUR = (24, 24, 24)
# Short side of a video by default: Crafter's 64 px frames are too small to watch.
MIN_SIDE = 256


def format_number(x: float) -> str:
    """A short rendering of ``x`` for the overlay."""
    if x is None or not math.isfinite(x):
        return "?"
    if abs(x) >= 1e5:
        return f"{x:.2e}".replace("e+0", "e").replace("e-0", "e-").replace("e+", "e")
    return f"{x:.2f}"


def _font(height: int) -> Any:
    from PIL import ImageFont

    return ImageFont.load_default(size=height)  # Pillow's bundled font, scaled: no font file to find


def _as_hwc_uint8(frame: np.ndarray) -> np.ndarray:
    frame = np.asarray(frame)
    if frame.ndim == 2:
        frame = np.repeat(frame[..., None], 3, axis=-1)
    if frame.ndim == 3 and frame.shape[0] in (1, 3) and frame.shape[-1] not in (1, 3):
        frame = frame.transpose(1, 2, 0)  # CHW (torch layout) -> HWC
    if frame.ndim != 3 or frame.shape[-1] not in (1, 3):
        raise ValueError(f"a video frame must be (H, W, 3) or (H, W); got shape {frame.shape}")
    if frame.shape[-1] == 1:
        frame = np.repeat(frame, 3, axis=-1)
    if frame.dtype != np.uint8:
        # float frames in [0, 1] are common for normalised observations
        scale = 255.0 if np.issubdtype(frame.dtype, np.floating) and frame.max(initial=0) <= 1.0 else 1.0
        frame = np.clip(frame * scale, 0, 255).astype(np.uint8)
    return frame


def auto_upscale(shape: Sequence[int], *, min_side: int = MIN_SIDE) -> int:
    """The smallest integer zoom that makes the short side of an (H, W) frame at least ``min_side``."""
    return max(1, math.ceil(min_side / max(1, min(shape[0], shape[1]))))


def compose_frames(
    frames: Sequence[np.ndarray],
    *,
    returns: Sequence[float] | None = None,
    values: Sequence[float] | None = None,
    upscale: int | None = None,
) -> np.ndarray:
    """The frames as they will be encoded: (N, H', W', 3) uint8, upscaled, overlaid, even-sized."""
    if len(frames) == 0:
        raise ValueError("encode_episode_video needs at least one frame; got an empty list")
    if upscale is None:
        upscale = auto_upscale(_as_hwc_uint8(frames[0]).shape[:2])
    if upscale < 1:
        raise ValueError(f"video upscale must be an integer >= 1; got {upscale}")
    for name, series in (("returns", returns), ("values", values)):
        if series is not None and len(series) != len(frames):
            raise ValueError(f"{name} has {len(series)} entries but there are {len(frames)} frames; give one per frame")
    first = _as_hwc_uint8(frames[0])
    h, w = first.shape[0] * upscale, first.shape[1] * upscale
    # The strip holds one line of text, sized to stay legible on large frames.
    text_h = max(10, w // 20)
    strip = text_h + text_h // 2 if (returns is not None or values is not None) else 0
    out_h, out_w = h + strip, w
    out_h += out_h % 2  # yuv420p needs even dimensions
    out_w += out_w % 2
    video = np.zeros((len(frames), out_h, out_w, 3), dtype=np.uint8)
    font = _font(text_h) if strip else None
    for i, frame in enumerate(frames):
        frame = _as_hwc_uint8(frame)
        if frame.shape[0] * upscale != h or frame.shape[1] * upscale != w:
            raise ValueError(
                f"frame {i} has shape {frame.shape}, unlike frame 0 {first.shape}; "
                "an episode's frames must share one size"
            )
        if upscale > 1:
            frame = np.repeat(np.repeat(frame, upscale, axis=0), upscale, axis=1)
        video[i, :h, :w] = frame
        if strip:
            video[i, h:] = _STRIP_COLOUR
            video[i, h:] = _overlay(
                video[i, h:],
                font,
                returns[i] if returns is not None else None,
                values[i] if values is not None else None,
            )
    return video


def _overlay(strip: np.ndarray, font: Any, ret: float | None, value: float | None) -> np.ndarray:
    """The strip under a frame with ``R`` (return so far) and ``V`` (value estimate) written on it."""
    from PIL import Image, ImageDraw

    image = Image.fromarray(np.ascontiguousarray(strip))
    draw = ImageDraw.Draw(image)
    x, y = font.size // 2, font.size // 4
    if ret is not None:
        text = "R " + format_number(float(ret))
        draw.text((x, y), text, fill=_RETURN_COLOUR, font=font)
        x += draw.textlength(text + "   ", font=font)
    if value is not None:
        draw.text((x, y), "V " + format_number(float(value)), fill=_VALUE_COLOUR, font=font)
    return np.asarray(image)


def encode_episode_video(
    frames: Sequence[np.ndarray],
    *,
    fps: int,
    returns: Sequence[float] | None = None,
    values: Sequence[float] | None = None,
    upscale: int | None = None,
) -> bytes:
    """Encode one episode as an H.264 mp4 and return the file's bytes.

    ``frames``: (H, W, 3) uint8 arrays (grayscale, CHW and float-in-[0, 1] frames are converted).
    ``returns``/``values``: one number per frame (return so far, value estimate), drawn in a strip
    under the frame when given. ``upscale``: integer nearest-neighbour zoom; None picks the smallest
    that makes the short side at least 256 px (Crafter's 64x64 frames become 256x256).
    """
    import imageio_ffmpeg  # an ffmpeg process per video; imported here so the module stays light

    if fps <= 0:
        raise ValueError(f"video fps must be > 0; got {fps} (worker_config.video_fps)")
    video = compose_frames(frames, returns=returns, values=values, upscale=upscale)
    n, h, w, _ = video.shape
    fd, path = tempfile.mkstemp(suffix=".mp4", prefix="mineonline-video-")
    os.close(fd)
    try:
        writer = imageio_ffmpeg.write_frames(
            path,
            (w, h),
            fps=fps,
            codec="libx264",
            pix_fmt_in="rgb24",
            pix_fmt_out="yuv420p",
            quality=7,  # crf 15: pixel-art frames stay crisp, files stay small
            macro_block_size=1,  # dimensions are already even; no resizing
            ffmpeg_log_level="error",
        )
        writer.send(None)
        for frame in video:
            writer.send(np.ascontiguousarray(frame))
        writer.close()
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)
