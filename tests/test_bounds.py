"""Every request bounded before it runs, against the running app through raw HTTP: sizes and
names, one budget of model work, fair shares of the queue, request bodies, uploads, disk, and no
bare "Error" — private events and component-server calls included. After each hostile call a
normal analysis still works and the server's resident memory is back near where it started."""

import dataclasses
import json
import os
import threading
import time
import uuid

import httpx
import numpy as np
import pytest
from PIL import Image

from conftest import fn_index, join, results, run, upload
import vitviz
from vitviz.server.guards.memory import release_memory, resident_bytes
from vitviz.server.guards.work import LineTimes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def app():
    # what the page's handlers share (runtime), imported with the app and bound here for every test
    global runtime
    from vitviz.server import app as app_module, runtime

    return app_module


def _rss() -> int:
    return resident_bytes()


def _alive(base: str, good) -> None:
    ok, out = run(base, "analyze", [upload(base, good), "shapes_p16"])
    assert ok and out[0]["label"] == "star", out


@pytest.fixture()
def steady(server, good):
    """After the test: a normal analysis works and resident memory is within 200 MB of the start."""
    _alive(server, good)
    release_memory(keep=0)
    before = _rss()
    yield
    _alive(server, good)
    release_memory(keep=0)
    assert _rss() - before < 200 * 2**20, f"resident memory grew by {(_rss() - before) / 2**20:.0f} MB"


class _Timers:
    """Timers a test fires itself: `HeapKeeper(timer=...)`."""

    def __init__(self):
        self.armed = []

    def __call__(self, seconds, fn):
        timers = self

        class Timer:
            cancelled = False

            def start(self):
                timers.armed.append(self)

            def cancel(self):
                self.cancelled = True

            def fire(self):  # as threading.Timer does once its time is up, cancelled or not (a race the keeper must survive)
                fn()

        return Timer()


def test_freed_heap_is_handed_back_once_resident_memory_grows_past_what_is_kept():
    """`release_memory`'s rule keeps up to `keep` bytes of growth since its last hand-back for the
    next request (no trim per request), hands everything back past that, at once with keep=0, and
    once idle after a call that kept it when no other call came."""
    from vitviz.server.guards.memory import HeapKeeper

    trims, resident, timers = [], [1000 * 2**20], _Timers()

    def trim(pad):
        trims.append(pad)
        resident[0] -= 50 * 2**20  # what the hand-back returned
        return 1

    keeper = HeapKeeper(trim=trim, resident=lambda: resident[0], timer=timers)
    keep = 100 * 2**20
    keeper.release(keep=keep)  # nothing handed back yet: now, leaving 950 MB
    assert trims == [0] and timers.armed == []
    resident[0] += 100 * 2**20  # a forward's working set, freed and kept: 1,050 MB, within 950 + 100
    keeper.release(keep=keep)
    assert trims == [0] and len(timers.armed) == 1 and not timers.armed[0].cancelled
    resident[0] += 1  # past it: handed back at once, and the earlier wait cancelled; the mark moves to what is left
    keeper.release(keep=keep)
    assert trims == [0, 0] and timers.armed[0].cancelled
    timers.armed[0].fire()  # a wait that fires after a later call hands nothing back
    assert trims == [0, 0]
    resident[0] += keep  # 1,000 MB + 1 + keep: within the new mark's keep
    keeper.release(keep=keep)
    assert trims == [0, 0]
    keeper.release(keep=0)
    assert trims == [0, 0, 0]
    # kept, then idle: handed back once no call has come; a call meanwhile re-arms the wait
    keeper.release(keep=keep)
    keeper.release(keep=keep)
    first, second = timers.armed[-2:]
    assert first.cancelled and not second.cancelled and trims == [0, 0, 0]
    first.fire()
    assert trims == [0, 0, 0]
    second.fire()
    assert trims == [0, 0, 0, 0]  # one hand-back for the two calls
    unknown = HeapKeeper(trim=trim, resident=lambda: None, timer=timers)
    unknown.release(keep=keep)
    unknown.release(keep=keep)
    assert len(trims) == 6  # resident memory unreadable: handed back each time
    HeapKeeper(trim=None, resident=lambda: resident[0], timer=timers).release(keep=0)  # no malloc_trim: nothing to do
    assert len(trims) == 6


def test_freed_heap_goes_back_to_the_system_when_the_requests_stop():
    """Real malloc (glibc) and a real timer: 200 MB of small blocks, half of them freed in a pattern
    that leaves no free top to shrink, kept by a call within its `keep`, then handed back once idle."""
    from vitviz.server.guards import memory

    keeper = memory.HeapKeeper(idle_seconds=0.2)
    if memory.resident_bytes() is None or not memory.HANDS_BACK:
        pytest.skip("glibc's malloc_trim and /proc are needed")
    keeper.release(keep=0)
    blocks = [bytearray(100_000) for _ in range(2000)]  # below malloc's mmap threshold: on the heap
    for b in blocks:
        b[::4096] = b"\1" * len(b[::4096])  # every page touched
    keeper.release(keep=0)  # the mark: the blocks live
    del blocks[::2]  # 100 MB free, between live blocks
    before = memory.resident_bytes()
    keeper.release(keep=1 << 40)  # within keep: kept for now
    assert memory.resident_bytes() > before - 20 * 2**20
    deadline = time.monotonic() + 30
    while memory.resident_bytes() > before - 60 * 2**20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert memory.resident_bytes() <= before - 60 * 2**20, "the freed half stayed resident after the requests stopped"
    del blocks


def test_the_server_hands_back_past_its_heap_keep_setting(monkeypatch):
    from vitviz.server.app import SERVER
    from vitviz.server import runtime
    from vitviz.server.guards.settings import Settings, SettingsError

    monkeypatch.setenv("VITVIZ_HEAP_KEEP_MB", "0")
    assert Settings.from_env(gpu=False, menu_tokens=197).heap_keep_bytes == 0
    monkeypatch.setenv("VITVIZ_HEAP_KEEP_MB", "-1")
    with pytest.raises(SettingsError, match="VITVIZ_HEAP_KEEP_MB"):
        Settings.from_env(gpu=False, menu_tokens=197)
    monkeypatch.delenv("VITVIZ_HEAP_KEEP_MB")
    assert Settings.from_env(gpu=False, menu_tokens=197).heap_keep_bytes == 256 * 2**20
    calls = []
    monkeypatch.setattr(SERVER, "settings", dataclasses.replace(SERVER.settings, heap_keep_bytes=12345))
    monkeypatch.setattr(runtime, "release_memory", lambda **kw: calls.append(kw))
    SERVER.run(runtime.EXAMPLES[0], "shapes_p16")
    assert calls == [{"keep": 12345}] * 2  # before the analysis and after it


def test_sizes_beyond_the_token_bound_are_refused_before_any_work(server, good, app, steady):
    from vitviz.server.app import SERVER
    calls = []
    original = SERVER.cache.get
    SERVER.cache.get = lambda name: (calls.append(name), original(name))[1]
    try:
        image = upload(server, good)
        for name in ["shapes_p16@1024", "shapes_p16@4096", "shapes_p8@1536"]:
            ok, message = run(server, "analyze", [image, name])
            assert not ok and "VITVIZ_MAX_TOKENS" in message and "sizes up to @" in message, message
            ok, out = run(server, "session_analyze", [image, name, "mean", 0.0, None])  # the page's: the notice says why
            assert ok and "VITVIZ_MAX_TOKENS" in json.dumps(out), out
            ok, message = run(server, "on_other_model", [name, []])
            assert ok and "VITVIZ_MAX_TOKENS" in str(message), message  # the notice says why
        for name in ["shapes_p16@0", "shapes_p16@-16", "shapes_p16@abc", "shapes_p16@17", "shapes_p16@"]:
            ok, message = run(server, "analyze", [image, name])
            assert not ok and message != "Error" and ("multiple" in message or "number" in message), message
        assert not [c for c in calls if "@" in c and not c.endswith("@384")]  # no model of those sizes was built: no work ran
        ok, out = run(server, "analyze", [image, "shapes_p16@384"])  # 577 tokens: within the bound
        assert ok and out[0]["label"]
    finally:
        SERVER.cache.get = original


def test_the_worst_cases_the_readme_states(app):
    from vitviz.server.app import SERVER
    from vitviz.cost import price
    from vitviz.server.guards.work import ModelWork
    from vitviz.sources import get_spec

    assert SERVER.settings.max_tokens == 1370  # ViT-H/14 at 518 px, the menu's largest
    work = ModelWork(budget_bytes=SERVER.settings.work_bytes, lanes=1, seconds=SERVER.settings.request_seconds)  # not yet timed
    h14 = get_spec("vit_h_14")
    assert work.refusal(price(h14, "analyse")) is None  # every menu model can be analysed: 5.0 GiB at most
    assert "VITVIZ_WORK_MB" in work.refusal(price(h14, "explain"))  # its explanation needs more than 6 GiB
    assert work.refusal(price(get_spec("vit_b_16"), "faithfulness", budget=work.budget_bytes)) is None


def test_one_budget_of_model_work_across_events(server, good, app, monkeypatch, steady):
    """Analyses through four different events, and rollouts redrawn through an event outside their
    concurrency group, all at once: one runs at a time (one lane on CPU)."""
    live, peak = [0], [0]
    lock = threading.Lock()

    def counted(original):
        def run_alone(*args, **kwargs):
            with lock:
                live[0] += 1
                peak[0] = max(peak[0], live[0])
            try:
                time.sleep(0.3)
                return original(*args, **kwargs)
            finally:
                with lock:
                    live[0] -= 1
        return run_alone

    image = upload(server, good)
    owner = uuid.uuid4().hex
    ok, _ = run(server, "session_analyze", [image, "shapes_p16", "mean", 0.0, None], session=owner)
    assert ok
    monkeypatch.setattr(runtime.views, "explore", counted(runtime.views.explore))
    monkeypatch.setattr(runtime.views, "render_rollout", counted(runtime.views.render_rollout))
    sessions = [uuid.uuid4().hex for _ in range(4)]
    for session, (name, extra) in zip(sessions, [("analyze", []), ("session_analyze", ["mean", 0.0, None]),
                                                 ("on_analyze", ["mean", 0.0, None, ""]), ("on_compare", [])]):
        data = [image, ["shapes_p16", "shapes_p8"], "shared"] if name == "on_compare" else [image, "shapes_p16", *extra]
        assert join(server, name, data, session).status_code == 200
    for ratio in (0.1, 0.2):  # `session_rollout` is not in the model group: only the shared budget holds it back
        assert join(server, "session_rollout", [None, "max", ratio], owner).status_code == 200
    for session in sessions:
        (msg,) = results(server, session, 1)
        assert msg["success"], msg
    assert all(m["success"] for m in results(server, owner, 2))
    assert peak[0] == 1


def test_an_explorer_layer_is_computed_once_whatever_the_number_of_callers(server, good, app, monkeypatch):
    """Six concurrent component-server calls for one layer of a large analysis write its file once
    (with lanes enough for all of them: the lock per layer, not the budget, makes it once)."""
    from vitviz.server.app import SERVER
    from vitviz.server.pictures import explorer_data

    session = uuid.uuid4().hex
    ok, _ = run(server, "session_analyze", [upload(server, good), "shapes_p8@288", "mean", 0.0, None], session=session)
    assert ok
    (key,) = [k for k, (e, _, _) in SERVER.store._entries.items() if getattr(getattr(e, "analysis", None), "variant", None) == "shapes_p8@288"][-1:]
    written = []
    original = explorer_data.stack_file
    monkeypatch.setattr(explorer_data, "stack_file", lambda a, layers: (written.append(list(layers)), time.sleep(0.3), original(a, layers))[2])
    monkeypatch.setattr(SERVER.work, "lanes", 6)
    monkeypatch.setattr(SERVER, "explorer_calls", threading.BoundedSemaphore(6))
    config = httpx.get(f"{server}/config").json()
    component = next(c["id"] for c in config["components"] if c.get("props", {}).get("elem_id") == "vv-explorer-live")
    body = {"session_hash": session, "component_id": component, "fn_name": "explorer_layer", "data": [key, 3]}
    answers = [None] * 6

    def call(i):
        answers[i] = httpx.post(f"{server}/gradio_api/component_server", json=body, timeout=60)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert len({a.json() for a in answers}) == 1 and written == [[2]]


def test_an_explorer_layer_takes_no_lane_and_one_written_takes_no_job(server, good, app, monkeypatch):
    """A layer's file is small work that runs no model: while another session's long job holds the
    lane it is still written (its memory free); one written already is answered at once even with
    no memory free; one to write with no memory free is answered "busy" after its wait. Every
    refusal is a 200 answer with its reason, by raw HTTP as the page calls it."""
    from vitviz.server.app import SERVER
    from vitviz.cost import Cost
    from vitviz.server import tabs

    from vitviz.server.pictures import explorer_data
    session = uuid.uuid4().hex
    ok, _ = run(server, "session_analyze", [upload(server, good), "shapes_p8@288", "mean", 0.0, None], session=session)
    assert ok
    (key,) = [k for k, (e, _, _) in SERVER.store._entries.items() if getattr(getattr(e, "analysis", None), "variant", None) == "shapes_p8@288"][-1:]
    config = httpx.get(f"{server}/config").json()
    component = next(c["id"] for c in config["components"] if c.get("props", {}).get("elem_id") == "vv-explorer-live")

    def layer(data):
        body = {"session_hash": session, "component_id": component, "fn_name": "explorer_layer", "data": data}
        start = time.perf_counter()
        answer = httpx.post(f"{server}/gradio_api/component_server", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json(), time.perf_counter() - start

    def holding(nbytes):  # another session's job, running until `release` is set
        started, release = threading.Event(), threading.Event()

        def hold():
            with SERVER.work.job(Cost("faithfulness", "other", 1, nbytes, 0, 0.0), session="other"):
                started.set()
                release.wait(60)

        thread = threading.Thread(target=hold)
        thread.start()
        assert started.wait(10)
        return thread, release

    monkeypatch.setattr(tabs.explorer, "LAYER_WAIT", 1.0)
    thread, release = holding(1)  # the lane taken, the memory free
    try:
        assert SERVER.work.lanes == 1 and len(SERVER.work.running()) == 1
        path, _ = layer([key, 3])  # written beside the job that holds the lane (waiting for it would answer "busy")
        assert path == str(explorer_data.layer_path(SERVER.explorer_dir, key, 3)), path
    finally:
        release.set()
        thread.join()
    thread, release = holding(SERVER.work.budget_bytes)  # the lane and every byte taken
    try:
        assert layer([key, 3])[0] == path  # written already: no job
        busy, _ = layer([key, 4])
        assert busy["busy"] is True and "busy" in busy["error"], busy
        assert not explorer_data.layer_path(SERVER.explorer_dir, key, 4).exists()
    finally:
        release.set()
        thread.join()
    assert layer([key, 4])[0] == str(explorer_data.layer_path(SERVER.explorer_dir, key, 4))
    monkeypatch.setattr(SERVER.work, "budget_bytes", 2**20)  # a layer's file that can never fit: asking again would not help
    never, _ = layer([key, 5])
    assert never["busy"] is False and "VITVIZ_WORK_MB" in never["error"], never
    for bad, words in (([key, 99], "layer"), (["x" * 22, 1], "no longer kept"), ("junk", "takes [key, layer]"), (None, "takes")):
        answer, _ = layer(bad)
        assert answer["busy"] is False and words in answer["error"], (bad, answer)


def test_one_client_cannot_fill_the_queue(server, good, app, monkeypatch, steady):
    """33 joins from one session while its first analysis runs: `client_jobs` more wait, the rest are
    told to wait their turn; another client's analysis, joined after them all, runs next (sessions take
    turns, within an address too), and every admitted job completes. The first analysis is held until the test lets it go,
    so nothing here depends on how fast anything runs."""
    from vitviz.server.app import SERVER
    original = runtime.views.explore
    started, release, order = threading.Event(), threading.Event(), []

    def held(cache, image, variant, **kwargs):
        order.append(variant)
        if len(order) == 1:
            started.set()
            release.wait(120)
        return original(cache, image, variant, **kwargs)

    monkeypatch.setattr(runtime.views, "explore", held)
    image = upload(server, good)
    hog, victim = uuid.uuid4().hex, uuid.uuid4().hex
    assert join(server, "analyze", [image, "shapes_p8@192"], hog).status_code == 200
    try:
        assert started.wait(120), "the first analysis never started"
        codes, texts = [], []
        for _ in range(32):
            r = join(server, "analyze", [image, "shapes_p8@192"], hog)
            codes.append(r.status_code)
            texts.append(r.text)
        jobs = SERVER.settings.client_jobs
        assert codes.count(200) == jobs and codes.count(503) == 32 - jobs, codes
        assert "One at a time, please" in texts[-1]
        assert join(server, "analyze", [image, "shapes_p16"], victim).status_code == 200
        deadline = time.monotonic() + 60  # (its event handed on at once: it waits for its turn with the hog's)
        while not any(j.session == victim for j in SERVER.work._waiting) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        release.set()
    (done,) = results(server, victim, 1)
    assert done["success"]
    assert all(m["success"] for m in results(server, hog, 1 + jobs))
    assert order == ["shapes_p8@192", "shapes_p16"] + ["shapes_p8@192"] * jobs  # the other client's turn came first


def test_faithfulness_is_bounded_in_time_and_can_be_stopped(server, good, app, monkeypatch):
    from vitviz.server.app import SERVER
    session = uuid.uuid4().hex
    ok, _ = run(server, "session_analyze", [upload(server, good), "shapes_p8@192", "mean", 0.0, None], session=session)
    assert ok
    monkeypatch.setattr(SERVER.work, "seconds", 0.5)
    monkeypatch.setattr(SERVER.work, "times", LineTimes(5e10))  # no line's time learned yet: every estimate at the rate
    ok, message = run(server, "session_faithfulness", [None, "star"], session=session)  # priced: about 4 s here
    assert not ok and "would take about" in message and "VITVIZ_REQUEST_SECONDS" in message, message
    monkeypatch.setattr(SERVER.work, "times", LineTimes(1e15))  # an estimate that lets it start: the deadline stops it
    ok, message = run(server, "session_faithfulness", [None, "star"], session=session)
    assert not ok and "ran out of time" in message and "VITVIZ_REQUEST_SECONDS" in message, message
    monkeypatch.setattr(SERVER.work, "times", LineTimes(5e10))
    monkeypatch.setattr(SERVER.work, "seconds", 300.0)
    assert join(server, "session_faithfulness", [None, "star"], session).status_code == 200
    deadline = time.monotonic() + 30
    while not SERVER.work.running() and time.monotonic() < deadline:
        time.sleep(0.02)
    stop = httpx.post(f"{server}/gradio_api/run/on_stop", timeout=30, json={"data": [], "session_hash": session})
    assert stop.status_code == 200, stop.text
    (msg,) = results(server, session, 1)
    assert not msg["success"] and "stopped" in msg["output"]["error"], msg


def test_request_bodies_are_bounded_before_they_are_read(server, good, steady):
    for size in (2 * 2**20, 100 * 2**20):
        r = httpx.post(f"{server}/gradio_api/queue/join", content=b"{" + b" " * size, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 413, r.text

    def chunks():  # no stated length: counted as it arrives, cut off past the bound
        for _ in range(64):
            yield b" " * 2**16

    r = httpx.post(f"{server}/gradio_api/component_server", content=chunks(), timeout=60)
    assert r.status_code == 413


def test_uploads_that_are_not_images_are_dropped_at_the_door_and_volume_is_bounded(server, good, app, monkeypatch, tmp_path):
    from vitviz.server.app import SERVER
    folder = runtime.upload_folder()
    before = {p for p in folder.rglob("*") if p.is_file()}
    for _ in range(5):
        r = httpx.post(f"{server}/gradio_api/upload", files=[("files", ("x.png", os.urandom(2 * 2**20)))], timeout=60)
        assert r.status_code == 415 and "Only images" in r.text
    assert not [p for p in folder.rglob("*") if p.is_file() and p not in before and p.stat().st_size > 2**20]
    # an address's volume per minute
    middleware = next(m for m in app.LAUNCH_KWARGS["app_kwargs"]["middleware"] if m.cls.__name__ == "UploadLimit")
    assert middleware.kwargs["per_minute"] == SERVER.settings.upload_bytes_per_minute
    big = tmp_path / "noise.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (1800, 1800, 3), dtype=np.uint8)).save(big, compress_level=0)
    statuses = []
    for _ in range(SERVER.settings.upload_bytes_per_minute // big.stat().st_size + 2):
        with open(big, "rb") as f:
            statuses.append(httpx.post(f"{server}/gradio_api/upload", files=[("files", ("n.png", f.read()))], timeout=60).status_code)
    assert statuses[0] == 200 and statuses[-1] == 429


def test_model_names_are_names_and_refusals_name_no_server_path(server, good, app, monkeypatch, steady):
    from vitviz.server.app import SERVER
    image = upload(server, good)
    messages = {}
    for name in ["hf:/etc/passwd", "hf:/etc", "hf:/nonexistent/x", "hf:../../etc", "hf:./models", "hf:~/x"]:
        ok, message = run(server, "analyze", [image, name])
        assert not ok
        messages[name] = message
    assert len(set(messages.values())) == 1, messages
    (message,) = set(messages.values())
    assert "/etc" not in message and "repository id" in message
    for name in ["timm:local-dir:/etc", "timm:hf-hub:timm/vit_tiny_patch16_224.augreg_in21k"]:
        ok, message = run(server, "analyze", [image, name])
        assert not ok and "/etc" not in message, message
    monkeypatch.setattr(SERVER, "settings", dataclasses.replace(SERVER.settings, open_models=False))
    ok, message = run(server, "analyze", [image, "timm:vit_tiny_patch16_224"])
    assert not ok and "VITVIZ_OPEN_MODELS" in message
    ok, _ = run(server, "analyze", [image, "shapes_p8"])
    assert ok


def test_no_bare_error_for_junk_values(server, good, steady):
    session = uuid.uuid4().hex
    ok, _ = run(server, "session_analyze", [upload(server, good), "shapes_p16", "mean", 0.0, None], session=session)
    assert ok
    cases = [
        ("session_view", ["abc", "mean", 0, "each map its own"]),
        ("session_view", [float("nan"), "mean", 0, "each map its own"]),
        ("session_view", [3, "head 9", 0, "each map its own"]),
        ("session_view", [3, "mean", 1e30, "each map its own"]),
        ("session_rollout", ["mean", "x"]),
        ("session_explain", [12, "each map"]),
        ("session_find", ["a red star", "gradient"]),  # a model without a text tower
        ("session_find", [["a", "b"], "gradient"]),
        ("session_find", ["a, b, c, d, e", "legrad"]),
        ("session_find", ["x" * 5000, 3]),
        ("on_click", [3, "mean", "each map its own"]),
        ("on_dino_share", ["lots"]),
        ("session_rank_heads", ["not a class", "zero"]),
        ("session_rank_heads", [None, "sideways"]),
        ("on_inside", [None, ["L99 H1"], "zero"]),
        ("on_inside", [None, "L1 H1" * 1000, "zero"]),
        ("on_inside", [None, [], {"mode": "zero"}]),
    ]
    for name, data in cases:
        event_data = {"index": [float("nan"), "x"], "value": None} if name == "on_click" else None
        body = json.dumps({"data": data, "fn_index": fn_index(server, name), "session_hash": session, "event_data": event_data,
                           "trigger_id": None}).replace("NaN", "NaN")
        r = httpx.post(f"{server}/gradio_api/queue/join", content=body, headers={"content-type": "application/json"}, timeout=30)
        if r.status_code != 200:  # refused by Gradio's own validation: a message, not a bare "Error"
            assert r.text and "Error" != r.text.strip(), r.text
            continue
        (msg,) = results(server, session, 1)
        assert not msg["success"], (name, msg)
        error = msg["output"].get("error")
        assert error and error.strip() != "Error" and len(error) > 20, (name, error)


def test_disk_stays_within_its_budgets_after_many_writes(server, good, app, monkeypatch):
    """100 exports under a budget of five, one too large for a smaller budget refused, the
    explorer's files under 8 MB, uploads and Gradio's copies of pictures and downloads under 256 kB
    (examples aside)."""
    from vitviz.server.app import SERVER
    from vitviz.cost import price

    session = uuid.uuid4().hex
    ok, _ = run(server, "session_analyze", [upload(server, good), "shapes_p16", "mean", 0.0, None], session=session)
    assert ok
    size = price(vitviz.get_spec("shapes_p16"), "export").kept_bytes
    monkeypatch.setattr(SERVER.downloads, "max_bytes", 5 * size)
    sizes = []
    for _ in range(100):
        ok, out = run(server, "on_export", [None], session=session)
        assert ok, out
        sizes.append(sum(p.stat().st_size for p in SERVER.downloads.folder.glob("*.npz")))
    assert max(sizes) <= 5 * size and len(sizes) * min(sizes) > 5 * size  # the budget was crossed, and held
    monkeypatch.setattr(SERVER.downloads, "max_bytes", size // 2)
    ok, message = run(server, "on_export", [None], session=session)
    assert not ok and "VITVIZ_DOWNLOADS_MB" in message
    monkeypatch.setattr(SERVER, "settings", dataclasses.replace(SERVER.settings, explorer_bytes=8 * 2**20, files_bytes=256 * 1024))
    monkeypatch.setattr(app.demo, "after_every", 0.0)  # the app sweeps after every event, not every 5 s
    for i in range(12):
        ok, out = run(server, "session_analyze", [upload(server, good), f"shapes_p8@{96 + 16 * (i % 4)}", "mean", 0.0, None], session=session)
        assert ok and "vv-error" not in json.dumps(out), out
        explorer = sum(p.stat().st_size for p in SERVER.explorer_dir.glob("*"))
        assert explorer <= 8 * 2**20
    time.sleep(0.5)  # the last sweep runs beside the event that triggered it
    files = [p for p in runtime.upload_folder().rglob("*") if p.is_file() and SERVER.explorer_dir not in p.parents and not runtime.is_example(p)]
    assert sum(p.stat().st_size for p in files) <= 256 * 1024, len(files)
    # explorer files of analyses no longer written to (a process before this one's) go by age after any event
    stale = SERVER.explorer_dir / "AAAAAAAAAAAAAAAAAAAAAA-layer1.bin"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    run(server, "session_view", [None, 1, "mean", 0, "one per layer"], session=session)  # any event
    deadline = time.monotonic() + 10
    while stale.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not stale.exists()


def test_hub_models_named_by_clients_stay_within_their_budget(tmp_path):
    from collections import OrderedDict

    from vitviz.server.models import prune_hub_cache

    for repo, size in [("org/a", 3), ("org/b", 3), ("org/c", 3)]:
        folder = tmp_path / f"models--{repo.replace('/', '--')}" / "blobs"
        folder.mkdir(parents=True)
        (folder / "weights").write_bytes(b"\0" * size * 2**20)
    repos = OrderedDict.fromkeys(["org/a", "org/b", "org/c"])
    left = prune_hub_cache(repos, max_bytes=5 * 2**20, keep="org/a", cache=tmp_path)
    assert left == 3 * 2**20 and list(repos) == ["org/a"]
    assert not (tmp_path / "models--org--b").exists() and (tmp_path / "models--org--a").exists()
