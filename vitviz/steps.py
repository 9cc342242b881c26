"""Points between the steps of long computations, where whoever runs them may act.

A forward calls `step()` after each block, a rollout after each layer (a windowed one after each
layer of each slice of its columns), an explanation after each target. Outside `between_steps`
a step does nothing; inside it, the thread's function runs there: a server stops work whose time
is up, or lets a shorter request of another client go first (`vitviz.server.guards.work`).

    with steps.between_steps(job.check):
        vitviz.analyze(model, image)     # job.check() after every block and every rollout layer
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["between_steps", "step", "without_steps"]

_local = threading.local()


def step() -> None:
    """Calls the calling thread's function set by `between_steps`, if any (what it raises goes
    through the computation that stepped)."""
    at = getattr(_local, "at", None)
    if at is not None:
        at()


@contextmanager
def between_steps(at: Callable[[], None]) -> Iterator[None]:
    """Runs the block with `at` called at each of its steps (this thread only; nests, the inner
    function replacing the outer one until it ends)."""
    outer = getattr(_local, "at", None)
    _local.at = at
    try:
        yield
    finally:
        _local.at = outer


def _nothing() -> None:
    pass


def without_steps():
    """Runs the block with its steps doing nothing: work done while holding a lock that others may
    wait for (loading a model) is not stopped or set aside halfway."""
    return between_steps(_nothing)
