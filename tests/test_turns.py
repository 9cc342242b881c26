"""Clients take turns for the model lanes by the time they have had (`vitviz.server.guards.work.ModelWork`):
a short request of one address runs within a step of another's long one, jobs of one address keep
their order, a job given way keeps its memory and takes its lane back, a paused job can be stopped,
and its pause counts neither against its time nor in the learned speed. Ordered events, not times."""

from __future__ import annotations

import threading
import time

import pytest

from vitviz import steps
from vitviz.cost import Cost
from vitviz.server.guards.work import Cancelled, Job, ModelWork


def _cost(kind="analyse", nbytes=1, flops=0):
    return Cost(kind, "v", 1, nbytes, 0, float(flops))


class _Log:
    def __init__(self):
        self.events = []
        self.lock = threading.Lock()

    def __call__(self, what):
        with self.lock:
            self.events.append(what)

    def index(self, what):
        return self.events.index(what)


def _long(work, log, name, owner, *, steps_count=400, nbytes=1, hold=None):
    """A job of many small steps (a forward's blocks), logging its start and end."""
    def run():
        try:
            with work.job(_cost(nbytes=nbytes), owner=owner, session=name) as job:
                log(f"{name} start")
                for i in range(steps_count):
                    time.sleep(0.005)
                    steps.step()
                    if hold is not None and i == 0:
                        hold.set()
                log(f"{name} end")
                log((name, job.paused_seconds))
        except Cancelled:
            log(f"{name} stopped")
    return threading.Thread(target=run)


def _short(work, log, name, owner, *, nbytes=1):
    def run():
        with work.job(_cost(nbytes=nbytes), owner=owner, session=name):
            log(f"{name} start")
            time.sleep(0.02)
            log(f"{name} end")
    return threading.Thread(target=run)


def _wait_for(predicate, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_another_addresss_short_job_runs_within_a_step_of_a_long_one():
    work = ModelWork(budget_bytes=100, lanes=1, seconds=1000.0)
    log, started = _Log(), threading.Event()
    long = _long(work, log, "flood", "10.0.0.2", hold=started)
    long.start()
    assert started.wait(30)
    _wait_for(lambda: work.used("10.0.0.2") > 2 * work.quantum)
    short = _short(work, log, "victim", "10.0.0.1")
    short.start()
    short.join(60)
    long.join(60)
    e = log.events
    assert e.index("victim end") < e.index("flood end"), e  # it did not wait for the long job
    (paused,) = [p for what, p in (x for x in e if isinstance(x, tuple))]
    assert paused > 0  # the long job gave its lane way, then took it back and ended
    assert work.running() == [] and work._free == 100


def test_jobs_of_one_address_keep_their_order_and_never_two_run_at_once():
    work = ModelWork(budget_bytes=100, lanes=1, seconds=1000.0)
    log, started = _Log(), threading.Event()
    live, peak = [0], [0]
    original = work._give_way

    long = _long(work, log, "first", "10.0.0.1", steps_count=100, hold=started)
    long.start()
    assert started.wait(30)
    short = _short(work, log, "second", "10.0.0.1")  # the same address: no turn taken from its own job
    short.start()
    short.join(60)
    long.join(60)
    assert log.index("first end") < log.index("second start"), log.events

    # lanes are never held by two jobs at once, however many owners wait and give way
    def counting(job):
        original(job)
        with work._cond:
            live[0] = work._lanes_taken()
            peak[0] = max(peak[0], live[0])

    work._give_way = counting
    threads = [_long(work, log, f"j{i}", f"10.0.1.{i % 3}", steps_count=30) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert peak[0] == 1 and all(f"j{i} end" in log.events for i in range(6))


def test_a_free_lane_goes_to_the_owner_who_has_had_least():
    work = ModelWork(budget_bytes=100, lanes=1, seconds=1000.0)
    work._add_use(Job(_cost(), "busy", 0.0, owner="busy"), 50.0)  # an address that had the lane for 50 s of late
    log, release = _Log(), threading.Event()

    def holder():
        with work.job(_cost(), owner="holder"):
            release.wait(30)

    h = threading.Thread(target=holder)
    h.start()
    _wait_for(lambda: len(work.running()) == 1)
    waiting = [_short(work, log, "busy", "busy"), _short(work, log, "new", "new")]  # "busy" asked first
    waiting[0].start()
    _wait_for(lambda: len(work._waiting) == 1)
    waiting[1].start()
    _wait_for(lambda: len(work._waiting) == 2)
    release.set()
    for t in [h, *waiting]:
        t.join(30)
    assert log.index("new end") < log.index("busy start"), log.events


def test_a_job_that_gave_way_keeps_its_memory_and_can_be_stopped_while_it_waits():
    work = ModelWork(budget_bytes=100, lanes=1, seconds=1000.0)
    log, started, release = _Log(), threading.Event(), threading.Event()
    long = _long(work, log, "flood", "10.0.0.2", nbytes=60, steps_count=2000, hold=started)
    long.start()
    assert started.wait(30)
    _wait_for(lambda: work.used("10.0.0.2") > 2 * work.quantum)

    def victim():
        with work.job(_cost(nbytes=40), owner="10.0.0.1", session="victim"):
            log("victim start")
            assert work._free == 0  # the paused job still holds its 60
            release.wait(30)

    v = threading.Thread(target=victim)
    v.start()
    _wait_for(lambda: "victim start" in log.events)
    paused = [j for j in work.running() if j.paused]
    assert [j.session for j in paused] == ["flood"]
    assert work.cancel("flood") == 1  # Stop, while it waits for its turn
    long.join(30)
    assert "flood stopped" in log.events and "flood end" not in log.events
    release.set()
    v.join(30)
    assert work.running() == [] and work._free == 100


def test_a_pause_counts_neither_in_the_time_limit_nor_in_the_learned_speed():
    class Clock:
        now = 0.0

        def __call__(self):
            return self.now

    clock = Clock()
    work = ModelWork(budget_bytes=100, lanes=1, seconds=1000.0, rate=1e9, clock=clock)
    log, started = _Log(), threading.Event()
    cost = Cost("analyse", "v", 1, 1, 0, 1e11)

    def flood():
        with work.job(cost, owner="flood") as job:
            started.set()
            _wait_for(lambda: work.used("flood") > 2 * work.quantum and len(work._waiting) == 1)
            deadline = job.deadline
            job.check()  # gives way to the victim here
            log(("deadline moved", job.deadline - deadline))
            clock.now += 10.0  # ten seconds of its own work

    def victim():
        with work.job(_cost(), owner="victim"):
            clock.now += 990.0  # the victim's time, while the flood waits
            log("victim")

    f = threading.Thread(target=flood)
    f.start()
    assert started.wait(30)
    v = threading.Thread(target=victim)
    v.start()
    f.join(30)
    v.join(30)
    moved = next(x[1] for x in log.events if isinstance(x, tuple))
    assert moved > 0
    assert work.estimate(cost) == pytest.approx(10.0)  # its own 10 s, not the 1,000 it waited


def test_a_pause_ends_at_its_limit_when_the_lane_does_not_come_back():
    """(A job that gave way while holding a lock the other needs would otherwise wait for good.)"""
    work = ModelWork(budget_bytes=100, lanes=1, seconds=1000.0, pause_limit=0.2)
    log, started, release = _Log(), threading.Event(), threading.Event()
    long = _long(work, log, "flood", "10.0.0.2", steps_count=200, hold=started)
    long.start()
    assert started.wait(30)
    _wait_for(lambda: work.used("10.0.0.2") > 2 * work.quantum)

    def stuck():
        with work.job(_cost(), owner="10.0.0.1"):
            log("stuck start")
            release.wait(60)

    s = threading.Thread(target=stuck)
    s.start()
    long.join(60)
    assert "flood end" in log.events and "stuck start" in log.events
    release.set()
    s.join(30)


def test_steps_outside_a_job_and_without_steps_do_nothing():
    calls = []
    steps.step()
    with steps.between_steps(lambda: calls.append(1)):
        steps.step()
        with steps.without_steps():
            steps.step()
        steps.step()
    steps.step()
    assert calls == [1, 1]


# ------------------------------------------------------------------------------------------------
# Over raw HTTP: one address floods the queue with windowed analyses, another asks for one analysis


def test_a_victims_analysis_is_not_held_behind_another_addresss_flood(server, good, app, monkeypatch):
    """127.0.0.2 sends the most it may (`VITVIZ_ADDRESS_JOBS` joins, two per session) of a Swin's
    analysis at 1,152 px; once the first is in its rollout through the network (0.8 s here, the
    analysis' longest part), 127.0.0.1 asks for one analysis of `shapes_p16`. Its event is handed to
    a thread at once (the model group dispatches one address's share and a lane more) and takes the
    lane at the flood's next step: it ends before any job of the flood. (Before: after the flood's
    first job, at best.)"""
    from vitviz.server.app import SERVER
    import uuid

    from conftest import join, results, upload

    import vitviz
    from vitviz.server import runtime

    # (the lane time 127.0.0.1 had in earlier tests of this process would count against the victim)
    monkeypatch.setattr(SERVER.work, "_used", {})
    in_rollout = threading.Event()
    through = vitviz.swin_global._window_right
    monkeypatch.setattr(vitviz.swin_global, "_window_right", lambda *a, **k: (in_rollout.set(), through(*a, **k))[1])

    flooder, victim = "127.0.0.2", "127.0.0.1"
    image = upload(server, good, address=flooder)
    sessions = [uuid.uuid4().hex for _ in range(SERVER.settings.address_jobs // 2)]
    for session in sessions:
        for _ in range(2):
            r = join(server, "session_analyze", [image, "shapes_swin@1152", "mean", 0.0, None], session, address=flooder)
            assert r.status_code == 200, r.text
    done, lock = [], threading.Lock()

    def read(session, count, address):
        for _ in range(count):
            try:
                (msg,) = results(server, session, 1, address=address, timeout=120)
            except AssertionError:  # (its stream closed: the rest were stopped)
                return
            with lock:
                done.append((session, msg["success"]))

    readers = [threading.Thread(target=read, args=(s, 2, flooder), daemon=True) for s in sessions]
    for t in readers:
        t.start()
    assert in_rollout.wait(120)
    mine = uuid.uuid4().hex
    r = join(server, "session_analyze", [upload(server, good, address=victim), "shapes_p16", "mean", 0.0, None], mine, address=victim)
    assert r.status_code == 200, r.text
    (msg,) = results(server, mine, 1, address=victim)
    with lock:
        flood_done = len(done)
    assert msg["success"], msg
    assert flood_done == 0, done
    queue = app.demo._queue

    def flood_left():
        waiting = [e for line in queue.event_queue_per_concurrency_id.values() for e in line.queue]
        running = [e for job in queue.active_jobs if job for e in job]
        return [e for e in waiting + running if e.session_hash in sessions]

    deadline = time.monotonic() + 120
    while flood_left() and time.monotonic() < deadline:  # Stop the rest of the flood, as the page's Stop does
        for session in sessions:
            SERVER.work.cancel(session)
        time.sleep(0.1)
    assert not flood_left() and not SERVER.work.running()
