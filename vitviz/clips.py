"""The one gate every clip passes before a video model sees it: `load_video`, bounded as `vitviz.images`
bounds images.

`load_video` accepts a path, bytes or a binary file and returns a `Clip` of `frames` RGB frames
sampled from it, or raises `VideoError` (a ValueError) with one sentence saying what was wrong and
what is accepted:

- formats, told by the file's first bytes (never by its name): GIF and WebP (animated or still) are
  decoded with Pillow; MP4 (ffmpeg's mov/mp4 demuxer, so QuickTime MOV too) and WebM (its
  matroska/webm demuxer, so MKV too) with PyAV, ffmpeg's Python binding, imported only for those
  (`pip install av`; the `video` extra). Anything else (a zip renamed .mp4, text, a JPEG) is refused;
- bounds, all checked before the frames are decoded: files up to `MAX_BYTES`, clips up to
  `MAX_DURATION` seconds and `MAX_SOURCE_FRAMES` frames, frames of at most `MAX_FRAME_PIXELS` pixels
  with both sides at least `MIN_SIDE`, 1 to `MAX_FRAMES` frames asked, `MAX_KEPT_PIXELS` pixels in
  the frames returned, and the frames decoded to reach the sampled ones, times their pixels, at most
  `MAX_DECODED_PIXELS` for ffmpeg and `MAX_PILLOW_PIXELS` for Pillow (GIF frames decode several times
  slower); this bounds the time. Frames are counted without being decoded: GIF blocks and WebP chunks
  are walked in Python, MP4 and WebM packets are read (demuxed), each walk stopping one frame past the
  bound; a GIF cut into far more blocks than an encoder makes is refused by the walk. PyAV's decoder
  is opened with ffmpeg's `max_pixels` at `MAX_FRAME_PIXELS`, so a frame larger than its stream's
  header said is refused by ffmpeg rather than allocated;
- truncated or corrupt files are refused: a GIF that ends inside a block, a WebP chunk that runs past
  the file, an MP4 whose index (moov box) is missing, a packet cut short, a video stream with fewer
  packets than its container states or ending before 90% of the duration its container states;
- sampling (`sample_indices`): "uniform" takes frame i·(n−1)/(T−1), rounded half up, for i = 0..T−1
  (`np.linspace(0, n - 1, T)` rounded half up; T = 1 takes frame 0): the first and the last frame and
  T−2 evenly between, as VideoMAE, ViViT and TimeSformer are fed. "stride" takes frames 0, s, 2s, ...,
  (T−1)·s, consecutive frames `stride` apart from the start, as V-JEPA 2 is fed. A clip with fewer
  frames than that needs repeats frames rather than being refused: uniform sampling of n < T frames
  gives each frame about T/n times, in order; stride sampling past the end repeats the last frame.
  A one-frame GIF or a still WebP is a one-frame clip;
- decoding: an MP4 or WebM clip with more than one keyframe and distinct timestamps is decoded from
  the keyframe before a sampled frame whenever that keyframe lies past the frames decoded so far (a
  seek), skipping stretches that hold no sampled frame; other clips, GIF and WebP are decoded from
  the start up to the last sampled frame. The frames this decodes are counted before decoding, for
  the bound above. Either way only the sampled frames are kept, so memory is bounded by the frames
  asked. Should the seek plan fail (a frame's timestamp not among the packets'), the clip is decoded
  again from the start; should a stream decode to fewer frames than its packets (invisible frames),
  it is sampled again over the frames it decodes to: each such pass is bounded on its own;
- frames: MP4 and WebM frames are converted to RGB by ffmpeg's swscale and turned upright by the
  stream's display matrix in quarter turns (as ffmpeg's autorotate does; flips are not applied);
  transparent GIF and WebP pixels are composited onto white, as `load_image` does.
"""

from __future__ import annotations

import bisect
import io
import os
import struct
import warnings
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Iterator, Union

import numpy as np
import torch
from PIL import Image

from vitviz.config import Preprocessing
from vitviz.images import MIN_SIDE, ImageError, read_bounded
from vitviz.preprocess import preprocess

__all__ = [
    "Clip",
    "VideoError",
    "load_video",
    "clip_tensor",
    "sample_indices",
    "describe_limits",
    "SAMPLINGS",
    "MAX_BYTES",
    "MAX_DURATION",
    "MAX_SOURCE_FRAMES",
    "MAX_FRAME_PIXELS",
    "MAX_DECODED_PIXELS",
    "MAX_PILLOW_PIXELS",
    "MAX_FRAMES",
    "MAX_KEPT_PIXELS",
    "MIN_SIDE",
]

MAX_BYTES = 64 * 1024 * 1024
MAX_DURATION = 120.0  # seconds
MAX_SOURCE_FRAMES = 4_000
MAX_FRAME_PIXELS = 3840 * 2160  # 4K UHD: 8.3 megapixels
MAX_DECODED_PIXELS = 2_000_000_000  # by ffmpeg (MP4, WebM) to reach the sampled frames: about 1,000 full-HD frames
MAX_PILLOW_PIXELS = 500_000_000  # by Pillow (GIF, WebP), several times slower: about 240 full-HD frames
MAX_FRAMES = 64
MAX_KEPT_PIXELS = MAX_FRAMES * 1920 * 1080  # 133 megapixels returned: 400 MB of uint8
SAMPLINGS = ("uniform", "stride")

VideoSource = Union[str, os.PathLike, bytes, bytearray, BinaryIO]


class VideoError(ValueError):
    """A clip vitviz will not read; the message says why and what is accepted."""


@dataclass(frozen=True, eq=False)
class Clip:
    """Frames sampled from a clip.

    Attributes:
        frames: uint8 [T, H, W, 3] RGB, upright.
        fps: the source's frames per second (MP4/WebM: the stream's average rate; GIF/WebP: its frame
            count over the sum of its frame delays), None when unknown or when every delay is 0.
        indices: the source frame index of each returned frame (0-based, in display order).
        source_frames: the number of frames in the source.
        duration: the source's length in seconds (MP4/WebM: its container's statement, else the span
            of its frames' timestamps; GIF/WebP: the sum of its frame delays), None when unknown or 0.
    """

    frames: np.ndarray
    fps: float | None
    indices: tuple[int, ...]
    source_frames: int
    duration: float | None


def describe_limits() -> str:
    """What `load_video` accepts, as the second half of its errors."""
    return (
        f"accepted: MP4, WebM, GIF or animated WebP clips up to {MAX_BYTES // (1024 * 1024)} MB and {MAX_DURATION:g} s, "
        f"at most {MAX_SOURCE_FRAMES:,} frames of {MIN_SIDE}x{MIN_SIDE} to 3840x2160 px ({MAX_FRAME_PIXELS / 1e6:.1f} megapixels)"
    )


def _refuse(reason: str) -> VideoError:
    return VideoError(f"{reason}; {describe_limits()}")


def sample_indices(n: int, frames: int, sampling: str = "uniform", stride: int | None = None) -> list[int]:
    """The source frame indices `load_video` returns for a clip of `n` frames (module docstring):
    "uniform": floor(i·(n−1)/(frames−1) + 1/2) for i = 0..frames−1 (0 for one frame); "stride":
    min(i·stride, n−1)."""
    if n < 1:
        raise VideoError("a clip of no frames has nothing to sample")
    if sampling == "uniform":
        if frames == 1:
            return [0]
        return [(2 * i * (n - 1) + frames - 1) // (2 * (frames - 1)) for i in range(frames)]
    if sampling == "stride":
        return [min(i * stride, n - 1) for i in range(frames)]
    raise VideoError(f"sampling must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")


def _check_request(frames: int, sampling: str, stride: int | None) -> None:
    if isinstance(frames, bool) or not isinstance(frames, (int, np.integer)) or not 1 <= frames <= MAX_FRAMES:
        raise VideoError(f"frames must be an integer from 1 to {MAX_FRAMES}, got {frames!r}")
    if sampling not in SAMPLINGS:
        raise VideoError(f"sampling must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")
    if sampling == "stride":
        if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)) or not 1 <= stride <= MAX_SOURCE_FRAMES:
            raise VideoError(f'sampling "stride" needs a stride, an integer from 1 to {MAX_SOURCE_FRAMES:,}, got {stride!r}')
    elif stride is not None:
        raise VideoError(f'a stride is for sampling "stride", not {sampling!r}')


def _read(source: VideoSource) -> bytes:
    return read_bounded(source, max_bytes=MAX_BYTES, noun="video", refuse=_refuse, error=VideoError)


_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip")


def _sniff(data: bytes) -> str | None:
    """"GIF", "WebP", "MP4", "WebM" or None, from the first bytes."""
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "WebM"
    if data[4:8] in _MP4_BOXES:
        return "MP4"
    return None


def _check_frame_size(width: int, height: int) -> None:
    if width * height > MAX_FRAME_PIXELS:
        raise _refuse(f"the clip's frames are {width}x{height} = {width * height / 1e6:.1f} megapixels")
    if min(width, height) < MIN_SIDE:
        raise _refuse(f"the clip's frames are only {width}x{height} px")


def _check_source(n: int, duration: float | None) -> None:
    if n > MAX_SOURCE_FRAMES:
        raise _refuse(f"the clip has over {MAX_SOURCE_FRAMES:,} frames")
    if duration is not None and duration > MAX_DURATION:
        raise _refuse(f"the clip lasts {duration:.2f} s")


def _check_decoding(decoded: int, width: int, height: int, most: int) -> None:
    pixels = decoded * width * height
    if pixels > most:
        raise VideoError(f"reaching the sampled frames means decoding {decoded:,} frames of {width}x{height} px, "
                         f"{pixels / 1e9:.2f} gigapixels, over the {most / 1e9:.1f} decoded at most for one clip; "
                         "ask for frames nearer the start (stride sampling) or send a shorter or smaller clip")


def _check_kept(frames: int, width: int, height: int) -> None:
    if frames * width * height > MAX_KEPT_PIXELS:
        most = MAX_KEPT_PIXELS // (width * height)
        raise VideoError(f"{frames} frames of {width}x{height} px are {frames * width * height / 1e6:.0f} megapixels, over the "
                         f"{MAX_KEPT_PIXELS / 1e6:.0f} a clip returns; ask for at most {most} frames of this clip")


def _truncated(detail: str) -> VideoError:
    return _refuse(f"the clip is truncated or corrupt ({detail})")


# ------------------------------------------------------------------ GIF and WebP (Pillow)


def _scan_gif(data: bytes) -> tuple[int, int, int, int, list[int]]:
    """(screen width, screen height, the width and height the frames reach, each frame's delay in ms),
    from walking the GIF's blocks without decoding them. Stray bytes between blocks are skipped, as
    Pillow skips them. The walk stops one frame past `MAX_SOURCE_FRAMES`, and refuses data cut into
    far more blocks than an encoder makes (more than one per 64 bytes, plus 8 per frame and 4,096)."""
    n = len(data)
    if n < 13:
        raise _truncated("the GIF ends inside its header")
    width, height = struct.unpack_from("<HH", data, 6)
    flags = data[10]
    pos = 13 + ((3 << ((flags & 7) + 1)) if flags & 0x80 else 0)
    reach_w, reach_h = width, height
    delays: list[int] = []
    delay = 0
    steps, budget = 0, 4096 + n // 64
    while pos < n:
        if steps > budget:
            raise _truncated("the GIF's data is cut into far more blocks than an encoder makes")
        byte = data[pos]
        pos += 1
        steps += 1
        if byte == 0x3B:  # trailer
            break
        if byte == 0x21:  # extension: a label, then sub-blocks
            if pos >= n:
                raise _truncated("the GIF ends inside an extension block")
            label = data[pos]
            pos += 1
            if label == 0xF9 and pos + 3 < n and data[pos] >= 4:  # graphic control: the next frame's delay
                delay = 10 * (data[pos + 2] | data[pos + 3] << 8)
        elif byte == 0x2C:  # image: a descriptor, a local colour table, the LZW code size, sub-blocks
            if pos + 10 > n:
                raise _truncated("the GIF ends inside a frame")
            x, y, w, h = struct.unpack_from("<HHHH", data, pos)
            frame_flags = data[pos + 8]
            reach_w, reach_h = max(reach_w, x + w), max(reach_h, y + h)
            pos += 9 + ((3 << ((frame_flags & 7) + 1)) if frame_flags & 0x80 else 0) + 1
            delays.append(delay)
            delay = 0
            budget += 8
            if len(delays) > MAX_SOURCE_FRAMES:
                raise _refuse(f"the clip has over {MAX_SOURCE_FRAMES:,} frames")
        else:
            continue
        while True:  # the sub-blocks, up to their 0 terminator
            if pos >= n:
                raise _truncated("the GIF ends inside a block")
            size = data[pos]
            pos += 1 + size
            steps += 1
            if size == 0 or steps > budget:
                break
    return width, height, reach_w, reach_h, delays


def _scan_webp(data: bytes) -> tuple[int, int, list[int]]:
    """(canvas width, canvas height, each frame's duration in ms; [0] for a still image), from the
    WebP's RIFF chunks without decoding them; at most `MAX_SOURCE_FRAMES` + 64 chunks are walked."""
    end = min(len(data), 8 + struct.unpack_from("<I", data, 4)[0])
    pos, chunks = 12, 0
    size_of: tuple[int, int] | None = None
    animated = False
    durations: list[int] = []
    while pos + 8 <= end:
        fourcc = data[pos : pos + 4]
        size = struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if body + size > end:
            raise _truncated(f"the WebP's {fourcc.decode('latin-1')!r} chunk runs past the end of the file")
        if fourcc == b"VP8X" and size >= 10:
            animated = bool(data[body] & 0x02)
            w = 1 + (data[body + 4] | data[body + 5] << 8 | data[body + 6] << 16)
            h = 1 + (data[body + 7] | data[body + 8] << 8 | data[body + 9] << 16)
            size_of = (w, h)
        elif fourcc == b"ANMF" and size >= 16:
            durations.append(data[body + 12] | data[body + 13] << 8 | data[body + 14] << 16)
            if len(durations) > MAX_SOURCE_FRAMES:
                raise _refuse(f"the clip has over {MAX_SOURCE_FRAMES:,} frames")
        elif fourcc == b"VP8 " and size_of is None and size >= 10:
            w, h = struct.unpack_from("<HH", data, body + 6)
            size_of = (w & 0x3FFF, h & 0x3FFF)
        elif fourcc == b"VP8L" and size_of is None and size >= 5:
            bits = struct.unpack_from("<I", data, body + 1)[0]
            size_of = ((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
        pos = body + size + (size & 1)
        chunks += 1
        if chunks > MAX_SOURCE_FRAMES + 64:
            raise _refuse(f"the WebP has over {MAX_SOURCE_FRAMES + 64:,} chunks (frames and metadata)")
    if size_of is None:
        raise _truncated("the WebP holds no image")
    if animated and not durations:
        raise _truncated("the animated WebP holds no frames")
    return size_of[0], size_of[1], durations if animated else [0]


def _rgb(img: Image.Image) -> Image.Image:
    """The frame as RGB, transparent pixels composited onto white."""
    if img.mode == "RGB":
        return img
    rgba = img.convert("RGBA")
    background = Image.new("RGB", rgba.size, (255, 255, 255))
    background.paste(rgba, mask=rgba.getchannel("A"))
    return background


def _load_pillow(data: bytes, kind: str, frames: int, sampling: str, stride: int | None) -> Clip:
    if kind == "GIF":
        width, height, reach_w, reach_h, delays = _scan_gif(data)
        if not delays:
            raise _truncated("the GIF holds no frames")
        _check_frame_size(max(width, reach_w), max(height, reach_h))
        _check_frame_size(width, height)
    else:
        width, height, delays = _scan_webp(data)
        reach_w, reach_h = width, height
        _check_frame_size(width, height)
    n = len(delays)
    total = sum(delays) / 1000
    duration = total if total > 0 else None
    _check_source(n, duration)
    _check_kept(frames, width, height)
    indices = sample_indices(n, frames, sampling, stride)
    _check_decoding(max(indices) + 1, reach_w, reach_h, MAX_PILLOW_PIXELS)
    kept: dict[int, np.ndarray] = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            if kind == "WebP" and getattr(img, "n_frames", 1) != n:
                raise _truncated(f"libwebp finds {img.n_frames} frames where the chunks hold {n}")
            for k in sorted(set(indices)):  # Pillow decodes GIF and WebP frames in order up to k
                img.seek(k)
                img.load()
                frame = _rgb(img)
                if frame.size != (width, height):  # a GIF frame reaching past the screen grows Pillow's canvas
                    frame = frame.crop((0, 0, width, height))
                kept[k] = np.asarray(frame)
    except VideoError:
        raise
    except (OSError, EOFError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise _truncated(str(exc) or type(exc).__name__) from None
    fps = n / duration if duration else None
    return Clip(np.stack([kept[k] for k in indices]), fps, tuple(indices), n, duration)


# ------------------------------------------------------------------ MP4 and WebM (PyAV)


def _import_av() -> Any:
    try:
        import av
    except ImportError:
        raise VideoError("reading MP4 and WebM clips needs PyAV, which is not installed: pip install av "
                         "(GIF and WebP clips need nothing more)") from None
    return av


def _ffmpeg_detail(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


class _Stream:
    """One opened container and its first video stream, decoding with at most 4 threads and ffmpeg's
    `max_pixels` set to `MAX_FRAME_PIXELS`."""

    def __init__(self, av: Any, data: bytes, demuxer: str):
        limit = {"max_pixels": str(MAX_FRAME_PIXELS)}  # for the frames ffmpeg's probe decodes while opening, too
        self.container = av.open(io.BytesIO(data), mode="r", format=demuxer, options=limit)
        if not self.container.streams.video:
            self.container.close()
            raise _refuse("the clip has no video stream")
        self.stream = self.container.streams.video[0]
        if self.stream.codec_context is None:
            self.container.close()
            raise _refuse("ffmpeg has no decoder for the clip's video stream (an unknown codec, or a truncated or corrupt file)")
        self.stream.codec_context.options = limit
        self.stream.codec_context.thread_type = "AUTO"
        self.stream.codec_context.thread_count = min(4, os.cpu_count() or 1)

    def frames(self) -> Iterator[Any]:
        """Decoded frames from the demuxer's current position, in display order."""
        for packet in self.container.demux(self.stream):
            yield from packet.decode()

    def close(self) -> None:
        self.container.close()


def _upright(frame: Any, width: int, height: int, turns: int) -> np.ndarray:
    """The frame as uint8 RGB [H, W, 3] at the stream's size, turned upright."""
    rgb = frame.to_ndarray(format="rgb24", width=width, height=height)
    return np.ascontiguousarray(np.rot90(rgb, turns)) if turns else rgb


def _quarter_turns(frame: Any) -> int:
    """Counter-clockwise quarter turns that make the frame upright: the display matrix's rotation
    (`av_display_rotation_get`, counter-clockwise degrees), rounded to a quarter turn."""
    return round((getattr(frame, "rotation", 0) or 0) / 90) % 4


def _decode_sequential(open_stream: Callable[[], _Stream], wanted: set[int], width: int, height: int
                       ) -> tuple[dict[int, np.ndarray], int]:
    """(the wanted frames, by index in display order; the number of frames decoded), decoding from the
    start up to the last wanted frame."""
    last = max(wanted)
    kept: dict[int, np.ndarray] = {}
    turns = None
    decoded = 0
    src = open_stream()
    try:
        for frame in src.frames():
            if turns is None:
                turns = _quarter_turns(frame)
            if decoded in wanted:
                kept[decoded] = _upright(frame, width, height, turns)
            decoded += 1
            if decoded > last:
                break
    finally:
        src.close()
    return kept, decoded


def _seek_plan(wanted: list[int], keys: list[int]) -> tuple[list[int | None], int]:
    """For each wanted display index (ascending): the keyframe to seek to before decoding on to it
    (0: decode from the start), or None to decode on from the frame before; and the frames decoded in
    all. A seek is made when the keyframe before the wanted frame lies past the frames decoded so far."""
    seeks: list[int | None] = []
    position, decoded = -1, 0  # the display index of the last frame decoded
    for target in wanted:
        before = bisect.bisect_right(keys, target) - 1
        key = keys[before] if before >= 0 else 0
        if not seeks or key > position + 1:
            seeks.append(key)
            decoded += target - key + 1
        else:
            seeks.append(None)
            decoded += target - position
        position = target
    return seeks, decoded


def _decode_seeking(open_stream: Callable[[], _Stream], wanted: list[int], seeks: list[int | None], order: list[int],
                    width: int, height: int) -> dict[int, np.ndarray] | None:
    """The wanted frames (ascending display indices), decoded as `_seek_plan` says; `order` holds the
    frames' timestamps in display order. None when a decoded frame's timestamp is not one of those, or
    a wanted frame does not come (the caller then decodes from the start)."""
    index_of = {p: i for i, p in enumerate(order)}
    kept: dict[int, np.ndarray] = {}
    turns = None
    frames: Iterator[Any] = iter(())
    src = open_stream()
    try:
        for target, key in zip(wanted, seeks):
            if key is not None:
                if key > 0:
                    src.container.seek(order[key], stream=src.stream, backward=True)
                frames = src.frames()
            while True:
                frame = next(frames, None)
                if frame is None or frame.pts not in index_of:
                    return None
                position = index_of[frame.pts]
                if turns is None:
                    turns = _quarter_turns(frame)
                if position == target:
                    kept[target] = _upright(frame, width, height, turns)
                    break
                if position > target:
                    return None
    finally:
        src.close()
    return kept


def _load_av(data: bytes, kind: str, frames: int, sampling: str, stride: int | None) -> Clip:
    av = _import_av()
    demuxer = "mov" if kind == "MP4" else "matroska"
    try:
        src = _Stream(av, data, demuxer)
    except VideoError:
        raise
    except (av.error.FFmpegError, OSError, ValueError, EOFError) as exc:
        raise _truncated(f"ffmpeg's {demuxer} demuxer: {_ffmpeg_detail(exc)}") from None
    try:
        stream = src.stream
        width, height = stream.codec_context.width, stream.codec_context.height
        if not width or not height:
            raise _refuse(f"the clip's video stream states no frame size, or one over {MAX_FRAME_PIXELS / 1e6:.1f} megapixels")
        _check_frame_size(width, height)
        _check_kept(frames, width, height)
        base = stream.time_base
        stated: float | None = None
        if stream.duration and base:
            stated = float(stream.duration * base)
        elif src.container.duration:
            stated = src.container.duration / 1_000_000
        if stated is not None and stated > MAX_DURATION:
            raise _refuse(f"the clip lasts {stated:.2f} s")
        stated_frames = stream.frames  # 0: not stated (WebM)
        if stated_frames > MAX_SOURCE_FRAMES:
            raise _refuse(f"the clip has {stated_frames:,} frames")
        pts: list[int | None] = []
        keyframe_pts: list[int | None] = []
        end: int | None = None
        for packet in src.container.demux(stream):  # read, not decoded: counts the frames
            if not packet.size:
                continue
            if packet.is_corrupt:
                raise _truncated(f"packet {len(pts) + 1} is cut short")
            pts.append(packet.pts)
            if packet.is_keyframe:
                keyframe_pts.append(packet.pts)
            if packet.pts is not None:
                end = max(end if end is not None else packet.pts, packet.pts + (packet.duration or 0))
            if len(pts) > MAX_SOURCE_FRAMES:
                raise _refuse(f"the clip has over {MAX_SOURCE_FRAMES:,} frames")
        rate = stream.average_rate
    except VideoError:
        raise
    except (av.error.FFmpegError, OSError, ValueError, EOFError) as exc:
        raise _truncated(_ffmpeg_detail(exc)) from None
    finally:
        src.close()
    n = len(pts)
    if n == 0:
        raise _truncated("its video stream holds no frames")
    if stated_frames and n < stated_frames:
        raise _truncated(f"its video stream ends at frame {n:,} of the {stated_frames:,} its container states")
    timed = all(p is not None for p in pts) and len(set(pts)) == n
    span = float((end - min(pts)) * base) if timed and end is not None and base else None
    if stated and span is not None and span < 0.9 * stated:
        raise _truncated(f"its frames stop at {span:.1f} s of the {stated:.1f} s its container states")
    duration = stated if stated else span
    _check_source(n, duration)
    fps = float(rate) if rate else (n / duration if duration else None)
    order = sorted(pts) if timed else []
    keys = sorted({p: i for i, p in enumerate(order)}[p] for p in keyframe_pts) if timed else []

    def open_stream() -> _Stream:
        return _Stream(av, data, demuxer)

    try:
        indices = sample_indices(n, frames, sampling, stride)
        wanted = sorted(set(indices))
        kept = None
        if len(keys) > 1:
            seeks, decoded = _seek_plan(wanted, keys)
            _check_decoding(decoded, width, height, MAX_DECODED_PIXELS)
            try:
                kept = _decode_seeking(open_stream, wanted, seeks, order, width, height)
            except (av.error.FFmpegError, OSError, ValueError, EOFError):
                kept = None  # decoded again from the start, where a real fault is reported
        if kept is None:
            _check_decoding(wanted[-1] + 1, width, height, MAX_DECODED_PIXELS)
            kept, decoded = _decode_sequential(open_stream, set(wanted), width, height)
            if decoded <= wanted[-1]:  # fewer frames decode than the packets: sample those
                if decoded == 0:
                    raise _truncated("no frame of its video stream decodes")
                n = decoded
                indices = sample_indices(n, frames, sampling, stride)
                kept, _ = _decode_sequential(open_stream, set(indices), width, height)
    except VideoError:
        raise
    except (av.error.FFmpegError, OSError, ValueError, EOFError) as exc:
        raise _truncated(f"ffmpeg's decoder: {_ffmpeg_detail(exc)}") from None
    return Clip(np.stack([kept[k] for k in indices]), fps, tuple(indices), n, duration)


# ------------------------------------------------------------------ the gate


def load_video(source: VideoSource, *, frames: int, sampling: str = "uniform", stride: int | None = None) -> Clip:
    """Reads, checks and samples one clip (module docstring: formats, bounds, sampling rules).

    Args:
        source: a path, bytes or a binary file object holding an MP4, WebM, GIF or WebP file.
        frames: how many frames to return, 1 to `MAX_FRAMES`.
        sampling: "uniform" (spread over the whole clip, first and last included) or "stride"
            (`frames` frames `stride` apart from the first).
        stride: the step between sampled frames, for sampling "stride" only.

    Raises:
        VideoError: one sentence: the reason, and what is accepted.
    """
    _check_request(frames, sampling, stride)
    frames = int(frames)
    stride = None if stride is None else int(stride)
    data = _read(source)
    kind = _sniff(data)
    if kind is None:
        raise _refuse("this file is not a video vitviz reads")
    if kind in ("GIF", "WebP"):
        return _load_pillow(data, kind, frames, sampling, stride)
    return _load_av(data, kind, frames, sampling, stride)


def clip_tensor(clip: Clip, pre: Preprocessing) -> torch.Tensor:
    """The clip as a model takes it: float [T, 3, S, S] (for mode "fit", [T, 3, h, w]), each frame
    through `vitviz.preprocess.preprocess`. The frames share one size, so each gets the same resize
    and crop.

    Raises:
        VideoError: frames the crop cannot take (too elongated for it), in one sentence.
    """
    try:
        return torch.stack([preprocess(Image.fromarray(frame), pre)[0] for frame in clip.frames])
    except ImageError:
        height, width = clip.frames.shape[1:3]
        raise VideoError(f"the clip's frames are {width}x{height} px, too elongated to prepare for a model that sees "
                         f"{pre.image_size}x{pre.image_size} px") from None
