"""What an outside check and an attacker found, closed: unknown events answered 4xx, error text plain
for API callers and shown as typed in the page, file names cut by bytes, old download folders swept,
the parameter bound over the whole model, open_clip offline without a network call."""

import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

import vitviz

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def app():
    from vitviz.server import app as app_module

    return app_module


@pytest.fixture(scope="module")
def server(app):
    app.demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, **app.LAUNCH_KWARGS)
    try:
        yield app.demo.local_url.rstrip("/")
    finally:
        app.demo.close()


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "star.png"
    Image.fromarray(vitviz.shapes.render(3, seed=5, index=0)[0]).save(path)
    return path


def upload(base: str, path) -> dict:
    with open(path, "rb") as f:
        r = httpx.post(f"{base}/gradio_api/upload", files=[("files", (os.path.basename(path), f.read()))], timeout=60)
    r.raise_for_status()
    return {"path": r.json()[0], "meta": {"_type": "gradio.FileData"}}


def fn_index(base: str, name: str) -> int:
    config = httpx.get(f"{base}/config", timeout=30).json()
    return next(d["id"] for d in config["dependencies"] if d.get("api_name") == name)


def messages(base: str, name: str, data: list, *, headers: dict | None = None, session: str | None = None) -> list[dict]:
    """One event through `POST /gradio_api/queue/join`, as the page or a raw client sends it: every
    message of its stream up to its completion (logs, then `process_completed`)."""
    session = session or uuid.uuid4().hex
    body = {"data": data, "fn_index": fn_index(base, name), "session_hash": session, "event_data": None, "trigger_id": None}
    r = httpx.post(f"{base}/gradio_api/queue/join", json=body, headers=headers or {}, timeout=30)
    assert r.status_code == 200, r.text
    seen = []
    with httpx.stream("GET", f"{base}/gradio_api/queue/data", params={"session_hash": session}, timeout=300) as stream:
        for line in stream.iter_lines():
            if line.startswith("data:"):
                seen.append(json.loads(line[5:]))
                if seen[-1].get("msg") == "process_completed":
                    return seen
    raise AssertionError(f"no completion in {seen}")


def run(base: str, name: str, data: list, *, session: str | None = None) -> tuple[bool, object]:
    done = messages(base, name, data, session=session)[-1]
    out = done.get("output", {})
    return bool(done.get("success")), out.get("data") if done.get("success") else out.get("error")


def _alive(base: str, good) -> None:
    ok, out = run(base, "analyze", [upload(base, good), "shapes_p16"])
    assert ok and out[0]["label"] == "star", out


# ------------------------------------------------------------------------------------------------
# 1. unknown events


def test_unknown_or_malformed_events_are_answered_4xx_with_a_reason(server, good):
    session = uuid.uuid4().hex
    for index in [99_999, -1, 10**30, "abc", 1.5, [1]]:
        r = httpx.post(f"{server}/gradio_api/queue/join", json={"data": [], "fn_index": index, "session_hash": session}, timeout=30)
        assert 400 <= r.status_code < 500 and "Internal Server Error" not in r.text and r.text.strip(), (index, r.status_code, r.text)
    r = httpx.post(f"{server}/gradio_api/queue/join", json={"data": [], "fn_index": 99_999, "session_hash": session}, timeout=30)
    assert "99999" in r.json()["detail"]
    for path in ["call/nope", "call/nope/", "call/v2/nope"]:
        r = httpx.post(f"{server}/gradio_api/{path}", json={"data": []}, timeout=30)
        assert r.status_code == 404 and "nope" in r.text, (path, r.status_code, r.text)
    for path, params in [(f"call/analyze/{uuid.uuid4().hex}", None), ("queue/data", {"session_hash": uuid.uuid4().hex})]:
        r = httpx.get(f"{server}/gradio_api/{path}", params=params, timeout=30)
        assert r.status_code == 404 and r.text.strip(), (path, r.status_code, r.text)
    _alive(server, good)
