"""Gradio's per-session memory within the server's state budget, against the running app through raw
HTTP: session hashes bounded on every route, refused requests leave no session behind, and the
sessions kept (with their unread results) priced and counted beside the analyses kept for them."""

import random
import string
import threading
import uuid

import httpx
import pytest

from conftest import fn_index, join, results, serving, upload
from vitviz.server.guards.memory import release_memory, resident_bytes

SMALL = dict(state_mb=96, sessions=24)  # a budget the tests cross: 24 sessions, the rest of 96 MB for analyses


@pytest.fixture(scope="module")
def small(monkeypatch_module):
    """The server's settings with a small state budget, read from the environment as the server reads its own."""
    from vitviz.server.app import SERVER
    from vitviz.server import runtime
    from vitviz.server.guards.settings import Settings

    monkeypatch_module.setenv("VITVIZ_STATE_MB", str(SMALL["state_mb"]))
    monkeypatch_module.setenv("VITVIZ_SESSIONS", str(SMALL["sessions"]))
    settings = Settings.from_env(gpu=False, menu_tokens=SERVER.settings.max_tokens, session_bytes=SERVER.settings.session_bytes)
    monkeypatch_module.delenv("VITVIZ_STATE_MB")
    monkeypatch_module.delenv("VITVIZ_SESSIONS")
    return settings


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def server(small, monkeypatch_module):
    """The app as `python app.py` launches it, with the small budget: Gradio keeps `small.sessions`
    sessions, the store the rest."""
    from vitviz.server.app import SERVER
    from vitviz.server import app, runtime

    monkeypatch_module.setattr(SERVER.store, "budget_bytes", small.state_bytes)
    with serving(app.demo, **{**app.LAUNCH_KWARGS, "state_session_capacity": small.sessions}) as base:
        yield base


@pytest.fixture(scope="module")
def demo(server):
    from vitviz.server import app

    return app.demo


def analyse(base: str, image: dict, session: str) -> dict:
    """The page's analysis (`session_analyze`, kept in the session) of the embedded shapes_p16."""
    r = join(base, "session_analyze", [image, "shapes_p16", "mean", 0.0, None], session)
    assert r.status_code == 200, r.text
    (done,) = results(base, session, 1)
    assert done["success"], done
    return done


def page_hash() -> str:
    """A session hash as Gradio's page makes one: `Math.random().toString(36).substring(2)`."""
    return "".join(random.choice(string.digits + string.ascii_lowercase) for _ in range(11))


def held_sessions(demo) -> set[str]:
    return set(demo.state_holder.session_data)


BAD_HASHES = ["x" * 65, "y" * 4000, "a/b", "a b", "../x", "<b>", "ä", "a.b", ""]


def test_session_hashes_are_checked_on_every_route_before_gradio_keeps_anything(server, demo, good):
    """A session hash longer than 64 characters or with characters outside [A-Za-z0-9_-] is refused
    (400, saying what a session hash is) on every route that takes one, before Gradio stores it; the
    forms Gradio's page (11 base-36 characters) and gradio_client (a UUID) make, and a UUID's hex, pass."""
    image = upload(server, good)
    component = next(c["id"] for c in httpx.get(f"{server}/config").json()["components"]
                     if c.get("props", {}).get("elem_id") == "vv-explorer-live")
    index = fn_index(server, "session_analyze")
    before = held_sessions(demo)
    messages_before = set(demo._queue.pending_messages_per_session)
    for bad in BAD_HASHES + ["z" * 900_000]:
        long = len(bad) > 4000
        attempts = {
            "join": lambda: httpx.post(f"{server}/gradio_api/queue/join", json={
                "data": [image, "shapes_p16", "mean", 0.0, None], "fn_index": index, "session_hash": bad}, timeout=30),
            "call": lambda: httpx.post(f"{server}/gradio_api/call/analyze", json={"data": [image, "shapes_p16"], "session_hash": bad}, timeout=30),
            "component server": lambda: httpx.post(f"{server}/gradio_api/component_server", json={
                "session_hash": bad, "component_id": component, "fn_name": "explorer_layer", "data": ["k" * 22, 1]}, timeout=30),
            "component server, multipart": lambda: httpx.post(f"{server}/gradio_api/component_server", data={
                "session_hash": bad, "component_id": str(component), "fn_name": "explorer_layer", "data": "null"},
                files={"blob": ("a.bin", b"\0" * 16)}, timeout=30),
            "cancel": lambda: httpx.post(f"{server}/gradio_api/cancel", json={"session_hash": bad, "fn_index": index, "event_id": "e"}, timeout=30),
        }
        if not long:  # (in an address or a header only a few kB fit)
            attempts |= {
                "queue data": lambda: httpx.get(f"{server}/gradio_api/queue/data", params={"session_hash": bad}, timeout=30),
                "deep link": lambda: httpx.get(f"{server}/gradio_api/deep_link", params={"session_hash": bad}, timeout=30),
            }
        if not long and bad and "/" not in bad:  # (a path segment: "/" and "" name another route)
            attempts |= {
                "stream": lambda: httpx.get(f"{server}/gradio_api/stream/{bad}/run/1/playlist.m3u8", timeout=30),
                "heartbeat": lambda: _status_of_stream(f"{server}/gradio_api/heartbeat/{bad}"),
            }
        if not long and bad and bad.isascii():  # (a header's value: ASCII; an empty one is no header)
            attempts["upload"] = lambda: httpx.post(f"{server}/gradio_api/upload", headers={"session_hash": bad},
                                                    files=[("files", ("star.png", good.read_bytes()))], timeout=30)
        for route, attempt in attempts.items():
            r = attempt()
            assert r.status_code == 400, (route, bad[:20], r.status_code, r.text[:200])
            assert "session hash" in r.text and r.headers["content-type"].startswith("text/plain"), (route, r.text[:200])
            assert len(r.text) < 400  # the reason, not the hash
    assert held_sessions(demo) == before and set(demo._queue.pending_messages_per_session) == messages_before
    for good_hash in (page_hash(), str(uuid.uuid4()), uuid.uuid4().hex, "a_B-9"):
        analyse(server, image, good_hash)
        assert good_hash in demo.state_holder


def _status_of_stream(url: str) -> httpx.Response:
    """The answer's start of a route that streams (the heartbeat streams for as long as it is read)."""
    with httpx.stream("GET", url, timeout=30) as r:
        if r.status_code == 200:
            return r  # (its body would never end)
        r.read()
        return r


def test_refused_requests_leave_no_session_behind(server, demo, good, monkeypatch):
    """A join refused at the door (an unknown event, the queue full, a client over its share, fewer
    inputs than its event takes) or failing as it runs (an image not uploaded, junk in a field) leaves
    no Gradio session state, and neither does a component-server call of something the page lacks; a
    session that had been served keeps its state through a failure."""
    from vitviz.server import runtime

    image = upload(server, good)
    index = fn_index(server, "session_analyze")

    def refused_join(data, *, fn=index, expect=(400,)):
        session = uuid.uuid4().hex
        body = {"data": data, "fn_index": fn, "session_hash": session, "event_data": None, "trigger_id": None}
        r = httpx.post(f"{server}/gradio_api/queue/join", json=body, timeout=30)
        if r.status_code == 200:  # admitted, and failed as it ran
            (done,) = results(server, session, 1)
            assert not done["success"], done
        assert r.status_code in expect, (data, r.status_code, r.text)
        assert session not in demo.state_holder, (data, r.status_code, r.text)
        if r.status_code != 200:  # (an admitted one has had Gradio's queue of its messages: bounded, `test_memory_...`)
            assert session not in demo._queue.pending_messages_per_session

    before = len(demo.state_holder.session_data)
    refused_join([image, "shapes_p16", "mean", 0.0, None], fn=10**6)  # no such event
    refused_join([image, "shapes_p16"])  # two inputs for five
    refused_join([1] * 9, expect=(200,))  # (more values than inputs: Gradio takes the first)
    refused_join([{"path": "/etc/hostname", "meta": {"_type": "gradio.FileData"}}, "shapes_p16", "mean", 0.0, None], expect=(200,))
    refused_join([{"url": "data:image/png;base64,AAAA"}, "shapes_p16", "mean", 0.0, None], expect=(200,))
    refused_join([image, "shapes_p16", "mean", "junk", None], expect=(200,))  # the handler refuses the ratio
    refused_join([image, "shapes_p16", 17, {"a": 1}, [1]], expect=(200, 400))
    with monkeypatch.context() as m:  # the queue full
        m.setattr(demo._queue, "max_size", 0)
        refused_join([image, "shapes_p16", "mean", 0.0, None], expect=(503,))
    # a client over its share: one address may have one job while the first is held
    original, started, release = runtime.views.explore, threading.Event(), threading.Event()

    def held(*args, **kwargs):
        started.set()
        release.wait(120)
        return original(*args, **kwargs)

    first = uuid.uuid4().hex
    with monkeypatch.context() as m:
        m.setattr(runtime.views, "explore", held)
        m.setattr(demo, "address_jobs", 1)
        assert join(server, "analyze", [image, "shapes_p16"], first).status_code == 200
        try:
            assert started.wait(120)
            refused_join([image, "shapes_p16", "mean", 0.0, None], expect=(503,))
        finally:
            release.set()
        (done,) = results(server, first, 1)
        assert done["success"]
    component = next(c["id"] for c in httpx.get(f"{server}/config").json()["components"]
                     if c.get("props", {}).get("elem_id") == "vv-explorer-live")
    for component, fn in ((10**6, "explorer_layer"), (component, "nothing_here"), (component, "__init__"), ("x", "explorer_layer")):
        session = uuid.uuid4().hex
        r = httpx.post(f"{server}/gradio_api/component_server", json={"session_hash": session, "component_id": component, "fn_name": fn,
                                                                      "data": None}, timeout=30)
        assert r.status_code in (400, 404) and session not in demo.state_holder, (component, fn, r.status_code, r.text)
    assert len(demo.state_holder.session_data) <= before + 1  # (the analysis admitted above)
    served = uuid.uuid4().hex
    analyse(server, image, served)
    assert join(server, "session_analyze", [image, "shapes_p16", "mean", "junk", None], served).status_code == 200
    (done,) = results(server, served, 1)
    assert not done["success"] and served in demo.state_holder  # its analysis stays
    assert demo.state_holder[served].state_data  # (its reference to the analysis)


def test_the_sessions_and_the_analyses_share_the_state_budget(small, monkeypatch):
    """VITVIZ_STATE_MB holds Gradio's sessions (VITVIZ_SESSIONS of them at their price) and the analyses
    kept for them (the rest); by default the sessions take a quarter. The app launches Gradio with that
    many sessions."""
    from vitviz.server.app import SERVER
    from vitviz.server import app, runtime
    from vitviz.server.guards.sessions import CROP_BYTES, SESSION_BYTES, SESSION_PRICE
    from vitviz.server.guards.settings import Settings, SettingsError

    mb = 2**20
    assert small.sessions == SMALL["sessions"]
    assert small.state_bytes == SMALL["state_mb"] * mb - small.sessions * small.session_bytes
    price = SESSION_PRICE  # a session's own state, and the crop it keeps, at most the menu's largest model's
    assert price == SESSION_BYTES + CROP_BYTES and CROP_BYTES >= max(3 * s.image_size**2 for s in runtime.MENU)
    monkeypatch.delenv("VITVIZ_SESSIONS", raising=False)
    monkeypatch.delenv("VITVIZ_STATE_MB", raising=False)
    default = Settings.from_env(gpu=False, menu_tokens=197, session_bytes=price)
    assert default.sessions == 3072 * mb // 4 // price and default.sessions >= 400
    assert default.state_bytes + default.sessions * price <= 3072 * mb
    monkeypatch.setenv("VITVIZ_SESSIONS", "1000")
    assert Settings.from_env(gpu=False, menu_tokens=197, session_bytes=price).state_bytes == 3072 * mb - 1000 * price
    monkeypatch.setenv("VITVIZ_SESSIONS", "5000")  # 5,000 sessions do not fit in 3 GiB
    with pytest.raises(SettingsError, match="VITVIZ_SESSIONS"):
        Settings.from_env(gpu=False, menu_tokens=197, session_bytes=price)
    monkeypatch.setenv("VITVIZ_SESSIONS", "0")
    with pytest.raises(SettingsError, match="VITVIZ_SESSIONS"):
        Settings.from_env(gpu=False, menu_tokens=197, session_bytes=price)
    monkeypatch.delenv("VITVIZ_SESSIONS")
    assert SERVER.settings.session_bytes == price and Settings.from_env(gpu=False, menu_tokens=197).session_bytes == price
    assert app.LAUNCH_KWARGS["state_session_capacity"] == SERVER.settings.sessions


def test_an_empty_session_costs_less_than_its_price(server, demo):
    """What Gradio copies for a session of this page (its components' configurations), traced, is
    within the part of a session's price that is not its crop."""
    import gc
    import tracemalloc

    from gradio.state_holder import SessionState

    from vitviz.server.guards.sessions import SESSION_BYTES

    gc.collect()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        states = [SessionState(demo) for _ in range(8)]
        each = (tracemalloc.get_traced_memory()[0] - start) / len(states)
    finally:
        tracemalloc.stop()
    # what an analysis adds (its outputs, unread results: 117-143 KiB traced, docs/serving.md) still fits, with room
    assert 50_000 < each < SESSION_BYTES - 256 * 1024, each


def test_a_session_keeps_a_crop_up_to_the_menus_largest_and_a_larger_one_comes_again_from_its_upload(server, good):
    """A crop over `CROP_BYTES` (a model named at a size beyond the menu's) is not kept by the session:
    once the store has dropped its analysis, the analysis is computed again from the upload, the same;
    with the upload gone too, the session is told to analyse again."""
    from vitviz.server.app import SERVER
    import os

    import torch

    from vitviz.server import runtime
    from vitviz.server.guards.gradio_io import uploaded_path

    path = uploaded_path(upload(server, good)["path"])
    assert SERVER.remember(SERVER.run(path, "shapes_p16"), path).crop is not None
    large = SERVER.run(path, "shapes_p16@528")  # 528 px: 836 kB of crop, past the 805 kB of ViT-H/14's 518 px
    ref = SERVER.remember(large, path)
    assert ref.crop is None
    SERVER.store.drop(ref.key)
    again = SERVER.recall(ref)
    assert again.analysis.image.size == (528, 528) and torch.equal(again.analysis.attentions, large.analysis.attentions)
    SERVER.store.drop(ref.key)
    os.remove(path)
    with pytest.raises(Exception, match="analyse it again"):
        SERVER.recall(ref)


@pytest.mark.slow
def test_memory_stays_within_the_state_budget_after_many_new_sessions(server, demo, small, good):
    """600 refused joins in new sessions (inputs that do not fit, junk in a field) and 100 real
    analyses of the embedded shapes_p16, each in a new session (20 of them never read their results),
    against a budget of 24 sessions: the sessions served before the refusals keep their state, Gradio
    holds at most 24 sessions (and unread results of at most 24), and resident memory grows by at
    most what the budget allows (sessions at their price, the analyses' share) and 64 MB for the
    test's own; afterwards a normal analysis works."""
    image = upload(server, good)
    index = fn_index(server, "session_analyze")
    analyse(server, image, uuid.uuid4().hex)  # warm: the model loaded, Gradio's first-call costs paid
    release_memory(keep=0)
    start = resident_bytes()
    served = [page_hash() for _ in range(8)]
    for session in served:
        analyse(server, image, session)
    junk = [[image, "shapes_p16"], [image, "shapes_p16", "mean", "junk", None]]
    for i in range(600):
        session, data = uuid.uuid4().hex, junk[i % 2]
        r = httpx.post(f"{server}/gradio_api/queue/join", timeout=30, json={
            "data": data, "fn_index": index, "session_hash": session, "event_data": None, "trigger_id": None})
        if r.status_code == 200:
            (done,) = results(server, session, 1)
            assert not done["success"]
    assert all(s in demo.state_holder for s in served), "refused requests pushed out sessions that had been served"
    for i in range(100):
        session = uuid.uuid4().hex
        if i % 5:
            analyse(server, image, session)
        else:  # joined, never read
            assert join(server, "session_analyze", [image, "shapes_p16", "mean", 0.0, None], session).status_code == 200
        assert len(demo.state_holder.session_data) <= small.sessions
        assert len(demo._queue.pending_messages_per_session) <= small.sessions
    analyse(server, image, uuid.uuid4().hex)  # the server still serves (after every unread one has run)
    release_memory(keep=0)
    grown = resident_bytes() - start
    bound = small.sessions * small.session_bytes + small.state_bytes + 64 * 2**20
    assert grown <= bound, f"resident memory grew by {grown / 2**20:.0f} MB, beyond {bound / 2**20:.0f} MB"
