"""Episode videos: the mp4 decodes back to the right frames, size and overlay."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

from mineonline_core.services.video import compose_frames, encode_episode_video, format_number


def decode(mp4: bytes) -> tuple[list[np.ndarray], dict]:
    import imageio_ffmpeg

    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        with open(path, "wb") as f:
            f.write(mp4)
        reader = imageio_ffmpeg.read_frames(path)
        meta = next(reader)
        w, h = meta["size"]
        frames = [np.frombuffer(b, np.uint8).reshape(h, w, 3) for b in reader]
        return frames, meta
    finally:
        os.unlink(path)


def moving_square(n: int, size: int = 64) -> list[np.ndarray]:
    frames = []
    for t in range(n):
        f = np.full((size, size, 3), 40, np.uint8)
        f[20:36, 2 * t : 2 * t + 16] = (230, 30, 30)
        frames.append(f)
    return frames


def test_roundtrip_frame_count_size_and_content():
    frames = moving_square(24)
    mp4 = encode_episode_video(frames, fps=12, upscale=3)
    assert mp4[4:8] == b"ftyp"  # an mp4 container
    decoded, meta = decode(mp4)
    assert len(decoded) == 24
    assert meta["size"] == (192, 192)
    assert meta["fps"] == pytest.approx(12)
    # The red square is where it was drawn (H.264 is lossy: compare with a tolerance).
    frame = decoded[10].astype(int)
    assert frame[28 * 3, (20 + 8) * 3, 0] > 180 and frame[28 * 3, (20 + 8) * 3, 1] < 80
    assert abs(frame[5, 5] - 40).max() < 12
    assert np.abs(decoded[0].astype(int) - np.repeat(np.repeat(frames[0], 3, 0), 3, 1)).mean() < 3


def test_overlay_strip_and_even_dimensions():
    frames = [np.zeros((45, 61, 3), np.uint8) for _ in range(5)]  # odd sizes
    returns = [0.0, 1.0, 1.5, 1.5, 11.25]
    values = [0.1, 0.2, -0.3, 0.4, 0.5]
    video = compose_frames(frames, returns=returns, values=values, upscale=1)
    n, h, w, _ = video.shape
    assert (n, h % 2, w % 2) == (5, 0, 0)
    assert h >= 45 + 7  # a strip of at least one text line under the frame
    assert (video[:, :45, :61] == 0).all()  # the agent's view is untouched
    strip = video[4, 45:]
    ink = (strip > 200).all(-1)  # white return digits (anti-aliased)
    assert ink.sum() > 10
    assert not np.array_equal(video[0, 45:], video[4, 45:])  # numbers change with the return
    decoded, meta = decode(encode_episode_video(frames, fps=5, returns=returns, values=values, upscale=1))
    assert len(decoded) == 5 and meta["size"] == (w, h)


def test_default_size_is_readable_and_pixels_stay_sharp():
    crafter = [np.random.default_rng(t).integers(0, 256, (64, 72, 3), dtype=np.uint8) for t in range(2)]
    video = compose_frames(crafter)  # no upscale given: the default of worker_config.video_upscale (null)
    assert video.shape[1:3] == (256, 288)  # 4x: the short side reaches 256 px
    assert np.array_equal(video[0, 4:8, 8:12], np.broadcast_to(crafter[0][1, 2], (4, 4, 3)))  # nearest neighbour
    assert compose_frames([np.zeros((300, 400, 3), np.uint8)]).shape[1:3] == (300, 400)  # large frames unchanged
    assert compose_frames([np.zeros((45, 61, 3), np.uint8)]).shape[1:3] == (270, 366)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="at least one frame"):
        encode_episode_video([], fps=10)
    with pytest.raises(ValueError, match="one per frame"):
        encode_episode_video(moving_square(3), fps=10, returns=[1.0])
    with pytest.raises(ValueError, match="share one size"):
        encode_episode_video([np.zeros((8, 8, 3), np.uint8), np.zeros((8, 10, 3), np.uint8)], fps=10)
    with pytest.raises(ValueError, match="fps"):
        encode_episode_video(moving_square(2), fps=0)


def test_chw_grayscale_and_float_frames_are_converted():
    chw = [np.full((3, 16, 16), 200, np.uint8)] * 2
    gray = [np.full((16, 16), 100, np.uint8)] * 2
    flt = [np.full((16, 16, 3), 0.5, np.float32)] * 2
    assert compose_frames(chw, upscale=1).shape == (2, 16, 16, 3)
    assert compose_frames(gray, upscale=1)[0, 0, 0].tolist() == [100, 100, 100]
    assert compose_frames(flt, upscale=1)[0, 0, 0, 0] == 127


def test_numbers_stay_short():
    for x, text in [(0.0, "0.00"), (-1.25, "-1.25"), (123456.0, "1.23e5"), (-9.9e9, "-9.90e9"), (float("nan"), "?")]:
        assert format_number(x) == text
