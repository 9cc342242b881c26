"""Hostile images (a checkout's tests/corpus.py), each read in a fresh process: seconds and peak memory."""

from __future__ import annotations

import statistics
from pathlib import Path

import vitviz


_PEAK_OF_LOAD = """
import sys, time
import numpy as np
from PIL import Image
def status(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key + ":")) / 1024
path, how = sys.argv[1], sys.argv[2]
before = status("VmRSS")
t = time.perf_counter()
if how == "vitviz":
    import vitviz
    before = status("VmRSS")
    t = time.perf_counter()
    vitviz.load_image(path)
else:  # the plain conversion: the float pixels as a float64 array, scaled to 8 bits
    np.clip(np.asarray(Image.open(path), dtype=np.float64) * 255, 0, 255).astype(np.uint8)
print(status("VmHWM") - before, time.perf_counter() - t)
"""



def inputs_table(rounds: int = 5) -> list[tuple[str, str, float, float]]:
    """(input, how, median seconds, peak MB above the process's resident size before) for the
    hostile images of a checkout's tests/corpus.py: a 20 MB GIF of 1.38 million frames and a 40 MP
    float TIFF, each read in a fresh process (peak = VmHWM - VmRSS, Linux)."""
    import subprocess
    import sys
    import tempfile

    corpus_dir = Path(vitviz.__file__).resolve().parent.parent / "tests"  # the checkout's tests, beside vitviz/
    if not (corpus_dir / "corpus.py").is_file():
        raise SystemExit("--inputs needs a checkout of vitviz (it reads tests/corpus.py)")
    sys.path.insert(0, str(corpus_dir))
    import corpus

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, data, hows in (("GIF, 1.38 M frames", corpus.many_frames_gif(), ("vitviz",)),
                                 ("TIFF, 40 MP float", corpus.float_tiff(), ("vitviz", "float64"))):
            path = Path(tmp) / ("input.gif" if "GIF" in name else "input.tiff")
            path.write_bytes(data)
            for how in hows:
                runs = [subprocess.run([sys.executable, "-c", _PEAK_OF_LOAD, str(path), how], capture_output=True, text=True, check=True)
                        for _ in range(rounds)]
                peaks, seconds = zip(*(map(float, r.stdout.split()) for r in runs))
                rows.append((name, how, statistics.median(seconds), statistics.median(peaks)))
    return rows
