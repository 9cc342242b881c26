"""Commands that may run on many processes (`torchrun`): a mistake is one line on stderr, said once.

`python -m vitviz.evaluate` and `python -m vitviz.concepts train` share it: argparse's mistakes are one
line and exit status 2; an error the command knows (its `status` attribute) is said by the first
process alone, since every process finds it; Ctrl-C is exit status 130 with the command's own word on
what was kept; anything else is said by each process that met it, `--debug` showing the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import NoReturn, TypeVar

import torch.distributed as dist

__all__ = ["RANK_ZERO_WAIT", "fail", "parser", "run"]

RANK_ZERO_WAIT = 30.0  # seconds a process other than the first waits, after a mistake, for the first to say it

T = TypeVar("T")


def fail(name: str, status: int, message: str, *, every_rank: bool) -> NoReturn:
    """One line on stderr, prefixed by `name`, from the first process only unless `every_rank`; then
    exit with `status`. torchrun stops every process as soon as one exits, so another process that found
    the same mistake waits for the first to say it (torchrun ends it when the first exits)."""
    rank, world = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1"))
    if every_rank or rank == "0":
        where = f"rank {rank}: " if world > 1 and every_rank else ""
        print(f"{name}: {where}" + " ".join(line.strip() for line in message.splitlines()), file=sys.stderr)
    elif world > 1:
        time.sleep(RANK_ZERO_WAIT)
    raise SystemExit(status)


def parser(name: str, help_hint: str, **kwargs) -> argparse.ArgumentParser:
    """An argparse parser (`kwargs` its own; its class fits its subparsers) whose mistakes are one line
    from `fail` (`name` before it, `help_hint` after it, exit status 2) instead of the usage and the error."""

    class Parser(argparse.ArgumentParser):
        def error(self, message: str) -> NoReturn:
            fail(name, 2, f"{message} ({help_hint})", every_rank=False)

    return Parser(**kwargs)


def run(prog: str, work: Callable[[], T], *, debug: bool, known: type[Exception], stopped: Callable[[], str]) -> T:
    """`work()`, its failures turned into one line and an exit status (see the module's doc); the
    process group destroyed after it whatever happened."""
    from vitviz.sources import WeightsUnavailableError

    try:
        return work()
    except KeyboardInterrupt:
        if debug:
            raise
        fail(prog, 130, stopped(), every_rank=False)
    except known as exc:  # alike on every rank
        if debug:
            raise
        fail(prog, getattr(exc, "status", 1), str(exc), every_rank=False)
    except Exception as exc:
        if debug:
            raise
        what = str(exc) if isinstance(exc, (WeightsUnavailableError, OSError)) and str(exc) else f"{type(exc).__name__}: {exc}"
        fail(prog, 1, f"{what} (--debug shows the traceback)", every_rank=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
