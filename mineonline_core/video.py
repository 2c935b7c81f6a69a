"""Episode videos: frames the agent saw, with the return so far and the value estimate, as mp4 bytes.

Rollout workers call ``encode_episode_video`` on the frames of one whole episode and send the bytes
to the ``LoggerHub``, which writes the file under the run directory and hands its path to every
logger. Encoding is H.264 in ``yuv420p`` through imageio-ffmpeg's bundled ffmpeg, so any browser and
wandb can play the result.

The overlay is a strip appended *below* the frame (it never hides what the agent saw) with two
numbers written in a 3x5 bitmap font drawn with numpy: ``R`` the undiscounted return so far and
``V`` the policy's value estimate. No PIL or OpenCV is needed.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence

import numpy as np

# 3 columns x 5 rows per glyph; "1" = ink. Only what number formatting can produce, plus labels.
_GLYPH_ROWS = {
    "0": ("111", "101", "101", "101", "111"),
    "1": ("010", "110", "010", "010", "111"),
    "2": ("111", "001", "111", "100", "111"),
    "3": ("111", "001", "111", "001", "111"),
    "4": ("101", "101", "111", "001", "001"),
    "5": ("111", "100", "111", "001", "111"),
    "6": ("111", "100", "111", "101", "111"),
    "7": ("111", "001", "001", "001", "001"),
    "8": ("111", "101", "111", "101", "111"),
    "9": ("111", "101", "111", "001", "111"),
    ".": ("000", "000", "000", "000", "010"),
    "-": ("000", "000", "111", "000", "000"),
    "+": ("000", "010", "111", "010", "000"),
    "e": ("111", "100", "111", "100", "111"),
    "R": ("110", "101", "110", "101", "101"),
    "V": ("101", "101", "101", "101", "010"),
    "?": ("111", "001", "011", "000", "010"),
    " ": ("000", "000", "000", "000", "000"),
}
GLYPHS = {c: np.array([[ch == "1" for ch in row] for row in rows], dtype=bool) for c, rows in _GLYPH_ROWS.items()}
GLYPH_H, GLYPH_W = 5, 3

_RETURN_COLOUR = np.array([255, 255, 255], dtype=np.uint8)
_VALUE_COLOUR = np.array([255, 210, 60], dtype=np.uint8)
_STRIP_COLOUR = np.array([24, 24, 24], dtype=np.uint8)
# Short side of a video by default: Crafter's 64 px frames are too small to watch.
MIN_SIDE = 256


def format_number(x: float) -> str:
    """A short rendering of ``x`` using only characters the bitmap font has."""
    if x is None or not math.isfinite(x):
        return "?"
    if abs(x) >= 1e5:
        return f"{x:.2e}".replace("e+0", "e").replace("e-0", "e-").replace("e+", "e")
    return f"{x:.2f}"


def draw_text(image: np.ndarray, text: str, *, x: int, y: int, scale: int, colour: np.ndarray) -> int:
    """Draw ``text`` in place with its top-left corner at (x, y); returns the x after the text.

    Characters outside the font render as ``?``; text running past the right edge is clipped.
    """
    h, w = image.shape[:2]
    for char in text:
        glyph = GLYPHS.get(char, GLYPHS["?"])
        big = np.repeat(np.repeat(glyph, scale, axis=0), scale, axis=1)
        gh, gw = big.shape
        if x >= w:
            break
        vis = big[: max(0, min(gh, h - y)), : max(0, min(gw, w - x))]
        image[y : y + vis.shape[0], x : x + vis.shape[1]][vis] = colour
        x += (GLYPH_W + 1) * scale
    return x


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
    # The strip is sized for one line of text at a scale that stays legible on large frames.
    scale = max(1, w // 100)
    strip = (GLYPH_H + 2) * scale if (returns is not None or values is not None) else 0
    out_h, out_w = h + strip, w
    out_h += out_h % 2  # yuv420p needs even dimensions
    out_w += out_w % 2
    video = np.zeros((len(frames), out_h, out_w, 3), dtype=np.uint8)
    for i, frame in enumerate(frames):
        frame = _as_hwc_uint8(frame)
        if frame.shape[0] * upscale != h or frame.shape[1] * upscale != w:
            raise ValueError(f"frame {i} has shape {frame.shape}, unlike frame 0 {first.shape}; an episode's frames must share one size")
        if upscale > 1:
            frame = np.repeat(np.repeat(frame, upscale, axis=0), upscale, axis=1)
        video[i, :h, :w] = frame
        if strip:
            video[i, h:] = _STRIP_COLOUR
            x = scale
            if returns is not None:
                x = draw_text(video[i], "R " + format_number(float(returns[i])), x=x, y=h + scale, scale=scale, colour=_RETURN_COLOUR)
                x += 2 * scale
            if values is not None:
                draw_text(video[i], "V " + format_number(float(values[i])), x=x, y=h + scale, scale=scale, colour=_VALUE_COLOUR)
    return video


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
