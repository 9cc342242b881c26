"""The running app attacked through raw HTTP: server files, data: URLs, web addresses, oversized and
multi-file uploads, and the memory that sessions may hold."""

import base64
import json
import os

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from conftest import random_torchvision_checkpoint
import vitviz

REFUSED = "must be uploaded to this app"


@pytest.fixture(scope="module")
def app():
    # what the page's handlers share (runtime), imported with the app and bound here for every test
    global runtime
    from vitviz.server import app as app_module, runtime

    return app_module


def call(base: str, api: str, data: list, *, timeout: float = 120) -> tuple[str, object]:
    """One raw call of `/gradio_api/call/<api>`: ("complete", outputs) or ("error", message)."""
    r = httpx.post(f"{base}/gradio_api/call/{api}", json={"data": data}, timeout=timeout)
    r.raise_for_status()
    event_id = r.json()["event_id"]
    event = None
    with httpx.stream("GET", f"{base}/gradio_api/call/{api}/{event_id}", timeout=timeout) as stream:
        for line in stream.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event in ("complete", "error"):
                payload = json.loads(line.split(":", 1)[1])
                return event, payload.get("error") if event == "error" and isinstance(payload, dict) else payload
    raise AssertionError("no result event")


def upload(base: str, path) -> dict:
    with open(path, "rb") as f:
        r = httpx.post(f"{base}/gradio_api/upload", files=[("files", (os.path.basename(path), f.read()))], timeout=60)
    r.raise_for_status()
    return {"path": r.json()[0], "meta": {"_type": "gradio.FileData"}}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "star.png"
    Image.fromarray(vitviz.shapes.render(3, seed=5, index=0)[0]).save(path)
    return path


def _alive(base, good):
    """A normal analysis through the same raw route still works."""
    event, out = call(base, "analyze", [upload(base, good), "shapes_p16"])
    assert event == "complete" and out[0]["label"] == "star", out


def test_server_paths_are_refused_alike_whether_or_not_they_exist(server, good, tmp_path, app):
    from gradio.utils import get_upload_folder

    outside_image = tmp_path / "secret.png"
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(outside_image)
    big = tmp_path / "big.bin"
    big.write_bytes(b"\0" * (30 * 2**20))
    folder = get_upload_folder()
    os.makedirs(folder, exist_ok=True)
    link = os.path.join(folder, f"vv-link-{os.getpid()}.png")
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(outside_image, link)  # inside the upload folder, pointing out of it
    uploaded = upload(server, good)["path"]
    try:
        paths = [
            str(outside_image), str(big), "/etc/passwd", "/etc", "/nonexistent/x.png", str(tmp_path / "missing.png"),
            link, os.path.join(folder, "..", "..", "etc", "passwd"), folder, uploaded + "\0.png",
            str(vitviz.sources.assets_dir() / "examples" / "star.png"), "file:///etc/passwd", "",
        ]
        messages = set()
        for path in paths:
            for api, extra in [("analyze", []), ("session_analyze", ["mean", 0.0])]:
                for payload in ({"path": path}, {"path": path, "meta": {"_type": "gradio.FileData"}}):
                    event, message = call(server, api, [payload, "shapes_p16", *extra])
                    assert event == "error", (path, api, payload)
                    messages.add(message)
        # one text for every refusal: nothing about whether the path exists, its kind or its size
        assert len(messages) == 1, messages
        (message,) = messages
        assert REFUSED in message and "MB" not in message and "no such" not in message
    finally:
        os.unlink(link)
    _alive(server, good)


def test_data_urls_and_web_addresses_are_refused_before_anything_is_decoded_or_fetched(server, good, monkeypatch):
    from gradio import image_utils, processing_utils

    def forbidden(*args, **kwargs):
        raise AssertionError("decoded or fetched a client's data")

    for module, name in [(image_utils, "decode_base64_to_file"), (image_utils, "decode_base64_to_image"),
                         (processing_utils, "decode_base64_to_file"), (processing_utils, "save_url_to_cache"),
                         (processing_utils, "save_base64_to_cache")]:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, forbidden)
    data_url = "data:image/png;base64," + base64.b64encode(good.read_bytes()).decode()
    payloads = [
        {"path": None, "url": data_url, "meta": {"_type": "gradio.FileData"}},
        {"path": None, "url": data_url},
        {"url": data_url},
        {"path": upload(server, good)["path"], "url": data_url, "meta": {"_type": "gradio.FileData"}},
        {"path": "https://example.com/cat.png", "meta": {"_type": "gradio.FileData"}},
        {"path": "http://127.0.0.1:1/x.png", "meta": {"_type": "gradio.FileData"}},
        {"path": "https://example.com/cat.png"},
        data_url,
        ["not", "a", "file"],
    ]
    for payload in payloads:
        event, message = call(server, "analyze", [payload, "shapes_p16"])
        assert event == "error" and REFUSED in message, (str(payload)[:80], message)
    monkeypatch.undo()
    _alive(server, good)


def test_uploads_carry_one_image_of_at_most_the_limit(server, good):
    png = good.read_bytes()
    url = f"{server}/gradio_api/upload"
    assert httpx.post(url, files=[("files", ("a.png", png))]).status_code == 200
    two = httpx.post(url, files=[("files", ("a.png", png)), ("files", ("b.png", png))])
    assert two.status_code == 413 and "one image" in two.text
    many = httpx.post(url, files=[("files", (f"{i}.png", png)) for i in range(50)])
    assert many.status_code == 413
    big = httpx.post(url, files=[("files", ("a.png", os.urandom(21 * 2**20)))], timeout=60)
    assert big.status_code == 413 and "20 MB" in big.text

    def chunks():
        yield b"--x\r\n"

    no_length = httpx.post(url, content=chunks(), headers={"content-type": "multipart/form-data; boundary=x"})
    assert no_length.status_code == 411
    _alive(server, good)


@pytest.mark.slow
def test_thirty_b16_sessions_stay_within_the_state_budget(app, server, tmp_path, monkeypatch, good):
    """30 sessions of ViT-B/16 (random weights through the real loading path): the analyses kept
    for them stay within the configured bound, and a session whose analysis was dropped gets the
    same pictures, computed again."""
    from vitviz.server.app import SERVER
    import torchvision
    from gradio_client import Client, handle_file

    from vitviz.server.guards.memory import release_memory

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("VITVIZ_OFFLINE", "1")
    random_torchvision_checkpoint(tmp_path / "torch")
    budget = 100 * 2**20  # four and a half B/16 analyses (22.4 MB each)
    from vitviz.server.guards.sessions import SessionStore

    # a store of its own: what earlier tests in this process left in the app's is not these sessions'
    monkeypatch.setattr(SERVER, "store", SessionStore(budget_bytes=budget, idle_seconds=SERVER.settings.state_idle))
    before = SERVER.store.nbytes
    photo = tmp_path / "photo.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (240, 320, 3), dtype=np.uint8)).save(photo)

    first, peak = None, 0
    for i in range(30):
        client = Client(server, verbose=False, download_files=i == 0)
        client.predict(handle_file(str(photo if i else good)), "vit_b_16", "mean", 0.0, api_name="/session_analyze")
        peak = max(peak, SERVER.store.nbytes)
        if i == 0:
            first = client
            want = np.asarray(Image.open(client.predict(3, "head 2", 17, "each map its own", api_name="/session_view")[0]))
        else:
            client.close()  # the sessions live on in the server; the clients' own memory is not the server's
        if i == 5:
            release_memory(keep=0)
            rss5 = _rss_mb()
    release_memory(keep=0)
    growth = _rss_mb() - rss5
    print(f"\nstate held: peak {peak / 2**20:.0f} MB for 30 sessions (budget {budget / 2**20:.0f} MB, "
          f"{SERVER.store.evictions} evictions); resident memory grew {growth:.0f} MB over the last 25")
    assert before <= budget and peak <= budget
    assert growth < 150  # kept whole, 25 more B/16 analyses would hold 560 MB
    # the first session's analysis was dropped long ago: its view is computed again, identically
    got = np.asarray(Image.open(first.predict(3, "head 2", 17, "each map its own", api_name="/session_view")[0]))
    np.testing.assert_array_equal(got, want)
    _alive(server, good)


def _rss_mb() -> float:
    from vitviz.server.guards.memory import resident_bytes

    return resident_bytes() / 1e6


def test_the_store_keeps_the_newest_and_drops_the_oldest_and_the_idle():
    from vitviz.server.guards.sessions import SessionStore

    now, dropped = [0.0], []
    store = SessionStore(budget_bytes=100, idle_seconds=60, clock=lambda: now[0], on_drop=dropped.append)
    a = store.put("a", 40)
    b = store.put("b", 40)
    assert store.get(a) == "a"  # a is now the most recently used
    c = store.put("c", 40)
    assert dropped == [b]
    assert store.get(b) is None and store.get(a) == "a" and store.get(c) == "c" and store.nbytes == 80
    assert store.put("c again", 40, key=c) == c and dropped == [b]  # stored again under its key: not dropped
    d = store.put("d", 500)  # alone over the budget: kept, everything else dropped
    assert len(store) == 1 and store.get(d) == "d" and dropped == [b, a, c]
    now[0] = 61
    e = store.put("e", 10)
    assert store.get(d) is None and store.get(e) == "e" and dropped == [b, a, c, d]
    store.drop(e)
    store.drop(e)  # (gone already: not told twice)
    assert len(store) == 0 and store.evictions == 4 and dropped == [b, a, c, d, e]
    assert len({store.put(i, 1) for i in range(100)}) == 100  # keys never repeat


def test_the_explorer_files_stay_within_their_disk_budget(tmp_path):
    import time as clock

    from vitviz.server.guards.export import sweep

    for i in range(6):
        (tmp_path / f"f{i}.bin").write_bytes(b"x" * 1000)
        os.utime(tmp_path / f"f{i}.bin", (clock.time() - 100 + i, clock.time() - 100 + i))
    (tmp_path / "old.bin").write_bytes(b"x")
    os.utime(tmp_path / "old.bin", (clock.time() - 5000, clock.time() - 5000))
    sweep(tmp_path, max_age=1800, max_bytes=3500)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f3.bin", "f4.bin", "f5.bin"]  # the newest, within 3,500 bytes
