"""The clip gate: MP4, WebM, GIF and animated WebP clips give the sampled frames, or one clear VideoError."""

import io
import re
import struct
import subprocess
import sys
import zipfile
from fractions import Fraction

import numpy as np
import pytest
from PIL import Image

import vitviz
from vitviz import clips
from vitviz.clips import MAX_BYTES, MAX_SOURCE_FRAMES, Clip, VideoError, clip_tensor, load_video, sample_indices
from vitviz.config import Preprocessing
from vitviz.preprocess import preprocess

av = pytest.importorskip("av")

W, H = 64, 48
CODEC_TOLERANCE = 12  # MP4 and WebM are lossy: a flat frame comes back within a few levels


def colour(i: int) -> tuple[int, int, int]:
    """Frame i's flat colour, distinct from its neighbours' by far more than the codec tolerance."""
    return ((i * 37) % 256, (i * 91 + 50) % 256, (i * 53 + 120) % 256)


def flat(i: int, size: tuple[int, int] = (W, H)) -> np.ndarray:
    a = np.empty((size[1], size[0], 3), np.uint8)
    a[:] = colour(i)
    return a


def encode(fmt: str, codec: str, n: int, *, fps: int = 10, gop: int = 6, rotation: int | None = None) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        stream.codec_context.gop_size = gop
        if codec == "libvpx-vp9":
            stream.options = {"deadline": "realtime", "cpu-used": "8"}
        if rotation is not None:
            stream.set_display_rotation(rotation)
        for i in range(n):
            for packet in stream.encode(av.VideoFrame.from_ndarray(flat(i), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def animate(fmt: str, n: int, *, duration: int, size: tuple[int, int] = (W, H)) -> bytes:
    frames = [Image.fromarray(flat(i, size)) for i in range(n)]
    buf = io.BytesIO()
    extra = {"lossless": True} if fmt == "WEBP" else {"loop": 0}
    frames[0].save(buf, fmt, save_all=True, append_images=frames[1:], duration=duration, **extra)
    return buf.getvalue()


@pytest.fixture(scope="module")
def videos() -> dict[str, bytes]:
    return {
        "mp4": encode("mp4", "libx264", 60),
        "webm": encode("webm", "libvpx-vp9", 60, gop=10),
        "gif": animate("GIF", 20, duration=100),
        "webp": animate("WEBP", 20, duration=50),
    }


def one_sentence(message: str) -> bool:
    return "\n" not in message and "Traceback" not in message and not re.search(r"[.!?]\s+[A-Z]", message)


def refused(source, match: str, **kwargs) -> str:
    kwargs.setdefault("frames", 4)
    with pytest.raises(VideoError, match=match) as info:
        load_video(source, **kwargs)
    message = str(info.value)
    assert one_sentence(message), message
    return message


def check_colours(clip: Clip, tolerance: int) -> None:
    for frame, index in zip(clip.frames, clip.indices):
        mean = frame.reshape(-1, 3).mean(0)
        assert np.abs(mean - colour(index)).max() <= tolerance, (index, mean, colour(index))


# ------------------------------------------------------------------ sampling


def test_uniform_sampling_is_linspace_rounded_half_up_and_stride_repeats_the_last_frame():
    for n in range(1, 40):
        for t in range(1, 20):
            expected = [0] if t == 1 else [int(Fraction(i * (n - 1), t - 1) + Fraction(1, 2)) for i in range(t)]
            assert sample_indices(n, t) == expected
    assert sample_indices(10, 4) == [round(x) for x in np.linspace(0, 9, 4)] == [0, 3, 6, 9]
    assert sample_indices(6, 3) == [0, 3, 5]  # 2.5 rounds up (np.rint would give 2)
    assert sample_indices(3, 8) == [0, 0, 1, 1, 1, 1, 2, 2]  # a short clip: each frame about T/n times
    assert sample_indices(20, 5, "stride", 4) == [0, 4, 8, 12, 16]
    assert sample_indices(10, 5, "stride", 4) == [0, 4, 8, 9, 9]


@pytest.mark.parametrize("kind", ["mp4", "webm", "gif", "webp"])
def test_each_format_gives_the_sampled_frames(videos, kind):
    n = 60 if kind in ("mp4", "webm") else 20
    tolerance = CODEC_TOLERANCE if kind in ("mp4", "webm") else 0
    clip = load_video(videos[kind], frames=8)
    assert clip.frames.dtype == np.uint8 and clip.frames.shape == (8, H, W, 3)
    assert clip.indices == tuple(sample_indices(n, 8)) and clip.indices[0] == 0 and clip.indices[-1] == n - 1
    assert clip.source_frames == n
    check_colours(clip, tolerance)
    fps, duration = {"mp4": (10, 6.0), "webm": (10, 6.0), "gif": (10, 2.0), "webp": (20, 1.0)}[kind]
    assert clip.fps == pytest.approx(fps) and clip.duration == pytest.approx(duration, abs=0.05)

    strided = load_video(videos[kind], frames=5, sampling="stride", stride=3)
    assert strided.indices == (0, 3, 6, 9, 12)
    check_colours(strided, tolerance)

    long = load_video(videos[kind], frames=12 if n == 60 else 5, sampling="stride", stride=7)
    assert long.indices[-1] == n - 1 and long.indices.count(n - 1) > 1  # past the end: the last frame again
    check_colours(long, tolerance)


def test_paths_files_and_short_clips(videos, tmp_path):
    path = tmp_path / "clip.gif"
    path.write_bytes(animate("GIF", 3, duration=40))
    for source in (path, str(path), io.BytesIO(path.read_bytes())):
        clip = load_video(source, frames=8)
        assert clip.indices == (0, 0, 1, 1, 1, 1, 2, 2) and clip.source_frames == 3
        check_colours(clip, 0)
    still = io.BytesIO()
    Image.fromarray(flat(5)).save(still, "WEBP", lossless=True)
    one = load_video(still.getvalue(), frames=4)
    assert one.indices == (0, 0, 0, 0) and one.source_frames == 1 and one.fps is None and one.duration is None
    assert (one.frames == colour(5)).all()


def test_mp4_seeks_to_keyframes_and_matches_decoding_from_the_start(videos, monkeypatch):
    seen = []
    real = clips._decode_seeking
    monkeypatch.setattr(clips, "_decode_seeking", lambda *a: seen.append(real(*a)) or seen[-1])
    sought = load_video(videos["mp4"], frames=6)
    assert seen and seen[-1] is not None  # the keyframe plan was followed, not the fallback
    assert clips._seek_plan([0, 40], [0, 6, 12, 18, 24, 30, 36, 42]) == ([0, 36], 1 + 5)
    monkeypatch.setattr(clips, "_decode_seeking", lambda *a: None)
    sequential = load_video(videos["mp4"], frames=6)
    assert sought.indices == sequential.indices and np.array_equal(sought.frames, sequential.frames)


def test_a_rotated_phone_clip_comes_out_upright():
    """The display matrix says 90 degrees counter-clockwise: the 64x48 frames come out 48 wide, 64 high,
    their top rows (red) on the left."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        stream.set_display_rotation(90)
        top_red = np.zeros((H, W, 3), np.uint8)
        top_red[: H // 2] = (255, 0, 0)
        for _ in range(2):
            for packet in stream.encode(av.VideoFrame.from_ndarray(top_red, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    clip = load_video(buf.getvalue(), frames=2)
    assert clip.frames.shape == (2, W, H, 3)
    left, right = clip.frames[0, :, : H // 2 - 4].mean((0, 1)), clip.frames[0, :, H // 2 + 4 :].mean((0, 1))
    assert left[0] > 200 and right[0] < 40


def test_clip_tensor_gives_every_frame_the_same_crop(videos):
    clip = load_video(videos["gif"], frames=4)
    pre = Preprocessing(image_size=32)
    x = clip_tensor(clip, pre)
    assert x.shape == (4, 3, 32, 32) and x.dtype.is_floating_point
    for t in range(4):
        assert np.allclose(x[t].numpy(), preprocess(Image.fromarray(clip.frames[t]), pre)[0].numpy())


# ------------------------------------------------------------------ hostile files


def test_truncated_clips_are_refused(videos, tmp_path):
    mp4 = videos["mp4"]
    for cut in (len(mp4) // 2, len(mp4) * 3 // 4, 40):
        refused(mp4[:cut], "truncated or corrupt")
    faststart = tmp_path / "faststart.mp4"  # the index first: cutting the end leaves packets cut short
    with av.open(str(faststart), "w", options={"movflags": "faststart"}) as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        for i in range(30):
            for packet in stream.encode(av.VideoFrame.from_ndarray(flat(i), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    data = faststart.read_bytes()
    assert data[4:8] == b"ftyp" and data.index(b"moov") < data.index(b"mdat")
    refused(data[: len(data) * 2 // 3], "truncated or corrupt")
    webm = videos["webm"]
    refused(webm[: len(webm) // 2], "truncated or corrupt")  # frames stop well before the stated duration
    gif = videos["gif"]
    refused(gif[: len(gif) // 2], "truncated or corrupt")
    webp = videos["webp"]
    refused(webp[: len(webp) // 2], "truncated or corrupt")


def test_files_that_are_not_clips_are_refused(tmp_path):
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("clip.mp4", b"\0" * 1000)
    for name in ("renamed.mp4", "renamed.gif", "renamed.webm"):
        (tmp_path / name).write_bytes(archive.getvalue())
        refused(tmp_path / name, "not a video vitviz reads")
    rng = np.random.default_rng(0)
    refused(rng.bytes(5000), "not a video vitviz reads")
    png = io.BytesIO()
    Image.fromarray(flat(0)).save(png, "PNG")
    refused(png.getvalue(), "not a video vitviz reads")
    for header in (b"\0\0\0\x18ftypisom", b"\x1a\x45\xdf\xa3", b"GIF89a"):
        refused(header + rng.bytes(5000), "truncated or corrupt")
    refused(b"RIFF" + struct.pack("<I", 5000) + b"WEBP" + rng.bytes(5000), "truncated or corrupt")
    refused(b"", "empty")
    (tmp_path / "empty.mp4").write_bytes(b"")
    refused(tmp_path / "empty.mp4", "empty")
    refused(tmp_path / "missing.mp4", "no such video file")
    refused("not a file.mp4", "no such video file")


def test_oversize_files_are_refused_before_reading(tmp_path):
    big = tmp_path / "big.mp4"
    with open(big, "wb") as f:
        f.truncate(MAX_BYTES + 1)
    refused(big, "67.1 MB")
    refused(b"\0\0\0\x18ftyp" + bytes(MAX_BYTES), "over 64 MB")


def test_ten_thousand_tiny_frames_are_refused_and_four_thousand_read():
    """A GIF's frames are counted by walking its blocks, stopping one past the bound; 4,000 frames of
    16x16 are within every bound; a walk through millions of blocks is itself refused."""
    two = io.BytesIO()
    Image.new("RGB", (16, 16), (255, 0, 0)).save(two, "GIF", save_all=True, append_images=[Image.new("RGB", (16, 16), (0, 0, 255))], duration=20)
    data = two.getvalue()
    second = data.index(b"\x21\xf9\x04", data.index(b"\x21\xf9\x04") + 1)
    frame = data[second:-1]  # the second frame's blocks, without the trailer
    refused(data[:-1] + frame * (10_000 - 2) + b";", "over 4,000 frames")
    clip = load_video(data[:-1] + frame * (MAX_SOURCE_FRAMES - 2) + b";", frames=4)
    assert clip.indices == (0, 1333, 2666, 3999) and clip.source_frames == 4000
    assert clip.duration == pytest.approx(80.0) and clip.fps == pytest.approx(50.0)
    blocks = data[: data.index(b"\x2c")] + b"\x2c" + struct.pack("<HHHH", 0, 0, 16, 16) + b"\x00\x02" + b"\x01\x00" * 4_000_000
    refused(blocks + b"\x00;", "far more blocks")  # the walk itself is bounded


def test_huge_frames_are_refused_from_the_header(videos, monkeypatch):
    screen = b"GIF89a" + struct.pack("<HH", 60000, 60000) + b"\x80\x00\x00" + bytes(6)
    image = b"\x2c" + struct.pack("<HHHH", 0, 0, 60000, 60000) + b"\x00\x02\x02\x4c\x01\x00;"
    refused(screen + image, "60000x60000")
    small_screen = b"GIF89a" + struct.pack("<HH", 16, 16) + b"\x80\x00\x00" + bytes(6)
    refused(small_screen + image, "60000x60000")  # a frame reaching far past its screen
    vp8x = b"VP8X" + struct.pack("<I", 10) + bytes(4) + (16383).to_bytes(3, "little") * 2  # a still canvas of 16384x16384
    refused(b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x, "16384x16384")
    refused(screen[:6] + struct.pack("<HH", 8, 8) + screen[10:] + image.replace(struct.pack("<HH", 60000, 60000), struct.pack("<HH", 8, 8)), "only 8x8 px")
    monkeypatch.setattr(clips, "MAX_FRAME_PIXELS", W * H - 1)  # the same checks, on frames one pixel over the bound
    refused(videos["mp4"], f"{W}x{H}")
    refused(videos["webm"], "frame size")  # ffmpeg's max_pixels: the probe leaves no frame size


def test_frames_decoded_and_returned_are_bounded(videos, monkeypatch):
    refused(videos["mp4"], "from 1 to 64", frames=65)
    refused(videos["mp4"], "from 1 to 64", frames=0)
    refused(videos["mp4"], "needs a stride", frames=4, sampling="stride")
    refused(videos["mp4"], "sampling must be", frames=4, sampling="random")
    refused(videos["mp4"], 'for sampling "stride"', frames=4, stride=2)
    monkeypatch.setattr(clips, "MAX_KEPT_PIXELS", 4 * W * H)
    refused(videos["gif"], "at most 4 frames", frames=5)
    load_video(videos["gif"], frames=4)
    monkeypatch.setattr(clips, "MAX_DECODED_PIXELS", 20 * W * H)
    monkeypatch.setattr(clips, "MAX_PILLOW_PIXELS", 10 * W * H)
    refused(videos["gif"], "decoding 20 frames")
    assert load_video(videos["gif"], frames=4, sampling="stride", stride=3).indices == (0, 3, 6, 9)
    refused(videos["webm"], "decoding")  # 60 frames, a keyframe every 10: at least the last 10 to decode
    assert load_video(videos["mp4"], frames=2, sampling="stride", stride=9).indices == (0, 9)


def test_long_clips_are_refused_from_the_container(monkeypatch, videos):
    monkeypatch.setattr(clips, "MAX_DURATION", 5.0)
    refused(videos["mp4"], "lasts 6.00 s")
    refused(videos["webm"], "lasts 6.00 s")
    monkeypatch.setattr(clips, "MAX_SOURCE_FRAMES", 40)
    monkeypatch.setattr(clips, "MAX_DURATION", 120.0)
    refused(videos["mp4"], "60 frames")  # the container states its frame count
    refused(videos["webm"], "over 40 frames")  # counted from its packets, stopping at 41


def test_without_pyav_mp4_asks_for_it_and_gif_still_reads(videos, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)
    message = refused(videos["mp4"], "pip install av")
    assert "WebP" in message
    assert load_video(videos["gif"], frames=2).frames.shape == (2, H, W, 3)


def test_vitviz_exports_the_gate_lazily():
    code = ("import sys, vitviz; assert 'av' not in sys.modules and 'vitviz.clips' not in sys.modules; "
            "from vitviz import load_video, Clip, VideoError; assert issubclass(VideoError, ValueError); "
            "assert {'load_video', 'Clip', 'VideoError'} <= set(vitviz.__all__); assert 'av' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert vitviz.load_video is load_video and vitviz.VideoError is VideoError
