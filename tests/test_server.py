"""The running app in public: hostile files, concurrent clients, and a soak."""

import os
import threading

import numpy as np
import pytest
from corpus import write_corpus
from PIL import Image

import vitviz

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    from vitviz.server import app

    app.demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, **app.LAUNCH_KWARGS)
    try:
        yield app.demo.local_url
    finally:
        app.demo.close()


def _client(url):
    from gradio_client import Client

    return Client(url, verbose=False, httpx_kwargs={"timeout": 300})  # (httpx's 5 s: an upload on a loaded machine may take longer)


def _analyze(client, path, variant="shapes_p16"):
    from gradio_client import handle_file

    preds, rollout, distance, npz = client.predict(handle_file(str(path)), variant, api_name="/analyze")
    return preds, np.load(npz)


def _alive(client, good):
    preds, _ = _analyze(client, good)
    assert preds["label"] in vitviz.shapes.CLASSES


def test_hostile_files_get_clear_errors_and_the_server_keeps_serving(server, tmp_path):
    from gradio_client.exceptions import AppError

    client = _client(server)
    files = write_corpus(tmp_path / "corpus")
    good = tmp_path / "good.png"
    Image.fromarray(vitviz.shapes.render(3, seed=5, index=0)[0]).save(good)
    results = {}
    for name, (path, expect) in files.items():
        if expect == "ok":
            preds, data = _analyze(client, path)
            assert len(preds["confidences"]) == 5, name
            results[name] = data
        elif expect in ("not an image", "empty"):  # no image's first bytes: refused at the upload door, nothing kept
            with pytest.raises(Exception, match="415"):
                _analyze(client, path)
        else:
            with pytest.raises(AppError, match=expect):
                _analyze(client, path)
    # over the upload limit: refused at the door
    big = tmp_path / "big.png"
    big.write_bytes(os.urandom(21 * 1024 * 1024))
    with pytest.raises(Exception, match="(?i)size|large|413"):
        _analyze(client, big)
    _alive(client, good)

    # the EXIF-rotated photo arrives upright: red above blue
    crop = results["exif-rotated"]["image"].astype(int)
    assert crop[5, 48, 0] > 200 and crop[5, 48, 2] < 60
    assert crop[90, 48, 2] > 200 and crop[90, 48, 0] < 60
    # the 16-bit ramp is rescaled: dark left, bright right, mid-grey in the middle, not clipped
    grey = results["grey16"]["image"][:, :, 0].astype(int)
    assert grey[48, 0] < 15 and grey[48, -1] > 240 and 100 < grey[48, 48] < 155


def test_sixteen_concurrent_clients_each_get_their_own_answer(server, tmp_path, monkeypatch):
    from vitviz.server import app

    # sixteen clients would come from sixteen addresses; here they share 127.0.0.1
    monkeypatch.setattr(app.demo, "address_jobs", 16)
    paths = []
    for i in range(16):
        path = tmp_path / f"img{i}.png"
        Image.fromarray(vitviz.shapes.render(i % 8, seed=77, index=i)[0]).save(path)
        paths.append(path)
    solo_client = _client(server)
    alone = [_analyze(solo_client, p) for p in paths]

    results: list = [None] * 16
    errors: list = []
    barrier = threading.Barrier(16)

    def worker(i):
        try:
            client = _client(server)
            barrier.wait(timeout=60)
            results[i] = _analyze(client, paths[i])
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not [e for e in errors if "queue" not in str(e).lower()], errors
    assert len(errors) == 0  # the queue (32) is larger than 16 clients
    for (want_preds, want), (got_preds, got) in zip(alone, results):
        assert got_preds == want_preds
        np.testing.assert_allclose(got["cls_map"], want["cls_map"], atol=1e-6)
        np.testing.assert_array_equal(got["image"], want["image"])


def _rss_mb() -> float:
    from vitviz.server.guards.memory import resident_bytes

    return resident_bytes() / 1e6


def test_soak_memory_stays_flat_and_no_figure_stays_open(server, tmp_path, monkeypatch):
    from vitviz.server.app import SERVER
    import dataclasses

    from matplotlib._pylab_helpers import Gcf

    # freed heap handed back past 16 MB of growth (VITVIZ_HEAP_KEEP_MB), within the bound checked below
    monkeypatch.setattr(SERVER, "settings", dataclasses.replace(SERVER.settings, heap_keep_bytes=16 * 2**20))
    client = _client(server)
    paths = []
    for i in range(10):
        path = tmp_path / f"s{i}.png"
        Image.fromarray(vitviz.shapes.render(i % 8, seed=99, index=i)[0]).save(path)
        paths.append(path)
    for i in range(30):
        _analyze(client, paths[i % 10])
    before = _rss_mb()
    for i in range(150):
        _analyze(client, paths[i % 10])
    growth = _rss_mb() - before
    print(f"\nresident memory growth over 150 analyses: {growth:.1f} MB")
    assert growth < 50
    assert Gcf.get_num_fig_managers() == 0
