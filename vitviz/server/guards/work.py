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

Clients take turns by the lane time they have had: a free lane goes to the waiting job whose owner
(a client's address) has used the least of late (decayed with a half-life of `HALF_LIFE` s), and a
running job gives its lane way at its next step (`vitviz.steps`: after each block, rollout layer,
target) to a waiting job of an owner who has used at least `QUANTUM` s less, then takes it back
when its turn comes again, its memory kept meanwhile. A short request of one client so runs
within a step of a long one of another (least attained service, per owner), and two clients with
long jobs share the lane about evenly.
"""

from __future__ import annotations

import itertools
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np

from vitviz import steps
from vitviz.cost import Cost

__all__ = ["RequestRefused", "Busy", "Cancelled", "Job", "LineTimes", "Pace", "ModelWork", "KeyedLocks"]


@dataclass(frozen=True)
class Pace:
    """How long a job of one line takes: `fixed` seconds, plus its flops at `speed` (flops per
    second), plus its attention products' flops (`Cost.products`, of its flops) once more at
    `products_speed` (what a flop of them takes beyond another's), plus its bytes (`Cost.bytes`, the
    memory it may take) at `bandwidth` (bytes per second; `math.inf`: no part grows with them); and
    never less than its flops at `fastest`, the most flops per second a large job of the line ran
    at, all its time counted (`math.inf`: none ran)."""

    fixed: float
    speed: float
    bandwidth: float = math.inf
    fastest: float = math.inf
    products_speed: float = math.inf

    def seconds(self, flops: float, nbytes: float = 0.0, products: float = 0.0) -> float:
        """A job's seconds (a job of no work: none)."""
        if flops <= 0:
            return 0.0
        work = flops / self.speed + products / self.products_speed + nbytes / self.bandwidth
        return max(self.fixed + work, flops / self.fastest)


def _family(line: str) -> str:
    """The family a line of work (`Cost.line`, "kind/family") belongs to ("/global"); a line without
    one is a family of its own."""
    _, slash, family = line.rpartition("/")
    return slash + family if slash else line


@dataclass(frozen=True)
class _Fit:
    """A line's own parts (`LineTimes._fit`; without a large job, none: `LineTimes.parts` sets its
    speed and the fixed part beside it), its large jobs' median and least flops a second (None: it
    ran none) and its sizes (flops, products, bytes, median seconds)."""

    pace: Pace
    speed: float | None
    slowest: float | None
    points: list[tuple[float, float, float, float]]


def _fixed_beside(points: list[tuple[float, ...]], speed: float, large_flops: float) -> float:
    """The fixed part beside a `speed` (a line's large jobs', else one from elsewhere) of the jobs
    `points` (flops first, seconds last): the median over those of less than `large_flops` (else
    over all) of their time less their flops at that speed (never below 0), so that a small job's
    work is not priced twice, in the fixed part and again at the speed; 0 without jobs."""
    rest = [(f, s) for f, *_, s in points if f < large_flops] or [(f, s) for f, *_, s in points]
    return statistics.median(max(0.0, s - f / speed) for f, s in rest) if rest else 0.0


def _nonnegative_fit(rows: list[tuple[float, ...]], seconds: list[float]) -> tuple[float, ...]:
    """The coefficients c >= 0 that make `rows @ c` nearest `seconds` in relative error (each job
    counts by how far off it would be priced, whatever its size), found by trying every set of
    columns left free (a handful of columns: exact, and cheap)."""
    columns = len(rows[0])
    scale = [max(r[j] for r in rows) or 1.0 for j in range(columns)]
    a = np.array([[v / (s * t) for v, s in zip(r, scale)] for r, t in zip(rows, seconds)])
    best, fit = math.inf, (0.0,) * columns
    for free in range(1, columns + 1):
        for chosen in itertools.combinations(range(columns), free):
            coef = np.linalg.lstsq(a[:, chosen], np.ones(len(rows)), rcond=None)[0]
            if (coef < 0).any():
                continue
            full = np.zeros(columns)
            full[list(chosen)] = coef
            miss = float(((a @ full - 1.0) ** 2).sum())
            if miss < best:
                best, fit = miss, tuple(float(c / s) for c, s in zip(full, scale))
    return fit


class LineTimes:
    """The seconds each line of work (`Cost.line`) takes here, learned from its last `keep` jobs as
    a fixed part and parts that grow with the work: seconds = fixed + flops / speed + products /
    products_speed + bytes / bandwidth (`Pace`).

    A request's fixed part (decoding, resizing, pictures, copies, Python) does not shrink with the
    model, and on a GPU it is most of a small model's time, so one speed alone prices small models
    far above what they take; and what a request moves (attention maps copied, drawn and written,
    the bytes it is priced for) takes time that its flops do not say. Nor do its flops say how
    fast they run: each head's attention products (`Cost.products`) multiply narrow matrices (N x
    D/H by D/H x N), slower per flop than the projections' wide ones, and their share of a forward
    runs from 1 % (`vit_b_32`) to 74 % (`shapes_p16@576`), so they take a part of their own, on top
    of their flops' (never priced faster than other flops). Once the line has run a large job
    (`LARGE_FLOPS` of work, taking over `LARGE_SECONDS` and over twice the median time of the
    line's jobs of less work: mostly its work's time, not the fixed part's) and three jobs of
    different sizes in all, the parts are fitted together (the products' from four sizes on: one
    more than the other parts, so that three jobs' noise is not taken for it), each at least 0, to
    what its jobs took, each size once (the median time of the jobs of that size, whichever variants
    ran them) and each weighed by its relative error, so that small jobs count as much as a large
    one. Flops and bytes grow together over a line's jobs, so the fit may put all their time on one
    of them; a job is therefore never priced as running its flops more than `FASTER` times as fast
    as the fastest large job of its line ran them (all its time counted), or one far larger than any
    seen could be priced at its bytes alone and let in past the limit. Before that, the speed is
    the median of the large jobs' work over their time less the median time of the jobs of less work
    (else of the other jobs; at least half their time), and the fixed part is those jobs' time less
    their work at that speed (the median, at least 0): two sizes fitted exactly would take their
    noise for the parts, and a small job that ran fast would set a slow large one's speed. Until
    the line has run a large job, its speed is its family's (the lines of the same
    family, global or windowed, that have: the median over them of each one's large jobs' flops
    over their whole time), where that is above `rate`, else `rate`: what a machine runs shows in
    every kind of work of a family, within a factor of about two, where the rate may be a hundred
    times off (a GPU); and one line's slow jobs never make another line's first large job look
    slower than a server that had run nothing would price it (the windowed family's rollouts none
    of the global's). A line whose large jobs were all pushed out of its last `keep` by small ones
    runs at the least flops a second any of its large jobs ran at (all time counted), never its
    family's: a client cannot send small jobs to have a slow kind of work priced as a fast one.
    Beside such a speed the fixed part is taken as beside a large job's (over the jobs of less work,
    else over all): a small job's work is priced once, at the speed, not again in the fixed part
    (which would price a model ten times smaller than those run, whose time is mostly work, at ten
    times its time).
    Small jobs alone never set a speed: their time says nothing of how fast work runs, and a speed
    taken from them (a slow small job's) would price a large job hundreds of times too high.

    Models of one line still differ in what a flop costs them (a wide model's products run faster
    per flop than a narrow one's many small ones), so a job of a variant that has run jobs of about
    its size on the line (within `SPREAD`) is priced by those jobs alone, in proportion to its work:
    the line's parts price a variant until it has run.
    """

    SPREAD = 1.5
    FASTER = 2.0
    LARGE_FLOPS = 1e10
    LARGE_SECONDS = 0.05

    def __init__(self, rate: float, *, keep: int = 32) -> None:
        if rate <= 0 or keep < 1:
            raise ValueError(f"a rate above 0 and keep of 1 or more, got {rate} and {keep}")
        self.rate = rate
        self.keep = keep
        self._jobs: dict[str, deque[tuple[float, float, float, float]]] = {}  # line -> (flops, products, bytes, seconds) of its last jobs
        self._own: dict[tuple[str, str], deque[tuple[float, float]]] = {}  # (line, variant) -> its last jobs
        self._fits: dict[str, _Fit] = {}  # the line's own fit, fitted again after its next job
        self._paces: dict[str, Pace] = {}  # the line's parts (a speed borrowed from its family), again after the family's next job
        self._slowest: dict[str, float] = {}  # line -> the least flops a second a large job of it ran at, all time counted
        self._lock = threading.Lock()

    def add(self, line: str, flops: float, seconds: float, variant: str | None = None, *, nbytes: float = 0.0,
            products: float = 0.0) -> None:
        """One job of `line` (of `variant`, priced `nbytes`) ran `flops`, `products` of them attention
        products, in `seconds` (jobs with no work or no time are not counted)."""
        if (flops > 0 and seconds > 0 and math.isfinite(flops) and math.isfinite(seconds) and 0 <= nbytes < math.inf
                and 0 <= products <= flops):
            with self._lock:
                job = (float(flops), float(products), float(nbytes), float(seconds))
                jobs = self._jobs.setdefault(line, deque(maxlen=self.keep))
                if len(jobs) == self.keep:  # (its large jobs' speed noted before one leaves)
                    self._fitted(line)
                jobs.append(job)
                self._fits.pop(line, None)
                family = _family(line)
                for other in [other for other in self._paces if _family(other) == family]:
                    del self._paces[other]
                if variant is not None:
                    own = self._own.pop((line, variant), None) or deque(maxlen=8)
                    own.append((float(flops), float(seconds)))
                    self._own[(line, variant)] = own  # (last: the most recently run)
                    while len(self._own) > 64 * self.keep:  # the least recently run variants forgotten first
                        del self._own[next(iter(self._own))]

    def parts(self, line: str) -> Pace:
        """The fixed part, speeds and bandwidth of `line` as learned so far."""
        with self._lock:  # (fits of at most `keep` jobs each: well under a millisecond)
            pace = self._paces.get(line)
            if pace is None:
                fit = self._fitted(line)
                pace = fit.pace
                if fit.speed is None:  # no large job (left): a speed from elsewhere, and the fixed part beside it
                    if line in self._slowest:  # its large jobs pushed out by small ones: the slowest it ran
                        speed = self._slowest[line]
                    else:  # its family's speed, where that is faster than the rate
                        family = _family(line)
                        speeds = [s for other in self._jobs if other != line and _family(other) == family
                                  for s in (self._fitted(other).speed,) if s is not None]
                        speed = max(statistics.median(speeds), self.rate) if speeds else self.rate
                    pace = replace(pace, speed=speed, fixed=_fixed_beside(fit.points, speed, self.LARGE_FLOPS))
                self._paces[line] = pace
        return pace

    def _fitted(self, line: str) -> _Fit:
        fit = self._fits.get(line)
        if fit is None:
            fit = self._fits[line] = self._fit(self._jobs.get(line, ()))
            if fit.slowest is not None:
                self._slowest[line] = min(self._slowest.get(line, math.inf), fit.slowest)
        return fit

    def _fit(self, jobs: Iterable[tuple[float, float, float, float]]) -> _Fit:
        """The line's own parts, the median and the least of its large jobs' flops over their time
        (all of it counted; both None when it ran none), and its sizes."""
        sizes: dict[tuple[float, float, float], list[float]] = {}  # each size once (its median time), whichever variants ran it
        for flops, products, nbytes, seconds in jobs:
            sizes.setdefault((flops, products, nbytes), []).append(seconds)
        points = [(*size, statistics.median(times)) for size, times in sizes.items()]
        lesser = [s for f, *_, s in points if f < self.LARGE_FLOPS]  # the times of the jobs of less work
        less = statistics.median(lesser) if lesser else 0.0
        large = [(f, s) for f, *_, s in points if f >= self.LARGE_FLOPS and s > max(self.LARGE_SECONDS, 2 * less)]
        if not large:  # the work's speed is not its own: `parts` takes one, and the fixed part beside it
            return _Fit(Pace(0.0, self.rate), None, None, points)
        paces = [f / s for f, s in large]
        fastest, own, slowest = self.FASTER * max(paces), statistics.median(paces), min(paces)
        if len(points) >= 3:  # the products' part once there is a size more than the other parts
            told = len(points) >= 4
            rows = [(1.0, f, p if told else 0.0, b) for f, p, b, _ in points]
            fixed, per_flop, per_product, per_byte = _nonnegative_fit(rows, [s for *_, s in points])
            pace = Pace(fixed, *(1.0 / c if c > 0 else math.inf for c in (per_flop, per_byte)), fastest,
                        1.0 / per_product if per_product > 0 else math.inf)
            return _Fit(pace, own, slowest, points)
        # fewer sizes: the speed from the large jobs' time less the others' (at least half of it), and the fixed part
        # the others' time less their work at that speed (the jobs of less work's, else the others')
        others = [point for point in points if (point[0], point[-1]) not in large]
        before = less if lesser or not others else statistics.median(s for *_, s in others)
        speed = statistics.median(f / max(s - before, s / 2) for f, s in large)
        return _Fit(Pace(_fixed_beside(others, speed, self.LARGE_FLOPS), speed, math.inf, fastest), own, slowest, points)

    def estimate(self, line: str, flops: float, variant: str | None = None, *, nbytes: float = 0.0, products: float = 0.0) -> float:
        """Seconds a job of `line` (of `variant`, priced `nbytes`) running `flops`, `products` of them
        attention products, is expected to take."""
        if variant is not None and flops > 0:
            with self._lock:
                own = [(f, t) for f, t in self._own.get((line, variant), ()) if max(f, flops) < self.SPREAD * min(f, flops)]
            if own:
                return statistics.median(t * flops / f for f, t in own)
        return self.parts(line).seconds(flops, nbytes, products)


class RequestRefused(ValueError):
    """A request this server will not run; the message says why and what would be accepted."""


class Busy(RequestRefused):
    """A request that fits this server, refused because no lane or memory came free within its wait."""


class Cancelled(RuntimeError):
    """A job stopped before its end: cancelled by its client, or past its time."""


QUANTUM = 0.05  # s a job keeps its lane before it gives way, and the lead in lane time that makes it
HALF_LIFE = 60.0  # s: an owner's lane time counts half after this long
PAUSE_LIMIT = 30.0  # s a job that gave way waits at most before it runs again beside the others


@dataclass(eq=False)
class Job:
    """A running piece of model work."""

    cost: Cost
    session: str | None
    deadline: float
    cancelled: threading.Event = field(default_factory=threading.Event)
    unpriced: bool = False  # set when the job did work its price leaves out (loading a model): not timed
    lane: bool = True  # it holds one of the lanes (False: small work that runs no model)
    owner: str | None = None  # whose turn it takes (a client's address)
    caller: str | None = None  # and within the owner's turns, whose (a session, an MCP caller; else `session`)
    order: int = 0  # when it arrived (a count of the jobs before it)
    started: float = 0.0  # (monotonic) when it last took its lane
    paused: bool = False  # it gave its lane way and waits to take it back
    paused_seconds: float = 0.0  # (the work's clock) time spent given way, out of its timing
    work: "ModelWork | None" = field(default=None, repr=False)

    def check(self) -> None:
        """Raises `Cancelled` when the job was cancelled or its time is up; gives its lane way when
        another owner's turn has come (`ModelWork`). Cheap: call it between steps."""
        self._stop_if_over()
        if self.work is not None and self.lane:
            self.work._give_way(self)

    def _stop_if_over(self) -> None:
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
    started running (the time it gave its lane way to others not counted).

    The seconds a job takes are learned from the jobs that ran (`LineTimes`: a fixed part and parts
    that grow with its flops, its attention products and its bytes), for each line of work on its
    own (`Cost.line`: the kind of request and the model's family), so that one client's slow
    windowed rollouts do not make another's ViT explanations look slow; a line that has run no large
    job yet runs at its family's speed where that is above `rate` (flops per second), else at
    `rate`. A job whose estimate exceeds `seconds` is refused before it starts. `clock` (seconds,
    `time.perf_counter` by default) times them.

    Lanes go to owners by turns (the module's docstring): `quantum`, `half_life`, `pause_limit`.
    """

    def __init__(self, *, budget_bytes: int, lanes: int, seconds: float, rate: float = 5e10,
                 clock: Callable[[], float] = time.perf_counter, quantum: float = QUANTUM, half_life: float = HALF_LIFE,
                 pause_limit: float = PAUSE_LIMIT) -> None:
        self.budget_bytes = budget_bytes
        self.lanes = lanes
        self.seconds = seconds
        self.times = LineTimes(rate)
        self.quantum = quantum
        self.half_life = half_life
        self.pause_limit = pause_limit
        self._clock = clock
        self._free = budget_bytes
        self._running: list[Job] = []  # (those given way included: they hold their memory)
        self._waiting: list[Job] = []  # waiting to start, or given way and waiting to take their lane back
        self._used: dict[str | None, tuple[float, float]] = {}  # owner -> (lane seconds, when), decayed since
        self._arrivals = 0
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
        if math.isnan(estimate):  # (flops or bytes that are no number: never let in)
            return f"{cost.kind.capitalize()} of {cost.variant} could not be priced on this server; it was not run."
        if estimate > self.seconds:
            return (
                f"{cost.kind.capitalize()} of {cost.variant} would take about {estimate:,.0f} s on this server, more than its "
                f"limit of {self.seconds:,.4g} s (VITVIZ_REQUEST_SECONDS): choose a smaller model or image size."
            )
        return None

    def estimate(self, cost: Cost) -> float:
        """Seconds `cost` is expected to run here."""
        return self.times.estimate(cost.line, cost.flops, cost.variant, nbytes=cost.bytes, products=cost.products)

    def current(self) -> Job | None:
        """The job the calling thread runs under, if any."""
        return getattr(self._local, "job", None)

    def job_clock(self) -> float:
        """The work's clock (seconds) less the time the calling thread's job has given its lane way:
        what a part of a job took, timed by it, is its own work."""
        job = self.current()
        return self._clock() - (job.paused_seconds if job is not None else 0.0)

    @contextmanager
    def job(self, cost: Cost, *, session: str | None = None, owner: str | None = None, caller: str | None = None,
            wait: float | None = None, lane: bool = True) -> Iterator[Job]:
        """Runs the block as a job priced `cost`; nested jobs of one thread share the outer one. The
        block's steps (`vitviz.steps`) check the job (`Job.check`).

        Args:
            owner: whose turn it takes (a client's address; None is an owner of its own).
            caller: whose turn within the owner's (a session, an MCP caller; `session` if None).
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
        job = Job(cost, session, deadline=math.inf, lane=lane, owner=owner, caller=caller, work=self)
        with self._cond:
            self._arrivals += 1
            job.order = self._arrivals
            self._waiting.append(job)
            try:
                ready = self._cond.wait_for(lambda: job.cancelled.is_set() or self._may_start(job), timeout=wait)
            finally:
                self._waiting.remove(job)
            if not ready:
                raise Busy(f"The server is busy with other requests: try the {cost.kind} of {cost.variant} again in a moment.")
            job._stop_if_over()  # (stopped while it waited; it holds no lane yet, so it gives none way)
            self._free -= cost.bytes
            self._running.append(job)
            job.started = time.monotonic()
            self._cond.notify_all()  # (the next in turn may start beside it when lanes are left)
        job.deadline = job.started + self.seconds  # its time starts when it runs
        self._local.job = job
        start = self._clock()
        try:
            with steps.between_steps(job.check):
                yield job
            spent = self._clock() - start - job.paused_seconds
            if not job.unpriced:  # the line's times, from the priced work it ran
                self.times.add(cost.line, cost.flops, spent, cost.variant, nbytes=cost.bytes, products=cost.products)
        finally:
            self._local.job = None
            with self._cond:
                if job.lane and not job.paused:
                    self._add_use(job, time.monotonic() - job.started)
                self._free += cost.bytes
                self._running.remove(job)
                self._cond.notify_all()

    # -- turns -------------------------------------------------------------------------------------

    def used(self, owner: str | None, now: float | None = None) -> float:
        """The lane seconds `owner` has used, decayed by their age, its running jobs' included."""
        return self._use(("owner", owner), now)

    def _use(self, key: tuple[str, str | None], now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._cond:
            seconds, at = self._used.get(key, (0.0, now))
            seconds *= 0.5 ** (max(0.0, now - at) / self.half_life)
            return seconds + sum(now - j.started for j in self._running if j.lane and not j.paused and key in _keys(j))

    def _add_use(self, job: Job, seconds: float) -> None:
        """`job` had the lane for `seconds`: its owner's and its session's time."""
        now = time.monotonic()
        for key in _keys(job):
            before, at = self._used.pop(key, (0.0, now))
            self._used[key] = (before * 0.5 ** (max(0.0, now - at) / self.half_life) + max(0.0, seconds), now)
        if len(self._used) > 4096:  # the oldest keys' time has mostly decayed: forget the first half
            for key in list(self._used)[:2048]:
                del self._used[key]

    def _lanes_taken(self) -> int:
        return sum(1 for j in self._running if j.lane and not j.paused)

    def _next_in_turn(self, *, other_than: str | None | object = ...) -> Job | None:
        """The waiting lane job whose turn is next: its owner's use the least, then one that gave way
        before one that has not started, then its session's use the least (sessions of one address
        take turns too), then first come; only jobs whose memory is free now."""
        now = time.monotonic()
        fits = [j for j in self._waiting if j.lane and (j.paused or j.cost.bytes <= self._free) and j.owner != other_than
                and not j.cancelled.is_set()]
        if not fits:
            return None
        use = {key: self._use(key, now) for j in fits for key in _keys(j)}
        return min(fits, key=lambda j: (use[("owner", j.owner)], not j.paused, use[_keys(j)[1]], j.order))

    def _may_start(self, job: Job) -> bool:
        if not job.lane:
            return self._free >= job.cost.bytes
        return self._lanes_taken() < self.lanes and self._next_in_turn() is job

    def _give_way(self, job: Job) -> None:
        """At a step of `job`: when an owner who has used at least a quantum less waits, its job
        takes the lane, and `job` waits for its own turn (at most `pause_limit` s at a time)."""
        now = time.monotonic()
        if not self._waiting or now - job.started < self.quantum:
            return
        with self._cond:
            other = self._next_in_turn(other_than=job.owner)
            if other is None or self.used(other.owner, now) + self.quantum > self.used(job.owner, now):
                return
            self._add_use(job, now - job.started)
            job.paused = True
            self._waiting.append(job)
            self._cond.notify_all()
            paused_at, clock_at = now, self._clock()
            try:
                self._cond.wait_for(lambda: job.cancelled.is_set() or self._may_start(job), timeout=self.pause_limit)
            finally:
                self._waiting.remove(job)
                job.paused = False
                job.started = time.monotonic()
                job.deadline += job.started - paused_at
                job.paused_seconds += self._clock() - clock_at
        job._stop_if_over()  # (stopped while it waited)

    def cancel(self, session: str | None) -> int:
        """Cancels the jobs of `session`, running or waiting; returns how many."""
        with self._cond:
            jobs = {id(j): j for j in self._running + self._waiting if session is not None and j.session == session}
            for j in jobs.values():
                j.cancelled.set()
            self._cond.notify_all()
        return len(jobs)

    def running(self) -> list[Job]:
        with self._cond:
            return list(self._running)


def _keys(job: Job) -> tuple[tuple[str, str | None], tuple[str, str | None]]:
    return ("owner", job.owner), ("session", job.caller or job.session)


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
