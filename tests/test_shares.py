"""Each caller its own share: MCP callers are sessions of their own in the queue's fair shares, and
each session's files (uploads, downloads, Gradio's copies of what it was sent) make room only among
themselves or the files of sessions over their share, never by removing the files of a session
within it."""

import asyncio
import base64
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from conftest import free_port, run, upload
from PIL import Image

import vitviz

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _until(done, what: str, *, limit: float = 120) -> None:
    """Waits (bounded) until `done()` holds; the bound is a failure, never a measurement."""
    deadline = time.monotonic() + limit
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {limit:.0f} s")
        time.sleep(0.02)


async def _until_async(done, what: str, *, limit: float = 120) -> None:
    deadline = time.monotonic() + limit
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {limit:.0f} s")
        await asyncio.sleep(0.02)


# ------------------------------------------------------------------------------------------------
# 1. MCP callers: a session each


# The app as `VITVIZ_MCP=1 python app.py` serves it, in a process of its own (Gradio's MCP server
# starts once per app and process), with every analysis of `shapes_p8` held until the test writes
# the file `release`: the first caller's jobs stay where they are while the second one calls.
_HELD_SERVER = r"""
import sys, threading, time
from pathlib import Path
from vitviz.server import app, runtime

signals, port = Path(sys.argv[1]), int(sys.argv[2])
original = runtime.views.explore

def held(cache, image, variant, **kwargs):
    with open(signals / "order", "a") as f:
        f.write(variant + "\n")
    if variant == "shapes_p8":
        (signals / "started").touch()
        deadline = time.monotonic() + 120
        while not (signals / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
    return original(cache, image, variant, **kwargs)

def report():  # the jobs waiting for the model's lane (events are handed to threads before their turn)
    while True:
        (signals / "waiting.part").write_text(str(sum(1 for j in app.SERVER.work._waiting if j.lane)))
        (signals / "waiting.part").replace(signals / "waiting")
        time.sleep(0.02)

threading.Thread(target=report, daemon=True).start()
runtime.views.explore = held
app.demo.launch(**dict(app.LAUNCH_KWARGS, mcp_server=True), server_name="127.0.0.1", server_port=port, quiet=True)
"""


def _data_url() -> str:
    buf = io.BytesIO()
    Image.fromarray(vitviz.shapes.render(3, seed=5, index=0)[0]).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _text(result) -> str:
    return " ".join(c.text for c in result.content if getattr(c, "text", None))


def test_each_mcp_caller_is_a_session_with_its_own_share(tmp_path):
    """Caller A (an agent at its address, no MCP session) has an analysis running, held, and two
    waiting: its fourth is refused as any session's would be ("One at a time"). Caller B (its own
    MCP session id) calls once: admitted, and run before A's waiting ones (sessions take turns)."""
    pytest.importorskip("mcp")
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    signals = tmp_path / "signals"
    signals.mkdir()
    port = free_port()
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", TMPDIR=str(tmp_path), GRADIO_TEMP_DIR=str(tmp_path / "gradio"), VITVIZ_CLIENT_JOBS="2", VITVIZ_ADDRESS_JOBS="8",
               VITVIZ_CONCURRENCY="1")
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-c", _HELD_SERVER, str(signals), str(port)], cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    url = f"{base}/gradio_api/mcp/http/"

    def answering() -> bool:
        assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        try:
            return httpx.get(base + "/", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def waiting() -> int:
        try:
            return int((signals / "waiting").read_text())
        except (OSError, ValueError):
            return 0

    async def talk():
        async with (
            streamablehttp_client(url) as (read_a, write_a, _),
            ClientSession(read_a, write_a) as a,
            streamablehttp_client(url, headers={"mcp-session-id": "agent-b"}) as (read_b, write_b, _),
            ClientSession(read_b, write_b) as b,
        ):
            await a.initialize()
            await b.initialize()
            tool = next(t.name for t in (await a.list_tools()).tools if t.name.endswith("api_analyze"))
            image = _data_url()

            def analyse(session, variant):
                return asyncio.create_task(session.call_tool(tool, {"image": image, "variant": variant}))

            held = [analyse(a, "shapes_p8")]
            await _until_async(lambda: (signals / "started").exists(), "A's first analysis started")
            held += [analyse(a, "shapes_p8"), analyse(a, "shapes_p8")]
            await _until_async(lambda: waiting() == 2, "A's two more analyses waiting")
            over = await a.call_tool(tool, {"image": image, "variant": "shapes_p8"})
            assert over.isError and "One at a time" in _text(over), over
            other = analyse(b, "shapes_p16")
            await _until_async(lambda: other.done() or waiting() == 3, "B's call admitted or refused")
            assert not other.done(), other.result()  # (refused, it would be done: "Queue is full")
            (signals / "release").touch()
            done = await asyncio.wait_for(asyncio.gather(*held, other), 300)
            for result in done:
                assert not result.isError and "star" in _text(result), result

    try:
        _until(answering, "the app answering")
        asyncio.run(talk())
        order = (signals / "order").read_text().split()
        assert order == ["shapes_p8", "shapes_p16", "shapes_p8", "shapes_p8"], order  # B's turn came before A's second
    finally:
        (signals / "release").touch()
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


# ------------------------------------------------------------------------------------------------
# 2. Each session its share of the disk


def test_room_is_made_from_nobodys_files_the_writers_own_and_those_of_callers_over_their_share(tmp_path):
    """`sweep(owners=...)`: 10 bytes a file, 60 at most, three callers (a share of 20 each). The
    writer about to write 20: nobody's file goes first, then, oldest first, the hog's (40, over its
    share) and the writer's own until 20 fits; A's (10, within its share) stays. The writer about to
    write 40: the hog's go down to its share, A's stays, and the rest leaves no room (refused)."""
    from vitviz.server.guards.export import sweep

    names = ["nobody", "hog-1", "a-1", "writer-1", "hog-2", "hog-3", "hog-4"]  # oldest first
    for age, name in enumerate(reversed(names)):
        path = tmp_path / name
        path.write_bytes(b"x" * 10)
        os.utime(path, (time.time() - 10 * age, time.time() - 10 * age))
    owners = {"a-1": {"a"}, "writer-1": {"writer"}, **{f"hog-{i}": {"hog"} for i in range(1, 5)}}
    left = sweep(tmp_path, max_age=3600, max_bytes=60, room=20, owners=lambda p: owners.get(p.name, ()), writer="writer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-1", "hog-2", "hog-3", "hog-4"] and left == 40
    left = sweep(tmp_path, max_age=3600, max_bytes=60, room=40, owners=lambda p: owners.get(p.name, ()), writer="writer")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-1", "hog-3", "hog-4"] and left + 40 > 60


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Another generated shapes image than `good`'s (the app's and server's fixtures: conftest)."""
    path = tmp_path_factory.mktemp("other") / "other.png"
    Image.fromarray(vitviz.shapes.render(3, seed=6, index=1)[0]).save(path)
    return path


def served(base: str, path: str) -> bytes | None:
    r = httpx.get(f"{base}/gradio_api/file={path}", timeout=60)
    return r.content if r.status_code == 200 else None


def _analysed(base: str, good, variant: str, session: str) -> dict:
    image = upload(base, good)
    ok, out = run(base, "session_analyze", [image, variant, "mean", 0.0, None], session=session)
    assert ok, out
    return image


def test_one_sessions_downloads_never_remove_anothers_upload_or_download(server, app, good, other, monkeypatch):
    """Session A uploads, analyses and exports; session B exports again and again, past the cap of
    the downloads folder (3 of its exports) and of the upload folder (which holds Gradio's copies of
    what events sent). B makes room from its own files; A's upload, and A's export, are still there
    and served, and each folder is within its cap once swept."""
    from vitviz.server.app import SERVER
    from dataclasses import replace

    from vitviz.cost import price
    from vitviz.server import runtime
    from vitviz.server.guards.export import Downloads

    big = price(vitviz.get_spec("shapes_p8@192"), "export").kept_bytes
    downloads = Downloads(root=tempfile.mkdtemp(), max_bytes=3 * big)  # (where Gradio takes files from: the temporary folder)
    monkeypatch.setattr(SERVER, "downloads", downloads)
    monkeypatch.setattr(SERVER, "settings", replace(SERVER.settings, files_bytes=128 * 2**20))
    monkeypatch.setattr(app.demo, "after_every", 0.0)  # the app sweeps after every event, not every 5 s

    a, b = "share-a", "share-b"
    mine = _analysed(server, good, "shapes_p16", a)
    ok, out = run(server, "on_export", [None], session=a)
    assert ok, out
    export = out[0]["path"]
    original = next(downloads.folder.glob("*.npz"))
    first = served(server, export)
    assert first and served(server, mine["path"])

    _analysed(server, other, "shapes_p8@192", b)
    written = 0
    while written <= 2 * SERVER.settings.files_bytes:
        ok, out = run(server, "on_export", [None], session=b)
        assert ok, out  # room made from B's own files: never refused
        written += big
    SERVER.files_sweep()  # (as after every event: the last one may still be running beside this test)
    assert served(server, out[0]["path"])  # B's newest
    assert original.exists() and served(server, export) == first and served(server, mine["path"])
    assert sum(p.stat().st_size for p in downloads.folder.glob("*.npz")) <= 3 * big
    folder = runtime.upload_folder()
    held = [p for p in folder.rglob("*") if p.is_file() and SERVER.explorer_dir not in p.parents and not runtime.is_example(p)]
    assert sum(p.stat().st_size for p in held) <= SERVER.settings.files_bytes


def test_a_download_with_no_room_left_by_others_within_their_share_is_refused_clearly(server, app, good, monkeypatch):
    """A and C hold small downloads, within their shares; B's is larger than the room they leave: B
    is refused, saying why and what to do, and A's and C's stay."""
    from vitviz.server.app import SERVER
    from vitviz.cost import price
    from vitviz.server import runtime
    from vitviz.server.guards.export import Downloads

    big = price(vitviz.get_spec("shapes_p8@192"), "export").kept_bytes
    downloads = Downloads(root=tempfile.mkdtemp(), max_bytes=big + big // 50)
    monkeypatch.setattr(SERVER, "downloads", downloads)
    kept = []
    for session, variant in (("room-a", "shapes_p16"), ("room-c", "shapes_p8")):
        _analysed(server, good, variant, session)
        ok, out = run(server, "on_export", [None], session=session)
        assert ok, out
        kept.append(out[0]["path"])
    originals = sorted(downloads.folder.glob("*.npz"))
    assert len(originals) == 2
    _analysed(server, good, "shapes_p8@192", "room-b")
    ok, message = run(server, "on_export", [None], session="room-b")
    assert not ok and "no room" in message and "VITVIZ_DOWNLOADS_MB" in message and "Try again" in message, message
    assert sorted(downloads.folder.glob("*.npz")) == originals and all(served(server, p) for p in kept)
