"""The explorer of an analysis on its way (`vitviz.server.early`): the tickets' rules by themselves,
then through the running app by raw HTTP — the page's analysis named by a ticket, its pictures
published before the forward and its explorer's value right after it (the first view's bytes inline,
equal to the file's), the same value the outputs bring; junk tickets, steps and bodies answered
None, and the server serving on."""

import asyncio
import base64
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.test_bounds import results
from vitviz import cost
from vitviz.server.early import Tickets
from vitviz.server.pictures import explorer_data

T1, T2 = "A" * 22, "b-_" + "c" * 19


def _wait(tickets, ticket, step):
    return asyncio.run(tickets.wait(ticket, step))


def test_a_published_step_is_answered_at_once_and_an_ended_analysis_answers_none():
    t = Tickets()
    assert t.open(T1) == T1
    t.publish(T1, "pictures", {"base": "b"})
    assert _wait(t, T1, "pictures") == {"base": "b"}
    t.close(T1)  # ended before its explorer was published
    assert _wait(t, T1, "explorer") is None
    assert _wait(t, T1, "pictures") == {"base": "b"}  # what was published stays
    t.publish(T1, "explorer", {"id": "late"})  # settled already: not changed
    assert _wait(t, T1, "explorer") is None


def test_a_wait_before_the_analysis_is_answered_when_another_thread_publishes():
    t = Tickets()

    def analysis():
        time.sleep(0.1)
        assert t.open(T2) == T2
        time.sleep(0.1)
        t.publish(T2, "explorer", {"id": "k"})

    async def both():
        worker = threading.Thread(target=analysis)
        worker.start()
        start = time.perf_counter()
        got = await asyncio.gather(t.wait(T2, "explorer"), t.wait(T2, "explorer"))
        worker.join()
        return got, time.perf_counter() - start

    got, _ = asyncio.run(both())
    assert got == [{"id": "k"}, {"id": "k"}]  # both answered by the publish (a wait that ran out answers None)


@pytest.mark.parametrize("ticket", [None, "", "A" * 21, "A" * 23, "A" * 21 + "/", "A" * 21 + "é", 17, ["A" * 22], "A" * 10_000])
def test_what_is_no_ticket_gets_nothing(ticket):
    t = Tickets()
    assert t.open(ticket) is None
    assert _wait(t, ticket, "explorer") is None


def test_a_ticket_named_twice_gets_nothing_early_the_second_time_and_steps_are_checked():
    t = Tickets()
    assert t.open(T1) == T1 and t.open(T1) is None
    t.publish(T1, "explorer", {"id": "k"})
    assert _wait(t, T1, "explorer") == {"id": "k"}
    for step in ("data", None, 3, "explorer "):
        assert _wait(t, T1, step) is None


def test_waits_are_bounded_in_number_and_time():
    t = Tickets(waiters=2, wait_seconds=0.3)

    async def many():
        start = time.perf_counter()
        got = await asyncio.gather(*[t.wait(T1, "explorer") for _ in range(5)])
        return got, time.perf_counter() - start

    got, _ = asyncio.run(asyncio.wait_for(many(), 30))
    assert got == [None] * 5  # three answered at once (too many), two at their time limit
    assert t._count == 0 and t._waiting == {}


def test_one_owner_holds_at_most_its_share_of_the_waits():
    t = Tickets(waiters=8, waiters_per_owner=3, wait_seconds=0.3)

    async def many():
        hog = [asyncio.ensure_future(t.wait("H" * 22, "explorer", owner="10.0.0.1")) for _ in range(5)]
        await asyncio.sleep(0.05)
        held = (t._count, dict(t._owners))
        t.open(T1)
        t.publish(T1, "explorer", {"id": "k"})
        other = await t.wait(T1, "explorer", owner="10.0.0.2")  # another address: its wait is answered
        return held, other, await asyncio.gather(*hog)

    held, other, hog = asyncio.run(many())
    assert held == (3, {"10.0.0.1": 3}) and other == {"id": "k"} and hog == [None] * 5
    assert t._count == 0 and t._owners == {} and t._waiting == {}


def test_a_ticket_past_its_time_answers_nothing_though_no_other_was_opened():
    t = Tickets(seconds=0.2, wait_seconds=0.5)  # (a ticket no longer known: its wait ends at its limit)
    t.open(T1)
    t.publish(T1, "explorer", {"id": "k"})
    assert _wait(t, T1, "explorer") == {"id": "k"}
    time.sleep(0.3)
    assert _wait(t, T1, "explorer") is None and T1 not in t._entries


def test_a_wait_whose_caller_has_gone_gives_back_its_place():
    t = Tickets(wait_seconds=30, poll_seconds=0.05)
    asked = []

    async def gone():
        asked.append(time.perf_counter())
        return len(asked) >= 3

    async def scenario():
        start = time.perf_counter()
        got = await t.wait(T1, "explorer", owner="a", gone=gone)
        return got, time.perf_counter() - start

    got, _ = asyncio.run(scenario())
    assert got is None and len(asked) == 3  # ended at the third check, the one that found the caller gone, not at 30 s

    async def broken():  # a check that fails counts as the caller gone
        raise OSError("connection reset")

    assert asyncio.run(t.wait(T1, "explorer", owner="a", gone=broken)) is None
    assert t._count == 0 and t._owners == {} and t._waiting == {}

    async def answered():  # a caller still there gets what is published, between two polls or not
        t.open(T2)
        waiting = asyncio.ensure_future(t.wait(T2, "explorer", owner="a", gone=lambda: asyncio.sleep(0, result=False)))
        await asyncio.sleep(0.12)
        t.publish(T2, "explorer", {"id": "k"})
        return await asyncio.wait_for(waiting, 5)

    assert asyncio.run(answered()) == {"id": "k"}


def test_old_tickets_are_dropped_and_their_waits_answered():
    t = Tickets(size=2)

    async def scenario():
        t.open(T1)
        waiting = asyncio.ensure_future(t.wait(T1, "explorer"))
        await asyncio.sleep(0.05)
        t.open(T2)
        t.open("C" * 22)  # the third: T1, the oldest, goes
        return await asyncio.wait_for(waiting, 5)

    assert asyncio.run(scenario()) is None
    assert T1 not in t._entries and len(t._entries) == 2


# ------------------------------------------------------------------------------------------------
# Through the running app, by raw HTTP

@pytest.fixture(scope="module")
def server():
    global page, runtime, tabs
    from vitviz.server import app, page, runtime, tabs

    app.demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, **app.LAUNCH_KWARGS)
    try:
        yield app.demo.local_url.rstrip("/")
    finally:
        app.demo.close()


def _early(base: str, session: str, data) -> httpx.Response:
    body = {"session_hash": session, "component_id": tabs.explorer.TAB.live["global"]._id, "fn_name": "explorer_early", "data": data}
    return httpx.post(f"{base}/gradio_api/component_server", json=body, timeout=90)


def _analyse(base: str, session: str, image: str, ticket) -> list:
    """The page's own analysis (its upload event, the ticket its last input) by raw HTTP: its outputs."""
    config = httpx.get(f"{base}/config", timeout=30).json()
    (fn,) = [d["id"] for d in config["dependencies"] if [page.PAGE.image._id, "upload"] in d["targets"]]
    with open(image, "rb") as f:
        path = httpx.post(f"{base}/gradio_api/upload", files=[("files", ("photo.png", f.read()))], timeout=60).json()[0]
    data = [{"path": path, "meta": {"_type": "gradio.FileData"}}, "shapes_p16", "mean", 0.0, None, ticket]
    body = {"data": data, "fn_index": fn, "session_hash": session, "event_data": None, "trigger_id": None}
    assert httpx.post(f"{base}/gradio_api/queue/join", json=body, timeout=30).status_code == 200
    (msg,) = results(base, session, 1)
    assert msg["success"], msg
    return msg["output"]["data"]


def _analyse_while_waiting(base: str, session: str, ticket: str) -> tuple[list, float, dict]:
    """The page's analysis of the first example under `ticket`, with both of its early calls open
    before it starts: (its outputs, when they came, {step: (the call's answer, when it came)})."""
    got = {}

    def ask(step):
        got[step] = (_early(base, session, [ticket, step]), time.perf_counter())

    waits = [threading.Thread(target=ask, args=(step,)) for step in ("pictures", "explorer")]
    for w in waits:
        w.start()
    time.sleep(0.2)  # both waits open before the analysis starts
    outputs = _analyse(base, session, runtime.EXAMPLES[0], ticket)
    done = time.perf_counter()
    for w in waits:
        w.join()
    return outputs, done, got


def test_the_pages_analysis_publishes_its_explorer_before_its_outputs(server):
    session, ticket = uuid.uuid4().hex, "Tk" + uuid.uuid4().hex[:20]
    outputs, done, got = _analyse_while_waiting(server, session, ticket)
    pictures, value = got["pictures"][0].json(), got["explorer"][0].json()
    assert got["explorer"][1] < done  # answered before the analysis' outputs arrived
    assert set(pictures) == {"base", "tile_base", "scale"} and all(Path(pictures[p]).exists() for p in explorer_data.PICTURES)
    first = value.pop("first")
    # the value the outputs bring, with the pictures published before the forward
    index = page.PAGE.analysis_outputs.index(tabs.explorer.TAB.live["global"])
    assert value == outputs[index] and all(value[k] == pictures[k] for k in pictures)
    # inline, as in the file: the shared maxima, the last layer's row maxima, and its rows of token 0
    data = Path(value["data"]).read_bytes()
    v, n, m = value["views"], value["tokens"], value["patches"]
    head, block = 4 * n, v * n * (4 + m)
    last = data[head + (value["depth"] - 1) * block:]
    assert len(last) == block
    def rows(q):
        return b"".join(last[4 * v * n + (h * n + q) * m : 4 * v * n + (h * n + q + 1) * m] for h in range(v))

    assert base64.b64decode(first) == data[:head] + last[: 4 * v * n] + rows(0)
    assert base64.b64decode(explorer_data.first_shown(value, n - 1)) == data[:head] + last[: 4 * v * n] + rows(n - 1)
    with pytest.raises(ValueError, match="not a token"):
        explorer_data.first_shown(value, n)
    # a second analysis under the same ticket gets nothing early; its outputs still bring its explorer
    other = _analyse(server, session, runtime.EXAMPLES[1], ticket)
    assert other[index]["id"] != value["id"] and Path(other[index]["data"]).exists()
    assert _early(server, session, [ticket, "explorer"]).json()["id"] == value["id"]


@pytest.mark.parametrize("mode", ["layers", "server"])
def test_an_explorer_that_is_not_one_file_gets_nothing_early_and_the_page_is_told_before_the_forward(server, mode, monkeypatch):
    """shapes_p16 over a smaller budget: its explorer comes a layer at a time with the outputs
    ("layers": its pictures written before the forward, for them), or the server draws it ("server":
    no file at all). Either way both of the page's waits are answered None as the crop is made."""
    from vitviz.server.app import SERVER
    layer, head = 5 * 37 * (4 + 36), 4 * 37
    monkeypatch.setattr(cost, "BROWSER_BYTES", head + layer - (mode == "server"))
    crops = []
    on_crop = runtime._Early.on_crop
    monkeypatch.setattr(runtime._Early, "on_crop", lambda self, cropped: (on_crop(self, cropped), crops.append(time.perf_counter())))
    forward = runtime.views.analyze_crop  # the forward made to last a second: the answers come before it ends
    monkeypatch.setattr(runtime.views, "analyze_crop", lambda *a, **k: (time.sleep(1.0), forward(*a, **k))[1])
    before = set(SERVER.explorer_dir.glob("*"))
    session, ticket = uuid.uuid4().hex, "Tm" + uuid.uuid4().hex[:20]
    outputs, done, got = _analyse_while_waiting(server, session, ticket)
    assert got["pictures"][0].json() is None and got["explorer"][0].json() is None
    assert len(crops) == 1 and max(got["pictures"][1], got["explorer"][1]) < crops[0] + 0.5 < crops[0] + 1.0 < done
    live = outputs[page.PAGE.analysis_outputs.index(tabs.explorer.TAB.live["global"])]
    new = {p.name for p in set(SERVER.explorer_dir.glob("*")) - before}
    if mode == "layers":
        assert live["mode"] == "layers" and "data" not in live
        assert new == {Path(live[p]).name for p in explorer_data.PICTURES}  # the pictures, written once; no layer yet
    else:  # the outputs bring the server's explorer: its value, and its first views drawn
        assert live["mode"] == "server" and "too large" in live["note"] and "data" not in live and "base" not in live
        assert outputs[page.PAGE.analysis_outputs.index(tabs.explorer.TAB.server_explorer)]["visible"] is True
        assert outputs[page.PAGE.analysis_outputs.index(tabs.explorer.TAB.explorer_img)] is not None
        assert new == set()


@pytest.mark.parametrize("data", [None, "x", ["A" * 22], ["A" * 22, "explorer", 3], [["A" * 22], "explorer"], ["A" * 22, "pictures"],
                                  ["A" * 9000, "explorer"], {"ticket": "A" * 22}, 12])
def test_junk_early_calls_are_answered_none_and_the_server_serves_on(server, data, monkeypatch):
    from vitviz.server.app import SERVER
    monkeypatch.setattr(SERVER.early, "wait_seconds", 1.0)  # a ticket never opened: answered None at the limit
    r = _early(server, uuid.uuid4().hex, data)
    assert r.status_code == 200 and r.json() is None
    out = page.on_analyze(runtime.EXAMPLES[0], "shapes_p16", "mean", 0.0, progress=lambda *a, **k: None)
    assert out[page.PAGE.notice] == "" and SERVER.early._count == 0


def test_one_client_cannot_hold_every_pages_early_explorer(server, monkeypatch):
    """80 waits from one address on tickets no analysis opens, each dropped by its client (after 8 s; a
    loaded machine answers the others well within it): at most its share is held, and only while its
    callers are there; then a page's analysis gets its explorer early."""
    from vitviz.server.app import SERVER
    monkeypatch.setattr(SERVER.early, "per_owner", 4)
    monkeypatch.setattr(SERVER.early, "poll_seconds", 0.1)
    session = uuid.uuid4().hex
    body = lambda i: {"session_hash": session, "component_id": tabs.explorer.TAB.live["global"]._id, "fn_name": "explorer_early",
                      "data": [f"Hg{i:020d}", "explorer"]}

    async def hog():
        async with httpx.AsyncClient(timeout=8.0) as client:
            calls = [client.post(f"{server}/gradio_api/component_server", json=body(i)) for i in range(80)]
            got = await asyncio.gather(*calls, return_exceptions=True)
        return sum(isinstance(g, httpx.TimeoutException) for g in got), [g.json() for g in got if isinstance(g, httpx.Response)]

    held, answered = asyncio.run(hog())
    assert held == 4 and answered == [None] * 76  # the rest answered at once
    deadline = time.monotonic() + 5
    while SERVER.early._count and time.monotonic() < deadline:  # its callers gone: their places given back
        time.sleep(0.05)
    assert SERVER.early._count == 0 and SERVER.early._owners == {}
    outputs, done, got = _analyse_while_waiting(server, uuid.uuid4().hex, "Tn" + uuid.uuid4().hex[:20])
    assert got["explorer"][0].json()["id"] and got["explorer"][1] < done
