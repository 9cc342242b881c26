"""The image gate: every odd file gets a correct RGB image or a clear ImageError."""

import numpy as np
import pytest
from corpus import corpus, write_corpus
from PIL import Image

import vitviz
from vitviz.images import MAX_BYTES, ImageError, load_image


@pytest.mark.parametrize("name", sorted(corpus()))
def test_corpus_through_the_gate(name, tmp_path):
    data, suffix, expect = corpus()[name]
    path = tmp_path / f"x{suffix}"
    path.write_bytes(data)
    for source in (path, data):
        if expect == "ok":
            img = load_image(source)
            assert img.mode == "RGB" and min(img.size) >= 16
        else:
            with pytest.raises(ImageError, match=expect) as info:
                load_image(source)
            assert "accepted" in str(info.value)


def test_exif_rotation_is_applied():
    img = load_image(corpus()["exif-rotated"][0])
    assert img.size == (80, 160)
    arr = np.asarray(img).astype(int)
    assert arr[10, 40, 0] > 200 and arr[10, 40, 2] < 60  # top: red
    assert arr[150, 40, 2] > 200 and arr[150, 40, 0] < 60  # bottom: blue


def test_16_bit_is_rescaled_not_clipped():
    arr = np.asarray(load_image(corpus()["grey16"][0]))
    assert arr[0, 0, 0] == 0 and arr[0, -1, 0] == 255
    assert 120 <= arr[0, 32, 0] <= 135  # the middle of the ramp stays mid-grey
    assert (np.diff(arr[0, :, 0].astype(int)) >= 0).all() and len(np.unique(arr[0, :, 0])) > 50


def test_transparency_is_composited_on_white():
    pal = np.asarray(load_image(corpus()["palette-transparent"][0]))
    assert tuple(pal[10, 5]) == (255, 255, 255) and tuple(pal[10, 50]) == (0, 200, 0)
    rgba = np.asarray(load_image(corpus()["rgba"][0]))
    assert tuple(rgba[10, 50]) == (255, 255, 255) and tuple(rgba[10, 5]) == (0, 0, 255)
    la = np.asarray(load_image(corpus()["la"][0]))
    assert tuple(la[10, 50]) == (255, 255, 255) and tuple(la[10, 5]) == (0, 0, 0)


def test_gif_gives_its_first_frame_and_cmyk_converts():
    gif = np.asarray(load_image(corpus()["animated-gif"][0]))
    assert gif[0, 0, 0] > 200 and gif[0, 0, 1] < 50
    data, _, _ = corpus()["cmyk-jpeg"]
    assert Image.open(__import__("io").BytesIO(data)).mode == "CMYK"
    assert load_image(data).mode == "RGB"


def test_oversize_files_and_bad_arrays_are_refused(tmp_path):
    big = tmp_path / "big.jpg"
    big.write_bytes(b"\xff\xd8" + b"\0" * (MAX_BYTES + 10))
    with pytest.raises(ImageError, match="MB"):
        load_image(big)
    with pytest.raises(ImageError, match="uint8"):
        load_image(np.zeros((32, 32, 3), dtype=np.float32))
    with pytest.raises(ImageError, match="no such image file"):
        load_image(tmp_path / "missing.png")


def test_analyze_goes_through_the_gate(tmp_path):
    model = vitviz.get_spec("shapes_p16").build().eval()
    files = write_corpus(tmp_path)
    with pytest.raises(ImageError, match="empty"):
        vitviz.analyze(model, files["empty"][0])
    result = vitviz.analyze(model, files["exif-rotated"][0])
    assert result.image.size == (96, 96)


def test_a_gif_of_a_million_frames_decodes_its_first_frame_at_once():
    """Frames are never counted (Pillow's n_frames walks the whole file: seconds for this one): no
    frame past the first is sought."""
    from corpus import many_frames_gif

    from PIL import GifImagePlugin

    data = many_frames_gif()
    assert len(data) <= MAX_BYTES
    sought = []
    seek = GifImagePlugin.GifImageFile._seek  # what seek() and n_frames both go through

    def counted(self, frame, *args, **kwargs):
        sought.append(frame)
        return seek(self, frame, *args, **kwargs)

    GifImagePlugin.GifImageFile._seek = counted
    try:
        img = load_image(data)
    finally:
        GifImagePlugin.GifImageFile._seek = seek
    assert img.size == (64, 64) and img.mode == "RGB"
    assert max(sought, default=0) == 0, f"frames up to {max(sought)} were read"


# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across exec
_PEAK = """
import sys
from vitviz.images import load_image
def status_mb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
before = status_mb("VmRSS:")
img = load_image(sys.argv[1])
print(img.size, img.mode, status_mb("VmHWM:") - before)
"""


@pytest.mark.slow
def test_a_40_megapixel_float_tiff_is_converted_without_a_float_copy(tmp_path):
    """Decoded, the image is 160 MB of float32; converting it with one float64 copy and its
    temporaries peaked at over 1 GB. Now: the decoded image, the 8-bit grey and RGB results, and
    chunks of a million pixels."""
    import subprocess
    import sys
    from pathlib import Path

    from corpus import float_tiff

    path = tmp_path / "float.tiff"
    path.write_bytes(float_tiff())
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", _PEAK, str(path)], capture_output=True, text=True, check=True, cwd=root)
    size, mode, peak = out.stdout.split(")")[0] + ")", *out.stdout.split(")")[1].split()
    print(f"\n40 MP float TIFF: peak resident growth {float(peak):.0f} MB")
    assert size == "(8000, 5000)" and mode == "RGB"
    assert float(peak) < 500
    # and the ramp survives: black at the top, white at the bottom
    arr = np.asarray(load_image(path).resize((8, 50)))
    assert arr[0, 0, 0] < 5 and arr[-1, 0, 0] > 250 and 100 < arr[25, 0, 0] < 155


def test_sources_that_are_no_bytes_are_refused_in_one_sentence_by_both_gates():
    import io

    from vitviz.clips import VideoError, load_video

    for source, gate, error, noun in ((io.StringIO("GIF89a"), load_image, ImageError, "an image"),
                                      (io.StringIO("GIF89a"), lambda s: load_video(s, frames=2), VideoError, "a video"),
                                      (3.5, load_image, ImageError, "an image")):
        with pytest.raises(error, match=f"cannot read {noun} from") as caught:
            gate(source)
        assert "\n" not in str(caught.value)
    with pytest.raises(ImageError, match=r"the file is over 20 MB; accepted"):
        load_image(io.BytesIO(b"\x89PNG" + bytes(MAX_BYTES)))
