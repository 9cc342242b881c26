"""One budget of model work for the whole server: every request is priced before it runs, refused
when it could never fit, and otherwise waits until its memory and a lane are free (a small job that
runs no model, an explorer's layer file, waits for its memory only).

    WORK = ModelWork(budget_bytes=6 * 2**30, lanes=1, seconds=300)
    with WORK.job(price(spec, "analyse"), session=session_hash) as job:
        ...                      # job.check() between steps: raises when cancelled or out of time

Whatever runs a model or builds analysis data (analyse with its pictures, explain, faithfulness,
compare, export, the explorer's files, a rollout drawn again with new options, an analysis computed
again after the store dropped it) takes a job, whether it came through Gradio's queue or outside it
(component-server calls run on a thread pool and wait at most a few seconds). A thread that already
holds a job runs nested work under it. A job's time starts when it runs, not while it waits.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from vitviz.cost import Cost

__all__ = ["RequestRefused", "Busy", "Cancelled", "Job", "ModelWork", "KeyedLocks"]


class RequestRefused(ValueError):
    """A request this server will not run; the message says why and what would be accepted."""


class Busy(RequestRefused):
    """A request that fits this server, refused because no lane or memory came free within its wait."""


class Cancelled(RuntimeError):
    """A job stopped before its end: cancelled by its client, or past its time."""


@dataclass
class Job:
    """A running piece of model work."""

    cost: Cost
    session: str | None
    deadline: float
    cancelled: threading.Event = field(default_factory=threading.Event)
    unpriced: bool = False  # set when the job did work its price leaves out (loading a model): not timed
    lane: bool = True  # it holds one of the lanes (False: small work that runs no model)

    def check(self) -> None:
        """Raises `Cancelled` when the job was cancelled or its time is up; cheap, call it between steps."""
        if self.cancelled.is_set():
            raise Cancelled(f"{self.cost.kind} of {self.cost.variant} was stopped.")
        if time.monotonic() > self.deadline:
            raise Cancelled(
                f"{self.cost.kind} of {self.cost.variant} ran out of time on this server; try a smaller model or image size "
                "(VITVIZ_REQUEST_SECONDS sets the limit)."
            )


class ModelWork:
    """At most `lanes` jobs at once (besides small ones that run no model), together within
    `budget_bytes`; a job that checks (`Job.check`, between its steps) stops `seconds` after it
    started running.

    The server's speed (flops per second) is learned from the jobs that ran, for each line of work on
    its own (`Cost.line`: the kind of request and the model's family), so that one client's slow
    windowed rollouts do not make another's ViT explanations look slow; `rate` is every line's
    speed until a job of it has been timed. A job whose estimate exceeds `seconds` at its line's
    speed is refused before it starts. `clock` (seconds, `time.perf_counter` by default) times them.
    """

    def __init__(self, *, budget_bytes: int, lanes: int, seconds: float, rate: float = 5e10,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.budget_bytes = budget_bytes
        self.lanes = lanes
        self.seconds = seconds
        self.rate = rate
        self.rates: dict[str, float] = {}  # each line of work's learned speed
        self._clock = clock
        self._free = budget_bytes
        self._running: list[Job] = []
        self._waiting: list[Job] = []
        self._cond = threading.Condition()
        self._local = threading.local()

    def refusal(self, cost: Cost) -> str | None:
        """Why `cost` can never run here, or None."""
        if cost.bytes > self.budget_bytes:
            return (
                f"{cost.kind.capitalize()} of {cost.variant} ({cost.tokens:,} tokens) may take {cost.bytes / 2**20:,.0f} MB; this "
                f"server runs requests of up to {self.budget_bytes / 2**20:,.0f} MB (VITVIZ_WORK_MB): choose a smaller model or "
                "image size."
            )
        estimate = self.estimate(cost)
        if estimate > self.seconds:
            return (
                f"{cost.kind.capitalize()} of {cost.variant} would take about {estimate:,.0f} s on this server, more than its "
                f"limit of {self.seconds:,.4g} s (VITVIZ_REQUEST_SECONDS): choose a smaller model or image size."
            )
        return None

    def speed(self, cost: Cost) -> float:
        """The flops per second expected of `cost`'s line of work."""
        return self.rates.get(cost.line, self.rate)

    def estimate(self, cost: Cost) -> float:
        """Seconds `cost` is expected to run here."""
        return cost.flops / self.speed(cost)

    def current(self) -> Job | None:
        """The job the calling thread runs under, if any."""
        return getattr(self._local, "job", None)

    @contextmanager
    def job(self, cost: Cost, *, session: str | None = None, wait: float | None = None, lane: bool = True) -> Iterator[Job]:
        """Runs the block as a job priced `cost`; nested jobs of one thread share the outer one.

        Args:
            wait: the longest to wait for a lane and memory (None: as long as it takes).
            lane: False for small work that runs no model (an explorer's layer file): it waits for
                its memory only, and takes no lane from the model jobs.

        Raises:
            RequestRefused: the job can never fit this server's bounds, or (`Busy`) found no lane or
                memory free in `wait` s.
            Cancelled: its session stopped it while it waited.
        """
        outer = self.current()
        if outer is not None:
            yield outer
            return
        why = self.refusal(cost)
        if why:
            raise RequestRefused(why)
        job = Job(cost, session, deadline=math.inf, lane=lane)
        with self._cond:
            self._waiting.append(job)
            try:
                ready = self._cond.wait_for(
                    lambda: job.cancelled.is_set() or ((not lane or self._lanes_taken() < self.lanes) and self._free >= cost.bytes),
                    timeout=wait)
            finally:
                self._waiting.remove(job)
            if not ready:
                raise Busy(f"The server is busy with other requests: try the {cost.kind} of {cost.variant} again in a moment.")
            job.check()
            self._free -= cost.bytes
            self._running.append(job)
        job.deadline = time.monotonic() + self.seconds  # its time starts when it runs
        self._local.job = job
        start = self._clock()
        try:
            yield job
            spent = self._clock() - start
            if cost.flops >= 1e10 and spent > 0.2 and not job.unpriced:  # the line's speed, from priced work large enough to time
                with self._cond:
                    self.rates[cost.line] = 0.7 * self.speed(cost) + 0.3 * cost.flops / spent
        finally:
            self._local.job = None
            with self._cond:
                self._free += cost.bytes
                self._running.remove(job)
                self._cond.notify_all()

    def _lanes_taken(self) -> int:
        return sum(1 for j in self._running if j.lane)

    def cancel(self, session: str | None) -> int:
        """Cancels the jobs of `session`, running or waiting; returns how many."""
        with self._cond:
            jobs = [j for j in self._running + self._waiting if session is not None and j.session == session]
            for j in jobs:
                j.cancelled.set()
            self._cond.notify_all()
        return len(jobs)

    def running(self) -> list[Job]:
        with self._cond:
            return list(self._running)


class KeyedLocks:
    """One lock per key, so that work for one key is done once while other keys go on."""

    def __init__(self) -> None:
        self._locks: dict[object, tuple[threading.Lock, int]] = {}
        self._guard = threading.Lock()

    @contextmanager
    def hold(self, key: object) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._locks[key]
                if users <= 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)
