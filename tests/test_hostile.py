"""What an outside check and an attacker found, closed: unknown events answered 4xx, error text plain
for API callers and shown as typed in the page, file names cut by bytes, old download folders swept,
the parameter bound over the whole model, open_clip offline without a network call."""

import json
import os
import shutil
import socket
import time
import uuid

import httpx
import pytest
import torch

from conftest import fn_index, upload
import vitviz

pytestmark = pytest.mark.slow


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


# ------------------------------------------------------------------------------------------------
# 2. error text: plain for API callers, escaped for the page


def test_api_callers_read_error_text_as_it_was_written(server, good):
    from gradio_client import Client, handle_file
    from gradio_client.exceptions import AppError

    client = Client(server, verbose=False)
    with pytest.raises(AppError) as caught:
        client.predict(handle_file(str(good)), "timm:<name>", api_name="/analyze")
    assert "timm:<name>" in str(caught.value) and "&lt;" not in str(caught.value), caught.value
    client.close()
    image = upload(server, good)
    ok, error = run(server, "analyze", [image, "timm:<name>"])
    assert not ok and "timm:<name>" in error and "&lt;" not in error, error
    # a warning (a toast) too: plain for a raw client
    log = [m for m in messages(server, "on_other_model", ["open_clip:<b>bold</b>", []]) if m.get("msg") == "log"]
    assert log and "<b>bold</b>" in log[0]["log"], log


def test_the_page_gets_error_text_escaped(server, good):
    """The page (its requests carry Gradio's `x-gradio-user: app`) reads error and warning text as
    HTML: for it, and only for it, the text comes escaped."""
    page = {"x-gradio-user": "app"}
    seen = messages(server, "analyze", [upload(server, good), "timm:<name>"], headers=page)
    error = seen[-1]["output"]["error"]
    assert "timm:&lt;name&gt;" in error and "<name>" not in error, error
    seen = messages(server, "on_other_model", ["open_clip:<b>bold</b>", []], headers=page)
    log = [m["log"] for m in seen if m.get("msg") == "log"]
    assert log and "&lt;b&gt;bold&lt;/b&gt;" in log[0] and "<b>" not in log[0], log
    notice = seen[-1]["output"]["data"][1]  # the notice is HTML for everyone: escaped there
    assert "&lt;b&gt;bold" in json.dumps(notice) and "<b>" not in json.dumps(notice)


CHROMIUM = os.environ.get("VITVIZ_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed")
def test_the_page_shows_error_text_as_typed(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.set_default_timeout(60_000)
            page.goto(server)
            page.locator("#vv-other textarea, #vv-other input").first.fill("open_clip:<b>bold</b>")
            page.locator("#vv-other-use").click()
            toast = page.locator("[data-testid='toast-body']").first
            toast.wait_for()
            page.wait_for_function("document.querySelector('#vv-notice').innerText.includes('bold')")
            for shown in (toast, page.locator("#vv-notice")):
                assert "<b>bold</b>" in shown.inner_text() and shown.locator("b").count() == 0
        finally:
            browser.close()


# ------------------------------------------------------------------------------------------------
# 3. file names cut by bytes


def test_file_names_from_user_text_are_cut_by_bytes():
    from vitviz.server.guards.gradio_io import file_stem

    for text in ["星" * 200, "a" * 300, "é" * 200, "🙂" * 100, "x/../y\0z" * 40]:
        stem = file_stem(text)
        assert len(stem.encode()) <= 200 and stem.encode().decode() == stem and "/" not in stem and "\0" not in stem
    assert file_stem("星" * 200).startswith("星" * 66) and file_stem("vit_b_16-find") == "vit_b_16-find"
    assert file_stem("") == "image"


def test_find_with_eighty_cjk_characters(server, good):
    from vitviz.server.tabs.find import MAX_PHRASE_CHARS, PHRASE_METHODS

    session = uuid.uuid4().hex
    ok, out = run(server, "session_analyze", [upload(server, good), "shapes_clip", "mean", 0.0, None], session=session)
    assert ok, out
    phrase = "星" * MAX_PHRASE_CHARS
    ok, out = run(server, "session_find", [None, phrase, PHRASE_METHODS[0]], session=session)
    assert ok, out
    picture = out[1]["value"] if "value" in out[1] else out[1]
    name = os.path.basename(picture["path"])
    assert len(name.encode()) <= 255 and "星" in name, name


# ------------------------------------------------------------------------------------------------
# 4. download folders of earlier processes


def test_download_folders_left_by_earlier_processes_are_swept_at_start(tmp_path):
    from vitviz.server.guards.export import Downloads

    live = Downloads(root=tmp_path)  # another server, still running
    (live.folder / "vitviz-vit_b_16-" f"{'0' * 32}.npz").write_bytes(b"live")
    old = tmp_path / "vitviz-downloads-abcd1234"  # left by a process that has ended
    old.mkdir()
    (old / ".owner").write_text("")
    (old / f"vitviz-vit_b_16-{'1' * 32}.npz").write_bytes(b"\0" * 1000)
    legacy = tmp_path / "vitviz-k2j4h5g6"  # an earlier version's folder: exports only, long since served
    legacy.mkdir()
    (legacy / f"vitviz-shapes_p16-{'2' * 32}.npz").write_bytes(b"\0" * 1000)
    long_ago = time.time() - 3600
    os.utime(legacy / f"vitviz-shapes_p16-{'2' * 32}.npz", (long_ago, long_ago))
    # not vitviz's downloads: a folder of another name, one that holds something else, one just written
    others = [tmp_path / "vitviz-notes", tmp_path / "vitviz-z9y8x7w6", tmp_path / "vitviz-q1w2e3r4", tmp_path / "other"]
    for folder in others:
        folder.mkdir()
    (others[0] / f"vitviz-vit_b_16-{'3' * 32}.npz").write_bytes(b"x")
    (others[1] / "notes.txt").write_text("mine")
    (others[1] / f"vitviz-vit_b_16-{'4' * 32}.npz").write_bytes(b"x")
    os.utime(others[1] / f"vitviz-vit_b_16-{'4' * 32}.npz", (long_ago, long_ago))
    (others[2] / f"vitviz-vit_b_16-{'5' * 32}.npz").write_bytes(b"x")  # recent: maybe a server of that version, running
    (others[3] / f"vitviz-vit_b_16-{'6' * 32}.npz").write_bytes(b"x")
    stale_file_outside = tmp_path / "vitviz-downloads-abcd1234.txt"
    stale_file_outside.write_text("a file, not a folder")

    mine = Downloads(root=tmp_path)
    assert not old.exists() and not legacy.exists()
    assert live.folder.is_dir() and (live.folder / f"vitviz-vit_b_16-{'0' * 32}.npz").exists()
    assert all(f.is_dir() and any(f.iterdir()) for f in others) and stale_file_outside.exists()
    assert mine.folder.is_dir() and mine.folder != live.folder


# ------------------------------------------------------------------------------------------------
# 5. the parameter bound over the whole model

VISION = dict(layers=2, width=32, head_width=16, patch_size=8, image_size=32, mlp_ratio=2.0)
TEXT = dict(context_length=16, vocab_size=100, width=32, heads=2, layers=2)


@pytest.fixture
def tiny_open_clip(tmp_path, monkeypatch):
    """A tiny open_clip architecture and tag, registered with open_clip (its weights not fetched):
    returns (name, parameters of its image tower, of the whole model)."""
    open_clip = pytest.importorskip("open_clip")
    from open_clip import factory, pretrained

    def register(arch: str, text: dict = TEXT, repo: str = "vitviz-test/tiny-open-clip"):
        (tmp_path / "cfg").mkdir(exist_ok=True)
        (tmp_path / "cfg" / f"{arch}.json").write_text(json.dumps(dict(embed_dim=16, quick_gelu=True, vision_cfg=VISION, text_cfg=text)))
        open_clip.add_model_config(tmp_path / "cfg")
        monkeypatch.setitem(pretrained._PRETRAINED, arch, {"tiny": dict(hf_hub=f"{repo}/", quick_gelu=True)})
        return f"open_clip:{arch}/tiny"

    try:
        name = register("vitviz-tiny-params")
        model = open_clip.create_model("vitviz-tiny-params", pretrained=None, force_quick_gelu=True)
        yield name, sum(p.numel() for p in model.visual.parameters()), sum(p.numel() for p in model.parameters()), register
    finally:
        for arch in [a for a in factory._MODEL_CONFIGS if a.startswith("vitviz-tiny")]:
            factory._MODEL_CONFIGS.pop(arch, None)


def test_the_parameter_bound_counts_every_tower_before_loading(tiny_open_clip):
    from vitviz.server.guards import inputs

    name, image, whole, _ = tiny_open_clip
    assert image < whole
    with pytest.raises(inputs.InputError, match="VITVIZ_MAX_PARAMS") as refused:
        inputs.variant(name, max_params=(image + whole) // 2)
    assert f"{whole:,}" in str(refused.value)
    assert inputs.variant(name, max_params=whole) == name


def test_the_parameter_bound_holds_for_a_loaded_model_its_name_could_not_count(monkeypatch, good):
    """shapes_clip's spec counts its image tower: the loaded model (with its text tower) is counted
    again, and the server refuses it as it refuses any variant, saying why."""
    from vitviz.server.app import SERVER
    import gradio as gr

    from vitviz.server import runtime
    from vitviz.server.models import ModelCache, TooLarge

    model = vitviz.load_model("shapes_clip", device="cpu")
    whole = sum(p.numel() for p in model.parameters())
    assert model.spec.config.num_params < whole
    cache = ModelCache(max_models=2, max_params=whole - 1, device="cpu")
    with pytest.raises(TooLarge, match="VITVIZ_MAX_PARAMS"):
        cache.get("shapes_clip")
    assert cache.loaded() == []
    monkeypatch.setattr(SERVER, "cache", cache)
    with pytest.raises(gr.Error, match=f"{whole:,} parameters.*VITVIZ_MAX_PARAMS") as refused:
        SERVER.run(str(good), "shapes_clip")
    assert refused.value.cause == "variant"
    assert ModelCache(max_models=2, max_params=whole, device="cpu").get("shapes_clip")[0] is not None


# ------------------------------------------------------------------------------------------------
# 6. open_clip offline: no network call


class NetworkReached(BaseException):
    """Raised by any attempt to reach the network (not an Exception: no retry loop swallows it)."""


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """VITVIZ_OFFLINE=1, an empty Hugging Face cache, and every network call recorded and refused."""
    from huggingface_hub import constants

    calls = []

    def reached(*args, **kwargs):
        calls.append(args[:2])
        raise NetworkReached(args[:2])

    monkeypatch.setattr(socket.socket, "connect", reached)
    monkeypatch.setattr(socket, "create_connection", reached)
    monkeypatch.setattr(socket, "getaddrinfo", reached)
    root = tmp_path / "hf" / "hub"
    root.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setenv("VITVIZ_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return root, calls


def test_open_clip_names_that_need_the_network_are_refused_offline_without_a_call(offline, tiny_open_clip):
    from conftest import write_hub_cache
    from vitviz.sources import WeightsUnavailableError

    root, calls = offline
    pytest.importorskip("open_clip")
    # a Hugging Face text tower: its config would come from the hub; refused from open_clip's own config
    with pytest.raises((ValueError, NotImplementedError), match="Hugging Face text tower"):
        vitviz.get_spec("open_clip:xlm-roberta-base-ViT-B-32/laion5b_s13b_b90k")
    # weights not in the cache
    with pytest.raises(WeightsUnavailableError, match="VITVIZ_OFFLINE"):
        vitviz.load_model("open_clip:ViT-B-32/openai", device="cpu")
    # weights in the cache, but a tokenizer from the hub that is not
    _, _, _, register = tiny_open_clip
    name = register("vitviz-tiny-hftok", text={**TEXT, "hf_tokenizer_name": "vitviz-test/no-such-tokenizer"}, repo="vitviz-test/tiny-hftok")
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    snap = write_hub_cache(root, "vitviz-test/tiny-hftok", {})
    torch.save(CLIP(embed_dim=16, vision_cfg=CLIPVisionCfg(**VISION), text_cfg=CLIPTextCfg(**TEXT), quick_gelu=True).state_dict(),
               snap / "open_clip_pytorch_model.bin")
    with pytest.raises(WeightsUnavailableError, match="VITVIZ_OFFLINE.*vitviz-test/no-such-tokenizer|vitviz-test/no-such-tokenizer.*VITVIZ_OFFLINE"):
        vitviz.load_model(name, device="cpu")
    assert calls == []


def test_an_open_clip_model_with_a_cached_hub_tokenizer_loads_offline_without_a_call(offline, tiny_open_clip, monkeypatch, tmp_path):
    """Reading even a cached file, huggingface_hub first asks huggingface.co for its registry of
    agents (once a process, kept a day on disk): offline, it is kept from that too."""
    from huggingface_hub import constants
    from huggingface_hub.utils import _detect_agent
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg
    from tokenizers import Tokenizer, models, pre_tokenizers

    from conftest import write_hub_cache

    root, calls = offline
    monkeypatch.setattr(_detect_agent, "_registry", None)  # as in a fresh process, with nothing on disk
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agents.json"))
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1, "a": 2, "cat": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    snap = write_hub_cache(root, "vitviz-test/tiny-tokenizer", {
        "config.json": json.dumps({"model_type": "bert"}).encode(),
        "tokenizer_config.json": json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[PAD]", "unk_token": "[UNK]"}).encode()})
    words.save(str(snap / "tokenizer.json"))
    _, _, _, register = tiny_open_clip
    name = register("vitviz-tiny-cachedtok", text={**TEXT, "hf_tokenizer_name": "vitviz-test/tiny-tokenizer"}, repo="vitviz-test/tiny-cachedtok")
    snap = write_hub_cache(root, "vitviz-test/tiny-cachedtok", {})
    torch.save(CLIP(embed_dim=16, vision_cfg=CLIPVisionCfg(**VISION), text_cfg=CLIPTextCfg(**TEXT), quick_gelu=True).state_dict(),
               snap / "open_clip_pytorch_model.bin")
    offline_before = constants.HF_HUB_OFFLINE
    ours = vitviz.load_model(name, device="cpu")
    ids, _ = ours.tokenize(["a cat"])
    assert ids[0, :2].tolist() == [2, 3]
    assert calls == [] and constants.HF_HUB_OFFLINE == offline_before  # the hub's switch back as it was


def test_a_model_that_cannot_be_fetched_is_one_sentence_and_the_advice_goes_to_the_log(monkeypatch, caplog):
    """Weights that are not here and cannot be downloaded: the caller reads one sentence naming the
    model (quoted, cut at 60 characters); the library's advice (what to run, which cache) is logged."""
    import logging

    from vitviz.server.guards import inputs
    from vitviz.sources import WeightsUnavailableError

    def unavailable(name):
        raise WeightsUnavailableError(f"Weights for {name} are not in the Hugging Face cache (We couldn't connect to "
                                      "'https://huggingface.co' ...): on a machine with network run `hf download`")

    monkeypatch.setattr(inputs, "get_spec", unavailable)
    with caplog.at_level(logging.INFO, logger="vitviz.server"), pytest.raises(inputs.InputError) as refused:
        inputs.variant("hf:foo/bar")
    assert str(refused.value) == "'hf:foo/bar' is not on this server and cannot be downloaded now: choose a model from the menu."
    assert "hf download" in caplog.text
    with pytest.raises(inputs.InputError, match=r"^'hf:xxxxxxxx") as long:
        inputs.variant("hf:" + "x" * 150)
    assert "..." in str(long.value) and len(str(long.value)) < 160
