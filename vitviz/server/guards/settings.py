"""The server's bounds, read once from the environment: every limit a public vitviz keeps, in one place.

| variable | default | what it bounds |
|---|---|---|
| VITVIZ_QUEUE_SIZE | 32 | jobs waiting in Gradio's queue, all clients together |
| VITVIZ_CLIENT_JOBS | 2 | jobs one session may have waiting, besides its first |
| VITVIZ_ADDRESS_JOBS | 8 | jobs one network address may have waiting or running (and twice as many waits for an early explorer) |
| VITVIZ_CONCURRENCY | 1 on CPU, 2 on GPU | model jobs running at once, every kind of request together; clients take turns for them by the time they have had (`vitviz.server.guards.work`) |
| VITVIZ_WORK_MB | 6144 | memory all running model jobs may take together (one job at most this) |
| VITVIZ_REQUEST_SECONDS | 300 | one model job's time (estimated before, enforced while it runs) |
| VITVIZ_MAX_TOKENS | the largest menu model's (ViT-H/14 at 518 px: 1,370) | tokens per image |
| VITVIZ_MAX_PARAMS | 7e8 | parameters of a model, every tower (an image–text model's text tower too), before it loads where its name says, and once loaded |
| VITVIZ_OPEN_MODELS | 1 | 0: only the menu's models, no timm:/hf: names from the page |
| VITVIZ_MAX_MODELS | 3 | models kept loaded (and 3 GiB of parameters) |
| VITVIZ_STATE_MB, VITVIZ_STATE_IDLE | 3072, 900 | what sessions hold: Gradio's sessions and the analyses kept for them; how long an idle analysis stays |
| VITVIZ_SESSIONS | as many as fit in a quarter of VITVIZ_STATE_MB (434 at 1.8 MB each) | Gradio sessions kept, the least recently used dropped first; the analyses get the rest of VITVIZ_STATE_MB |
| VITVIZ_BODY_KB | 1024 | a request body other than an upload |
| VITVIZ_UPLOAD_MB_PER_MIN | 100 | what one address may upload in a minute |
| VITVIZ_FILES_MB | 1024 | uploads and Gradio's copies of pictures on disk |
| VITVIZ_EXPLORER_MB | 2048 | the explorer's files for browsers on disk |
| VITVIZ_DOWNLOADS_MB | 1024 | .npz exports on disk |
| VITVIZ_HUB_MB | 4096 | hub models named in the page, in the Hugging Face cache |
| VITVIZ_HEAP_KEEP_MB | 256 | resident memory let grow past the last hand-back of freed heap to the system while requests come, for the next forward to reuse (0: hand back before and after each analysis) |
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from vitviz.server.guards.memory import KEEP_BYTES
from vitviz.server.guards.sessions import SESSION_PRICE

__all__ = ["Settings", "SettingsError"]


class SettingsError(ValueError):
    """An environment variable that is not a number vitviz can use."""


def _number(name: str, default: float, *, minimum: float = 0) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value) or value < minimum:
        raise SettingsError(f"{name}={raw!r} must be a number of at least {minimum:g}")
    return value


@dataclass(frozen=True)
class Settings:
    """The bounds. `state_bytes` is the analyses' share of VITVIZ_STATE_MB: what is left beside
    `sessions` sessions of `session_bytes` each (`vitviz.server.guards.sessions.SESSION_PRICE`)."""

    queue_size: int
    client_jobs: int
    address_jobs: int
    concurrency: int
    work_bytes: int
    request_seconds: float
    max_tokens: int
    max_params: int
    open_models: bool
    max_models: int
    state_bytes: int
    state_idle: float
    sessions: int
    session_bytes: int
    body_bytes: int
    upload_bytes_per_minute: int
    files_bytes: int
    explorer_bytes: int
    downloads_bytes: int
    hub_bytes: int
    heap_keep_bytes: int

    @property
    def dispatched(self) -> int:
        """Events of the model group Gradio hands to threads at once: one address's share and the
        lanes, so that another client's request reaches the work's turns (`ModelWork`) while one
        address holds all it may; within the queue's size."""
        return min(self.queue_size, self.address_jobs + self.concurrency)

    @classmethod
    def from_env(cls, *, gpu: bool, menu_tokens: int, session_bytes: int = SESSION_PRICE) -> "Settings":
        mb = 2**20
        state = int(_number("VITVIZ_STATE_MB", 3072) * mb)
        sessions = int(_number("VITVIZ_SESSIONS", max(1, state // 4 // session_bytes), minimum=1))
        if sessions * session_bytes > state and os.environ.get("VITVIZ_SESSIONS", "").strip():
            raise SettingsError(f"VITVIZ_SESSIONS={sessions} sessions of {session_bytes / mb:.1f} MB each take more than "
                                f"VITVIZ_STATE_MB={state // mb}: fewer sessions, or more memory for them")
        return cls(
            queue_size=int(_number("VITVIZ_QUEUE_SIZE", 32, minimum=1)),
            client_jobs=int(_number("VITVIZ_CLIENT_JOBS", 2, minimum=1)),
            address_jobs=int(_number("VITVIZ_ADDRESS_JOBS", 8, minimum=1)),
            concurrency=int(_number("VITVIZ_CONCURRENCY", 2 if gpu else 1, minimum=1)),
            work_bytes=int(_number("VITVIZ_WORK_MB", 6144, minimum=64) * mb),
            request_seconds=_number("VITVIZ_REQUEST_SECONDS", 300, minimum=1),
            max_tokens=int(_number("VITVIZ_MAX_TOKENS", menu_tokens, minimum=2)),
            max_params=int(_number("VITVIZ_MAX_PARAMS", 7e8, minimum=1)),
            open_models=os.environ.get("VITVIZ_OPEN_MODELS", "1").strip().lower() not in ("0", "false", "no", "off"),
            max_models=int(_number("VITVIZ_MAX_MODELS", 3, minimum=1)),
            state_bytes=max(0, state - sessions * session_bytes),
            state_idle=_number("VITVIZ_STATE_IDLE", 900, minimum=1),
            sessions=sessions,
            session_bytes=session_bytes,
            body_bytes=int(_number("VITVIZ_BODY_KB", 1024, minimum=16) * 1024),
            upload_bytes_per_minute=int(_number("VITVIZ_UPLOAD_MB_PER_MIN", 100, minimum=1) * mb),
            files_bytes=int(_number("VITVIZ_FILES_MB", 1024, minimum=64) * mb),
            explorer_bytes=int(_number("VITVIZ_EXPLORER_MB", 2048, minimum=16) * mb),
            downloads_bytes=int(_number("VITVIZ_DOWNLOADS_MB", 1024, minimum=16) * mb),
            hub_bytes=int(_number("VITVIZ_HUB_MB", 4096, minimum=0) * mb),
            heap_keep_bytes=int(_number("VITVIZ_HEAP_KEEP_MB", KEEP_BYTES / mb, minimum=0) * mb),
        )
