"""The Video tab: a generated GIF of a shape moving right, run through shapes_video: the prediction is the
library's on the same frames, the class token's frame strip holds every frame, the across-frames
picture is redrawn from the kept run; junk from a client (files that are no clip, paths that were
not uploaded, frames, rows and layers out of range, a model off the menu) is refused in one sentence,
through the handlers and through raw HTTP; the "video" price holds what a run does."""

import io
import shutil
import uuid
from types import SimpleNamespace

import gradio as gr
import numpy as np
import pytest
import torch
from PIL import Image


@pytest.fixture(scope="module")
def app():
    global video
    from vitviz.server.tabs import video  # registers the tab (before the page is built, if it is not yet)
    from vitviz.server import app as app_module

    if video.TAB.page is None:
        pytest.skip("the Video tab is not on the page (register it in vitviz/server/tabs/__init__.py)")
    return app_module


def _rightward() -> np.ndarray:
    """A generated clip of shapes_video's own kind whose shape moves right: uint8 [T, S, S, 3]."""
    from vitviz.video.shapes import MOTIONS, generate_clips

    for index in range(200):
        frames, labels, _ = generate_clips(1, 9001, index)
        if MOTIONS[int(labels[0])] == "right":
            return frames[0]
    raise AssertionError("no rightward clip in 200")


@pytest.fixture(scope="module")
def gif(tmp_path_factory):
    """The rightward clip as an animated GIF, in a folder of pytest's."""
    frames = _rightward()
    path = tmp_path_factory.mktemp("video") / "right.gif"
    pictures = [Image.fromarray(f) for f in frames]
    pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=100, loop=0)
    return path


@pytest.fixture()
def uploaded(app):
    """Copies a file into Gradio's upload folder (as an upload lands there): its path; removed afterwards."""
    from vitviz.server.guards.gradio_io import upload_folder

    folder = upload_folder() / f"vv-test-video-{uuid.uuid4().hex}"
    folder.mkdir(parents=True)

    def put(source=None, *, name="clip.gif", data: bytes | None = None) -> str:
        target = folder / name
        if data is not None:
            target.write_bytes(data)
        else:
            shutil.copy(source, target)
        return str(target)

    yield put
    shutil.rmtree(folder, ignore_errors=True)


def _one_sentence(message: str) -> None:
    assert message.strip() and "Traceback" not in message and "\n" not in message.strip() and len(message) < 500, message


@pytest.fixture(scope="module")
def ran(app, gif, tmp_path_factory):
    from vitviz.server.guards.gradio_io import upload_folder

    folder = upload_folder() / f"vv-test-video-{uuid.uuid4().hex}"
    folder.mkdir(parents=True)
    path = folder / "right.gif"
    shutil.copy(gif, path)
    try:
        out = video.TAB.on_video_run(str(path), "shapes_video", 1, 4, 3, 3, None)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def test_the_prediction_is_the_librarys_and_the_strip_holds_every_frame(ran, gif):
    from vitviz.clips import clip_tensor, load_video
    from vitviz.server.app import SERVER
    from vitviz.video.analysis import frame_maps, space_time_rollout
    from vitviz.video.shapes import load_shapes_video

    tab = video.TAB
    model = load_shapes_video()
    clip = load_video(str(gif), frames=model.spec.frames, sampling=model.spec.sampling)
    videos = clip_tensor(clip, model.spec.preprocessing)
    with torch.no_grad():
        probs = model(videos[None]).softmax(-1)[0]
    want = {model.spec.categories[i]: float(probs[i]) for i in probs.topk(5).indices.tolist()}
    got = ran[tab.prediction]
    assert list(got) == list(want) and list(got)[0] == "right"
    for name, p in want.items():
        assert got[name] == pytest.approx(p, abs=1e-5)
    kept = SERVER.store.get(ran[tab.held].key)
    torch.testing.assert_close(kept.maps, frame_maps(space_time_rollout(model.attention(videos)), model.spec.grid).float())
    strip = ran[tab.strip]["value"]
    frames = model.spec.frames
    side = model.spec.image_size * video.SCALE
    assert strip.width >= frames * side + (frames - 1) * 6 and strip.height >= side
    assert ran[tab.frame]["maximum"] == frames and ran[tab.layer]["maximum"] == model.spec.depth
    assert ran[tab.row]["maximum"] == model.spec.grid[1] and ran[tab.col]["maximum"] == model.spec.grid[2]
    gif_out = ran[tab.gif]["value"]
    shown = Image.open(gif_out)
    assert gif_out.endswith(".gif") and shown.n_frames == frames and shown.size == (side, side)
    assert ran[tab.across]["value"].width == strip.width


def test_the_across_frames_picture_is_redrawn_from_the_kept_run(ran):
    from vitviz.server.app import SERVER
    from vitviz.video.analysis import attention_across_frames

    tab = video.TAB
    held = ran[tab.held]
    first = np.asarray(ran[tab.across]["value"])
    other = tab.on_video_view(6, 4, 3, 3, held)
    assert not np.array_equal(np.asarray(other[tab.across]["value"]), first)
    assert "Frame 6 (tubelet 3), row 3, column 3, layer 4" in other[tab.note]
    layer = tab.on_video_view(6, 1, 3, 3, held)
    assert not np.array_equal(np.asarray(layer[tab.across]["value"]), np.asarray(other[tab.across]["value"]))
    kept = SERVER.store.get(held.key)
    assert attention_across_frames(kept.attention, 0, 2, 2, 2).shape == (1, *kept.attention.grid)  # kept with its heads averaged
    # a click on the shown frame (drawn at SCALE px a pixel): the patch under it
    k = video.SCALE * kept.patch_size
    picked = tab.on_video_pick(6, 4, held, SimpleNamespace(index=[4.5 * k, 1.5 * k]))
    assert picked[tab.row] == 2 and picked[tab.col] == 5 and "row 2, column 5" in picked[tab.note]
    assert tab.on_video_pick(6, 4, held, SimpleNamespace(index=[10_000, 5])) == gr.skip()


@pytest.mark.parametrize("frame, layer, row, col, match", [
    (0, 1, 1, 1, "frame must be a whole number from 1 to 8"),
    (99, 1, 1, 1, "frame must be a whole number from 1 to 8"),
    (1, 99, 1, 1, "layer must be a whole number from 1 to 4"),
    (1, 0, 1, 1, "layer must be a whole number from 1 to 4"),
    (1, 1, 7, 1, "row must be a whole number from 1 to 6"),
    (1, 1, 1, -1, "column must be a whole number from 1 to 6"),
    (2.5, 1, 1, 1, "whole number"),
    ("three", 1, 1, 1, "whole number"),
    (float("nan"), 1, 1, 1, "whole number"),
    (1, float("inf"), 1, 1, "whole number"),
])
def test_a_query_out_of_range_is_refused(ran, frame, layer, row, col, match):
    with pytest.raises(gr.Error, match=match) as caught:
        video.TAB.on_video_view(frame, layer, row, col, ran[video.TAB.held])
    _one_sentence(caught.value.message)


def test_views_and_clicks_without_a_run_or_with_junk_are_refused(ran):
    tab = video.TAB
    for held in (None, "key", video.VideoRef("no-such-key", "x")):
        with pytest.raises(gr.Error, match="Run a clip first"):
            tab.on_video_view(1, 1, 1, 1, held)
    for index in (None, [1], ["a", 2], [float("nan"), 1]):
        with pytest.raises(gr.Error, match="pixel"):
            tab.on_video_pick(1, 1, ran[tab.held], SimpleNamespace(index=index))


def test_files_that_are_no_clip_are_refused_in_one_sentence(app, uploaded, tmp_path):
    import zipfile

    tab = video.TAB
    archive = tmp_path / "a.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("clip.gif", b"GIF89a" + b"\0" * 64)
    cases = [(uploaded(archive, name="renamed.gif"), "not a video"), (uploaded(name="empty.gif", data=b""), None),
             (uploaded(name="truncated.gif", data=b"GIF89a\x10\x00\x10\x00"), None)]
    for path, match in cases:
        with pytest.raises(gr.Error, match=match) as caught:
            tab.on_video_run(path, "shapes_video", 1, 1, 1, 1, None)
        _one_sentence(caught.value.message)
    outside = tmp_path / "outside.gif"
    outside.write_bytes(b"GIF89a")
    for path in (str(outside), "/etc/passwd", {"path": "/etc/passwd"}, 7):
        with pytest.raises(gr.Error) as caught:
            tab.on_video_run(path, "shapes_video", 1, 1, 1, 1, None)
        assert caught.value.message == video.CLIP_REFUSED
    with pytest.raises(gr.Error, match="Upload a clip first"):
        tab.on_video_run(None, "shapes_video", 1, 1, 1, 1, None)
    for name in ("shapes_p16", "", None, ["shapes_video"], "../shapes_video"):
        with pytest.raises(gr.Error, match="Choose a video model from the menu"):
            tab.on_video_run(str(outside), name, 1, 1, 1, 1, None)


def test_the_upload_component_takes_uploads_only(app, uploaded):
    from gradio.data_classes import FileData

    clip = video.TAB.clip
    path = uploaded(name="x.gif", data=b"GIF89a")
    assert clip.preprocess(FileData(path=path)) == path and clip.preprocess(None) is None
    for payload in (FileData(path="/etc/passwd"), FileData(path=path + "/../../../../etc/passwd"),
                    FileData(path="", url="data:image/gif;base64,R0lGODlh")):
        with pytest.raises(gr.Error) as caught:
            clip.preprocess(payload)
        assert caught.value.message == video.CLIP_REFUSED


def test_the_price_holds_what_a_run_does(app):
    """Within 1.5x of the multiply-adds torch counts (FlopCounterMode) for the tab's run."""
    from torch.utils.flop_counter import FlopCounterMode

    from vitviz.cost import price
    from vitviz.server.tabs import video as tab_module
    from vitviz.video.shapes import to_videos

    frames = _rightward()
    videos = to_videos(frames)[0]
    counter = FlopCounterMode(display=False)
    with counter:
        _, attention, _ = tab_module.run_on_device(app.SERVER.name, "shapes_video", videos)
    counted = counter.get_total_flops()
    cost = price(tab_module.spec_of("shapes_video"), "video")
    assert counted / 1.5 <= cost.flops <= counted * 1.5, (cost.flops, counted)
    assert cost.kind == "video" and cost.kept_bytes >= attention.joint.numel() * 4
    assert cost.bytes >= 2 * attention.joint.numel() * 4


@pytest.mark.slow
def test_the_private_event_refuses_hostile_data_and_the_server_goes_on(app, gif, tmp_path):
    """Over raw HTTP: a FileData naming /etc/passwd (never uploaded), a zip renamed .gif and an empty file,
    a frame of 99 and a model off the menu: each an error with its reason; then the GIF runs."""
    from conftest import run, serving, upload

    archive = tmp_path / "renamed.gif"
    import zipfile

    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("x.txt", "hello")
    empty = tmp_path / "empty.gif"
    empty.write_bytes(b"")
    import httpx

    with serving(app.demo, **app.LAUNCH_KWARGS) as server:
        passwd = {"path": "/etc/passwd", "meta": {"_type": "gradio.FileData"}}
        cases = [([passwd, "shapes_video"], "")]
        for junk in (archive, empty):  # the server's upload guard may refuse them already (415: not a picture's bytes)
            try:
                cases.append(([upload(server, junk), "shapes_video"], ""))
            except httpx.HTTPStatusError as exc:
                assert exc.response.status_code == 415 and "Only images" in exc.response.text
        cases.append(([upload(server, gif), "<script>"], "shapes_video"))  # Gradio's menu check, or the tab's
        for data, why in cases:
            ok, error = run(server, "on_video_run", [*data, 1, 1, 1, 1, None, "rollout"])
            assert not ok and error and why in error and "Traceback" not in error and "root:" not in error, (data, error)
        for shown in ("saliency", None, ["relevance"]):  # the map: one of the radio's choices only
            ok, error = run(server, "on_video_run", [upload(server, gif), "shapes_video", 1, 1, 1, 1, None, shown])
            assert not ok and error and "Traceback" not in error and ("rollout" in error or "choices" in error), (shown, error)
        session = uuid.uuid4().hex
        ok, out = run(server, "on_video_run", [upload(server, gif), "shapes_video", 3, 4, 2, 2, None, "relevance"], session=session)
        assert ok, out
        for data in ([99, 1, 1, 1], [0, 1, 1, 1], [1, 99, 1, 1], [1, 1, 7, 1]):  # Gradio's slider bounds, or the tab's
            ok, error = run(server, "on_video_view", [*data, None], session=session)
            assert not ok and error and "Traceback" not in error and ("whole number" in error or "imum value" in error), (data, error)
        ok, out = run(server, "on_video_view", [8, 2, 3, 4, None], session=session)
        assert ok, out


def test_the_browsers_explorer_data_is_the_librarys_within_8_bits(ran):
    """The run's explorer value, decoded as video_explorer.js decodes it, is the library's head-averaged
    attention across frames of every layer and patch query, each weight within half an 8-bit step of its
    row's maximum; the frames are the model's, and the size is the one `vitviz.cost` prices."""
    from vitviz import cost
    from vitviz.server.app import SERVER
    from vitviz.server.pictures import video_explorer
    from vitviz.video.analysis import attention_across_frames

    tab = video.TAB
    value = ran[tab.live]
    kept = SERVER.store.get(ran[tab.held].key)
    assert value["mode"] == "browser" and ran[tab.on_server]["visible"] is False
    t, h, w = kept.attention.grid
    assert value["grid"] == [t, h, w] == [4, 6, 6] and value["depth"] == kept.attention.depth == 4 and value["frames"] == 8
    assert value["first"] == {"frame": 1, "layer": 4, "row": 3, "col": 3}  # the run's query, as the server drew it
    want = cost.video_explorer_bytes(depth=4, grid=(4, 6, 6), frames=8, image_size=96)
    assert value["bytes"] == want == 4 * 144 * (4 + 144) + 8 * (8 + 3 * 96 * 96) == 306_496
    assert len(value["data"]) + sum(len(p) for p in value["pictures"]) < 4 / 3 * want + 64  # base64 of those bytes
    frames = video_explorer.read_frames(value)
    assert np.array_equal(np.stack([np.asarray(f) for f in frames]), kept.frames)
    top, rows = video_explorer.read_data(value)
    worst = 0.0
    for layer in range(kept.attention.depth):
        for query in range(t * h * w):
            exact = attention_across_frames(kept.attention, layer, query // (h * w), query % (h * w) // w, query % w).mean(0).double()
            got = video_explorer.map_values(value, layer=layer, query=query)
            step = float(top[layer, query]) / 255
            assert float(top[layer, query]) == pytest.approx(float(exact.max()), rel=1e-6)
            err = float(np.abs(got - exact.numpy()).max())
            assert err <= step / 2 + 1e-7, (layer, query, err, step)
            worst = max(worst, err / step)
    assert worst > 0.4  # the bound is reached: the rows are quantised, not sent whole
    tiles = video_explorer.strip_tiles(value, layer=3, query=2 * 36 + 1 * 6 + 4)
    assert len(tiles) == 8 and tiles[0].size == (96, 96) and not np.array_equal(np.asarray(tiles[0]), np.asarray(frames[0]))


def test_a_clip_over_the_browsers_bound_is_explored_by_the_server(ran, gif, uploaded, monkeypatch):
    """Data over `VIDEO_BROWSER_BYTES`: a note instead of the data, and the server's explorer shown; the
    widget's value is no event's input (nothing a client sends reaches it)."""
    from vitviz import cost
    from vitviz.server.app import demo
    from vitviz.server.pictures import video_explorer
    from vitviz.server.app import SERVER

    kept = SERVER.store.get(ran[video.TAB.held].key)
    args = dict(model="shapes_video", tubelet=2, patch_size=16, scale=2)
    assert video_explorer.payload(kept.attention, kept.frames, budget=306_496, **args)["mode"] == "browser"
    small = video_explorer.payload(kept.attention, kept.frames, budget=306_495, **args)
    assert small["mode"] == "server" and "too large" in small["note"] and "data" not in small and "pictures" not in small
    with pytest.raises(ValueError, match="frames must be"):
        video_explorer.payload(kept.attention, kept.frames[:, :48], **args)
    monkeypatch.setattr(cost, "VIDEO_BROWSER_BYTES", 1000)
    out = video.TAB.on_video_run(uploaded(gif), "shapes_video", 2, 3, 4, 5, None)
    assert out[video.TAB.live]["mode"] == "server" and out[video.TAB.on_server]["visible"] is True
    assert "Frame 2 (tubelet 1), row 4, column 5, layer 3" in out[video.TAB.note]
    live = video.TAB.live._id
    assert all(live not in [c._id for c in fn.inputs] for fn in demo.fns.values())


def test_the_menus_hub_models_run_from_the_cache_and_say_so_when_they_cannot_be_had(app, gif, uploaded, no_network, monkeypatch):
    """The menu's Hugging Face models: without the network or a cached copy, one sentence; with a copy in
    the hub's cache (here a tiny random TimeSformer under the menu's name) the tab runs it, its classes
    the config's, the model kept in the server's model cache beside the image models."""
    transformers = pytest.importorskip("transformers")
    from conftest import write_hub_cache
    from vitviz.sources import load_model
    from vitviz.video.analysis import frame_maps, space_time_relevance, space_time_rollout
    from vitviz.clips import clip_tensor, load_video

    from vitviz.server.models import ModelCache

    monkeypatch.setattr(app.SERVER, "cache", ModelCache(max_models=2))  # the random model under the menu's name goes with the test
    tab = video.TAB
    name = "hf:facebook/timesformer-base-finetuned-k400"
    assert name in video.MODELS and "hf:MCG-NJU/videomae-base-finetuned-kinetics" in video.MODELS
    path = uploaded(gif)
    with pytest.raises(gr.Error) as caught:
        tab.on_video_run(path, name, 1, 1, 1, 1, None)
    assert caught.value.message == f"{name} is not on this server and cannot be downloaded now: choose shapes_video."
    torch.manual_seed(0)
    cfg = transformers.TimesformerConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                         image_size=32, patch_size=8, num_frames=4, num_labels=3, attn_implementation="eager")
    cfg.id2label = {0: "juggling", 1: "surfing", 2: "knitting"}
    cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    transformers.TimesformerForVideoClassification(cfg).save_pretrained(write_hub_cache(no_network, name[3:], {}))
    out = tab.on_video_run(path, name, 1, 2, 1, 1, None)
    assert set(out[tab.prediction]) == {"juggling", "surfing", "knitting"}
    assert name in app.SERVER.cache.loaded()
    model = load_model(name)
    clip = clip_tensor(load_video(gif, frames=4, sampling=model.spec.sampling), model.spec.preprocessing)
    attention = model.attention(clip)
    kept = app.SERVER.store.get(out[tab.held].key)
    torch.testing.assert_close(kept.maps, frame_maps(space_time_rollout(attention), attention.grid).float())
    probs = attention.logits.softmax(-1)
    for k, label in cfg.id2label.items():
        assert out[tab.prediction][label] == pytest.approx(float(probs[k]), abs=1e-5)
    app.SERVER.store.drop(out[tab.held].key)
    # its divided attention's relevance of the top class, the cls token's row
    out = tab.on_video_run(path, name, 1, 2, 1, 1, None, "relevance")
    kept = app.SERVER.store.get(out[tab.held].key)
    want = space_time_relevance(model, clip, int(probs.argmax()), query=0)[0]
    torch.testing.assert_close(kept.maps, frame_maps(want, attention.grid).float(), atol=1e-6, rtol=1e-5)
    app.SERVER.store.drop(out[tab.held].key)


def test_frames_the_models_crop_cannot_take_are_a_video_error_in_one_sentence():
    """A strip of 16383 x 16 px frames passes the gate; a model that resizes the shorter side to 224 px
    cannot crop it (`vitviz.preprocess.MAX_RESIZED`): the tab and the evaluator catch `VideoError`."""
    from vitviz.clips import VideoError, clip_tensor, load_video
    from vitviz.config import Preprocessing

    frames = [Image.new("RGB", (16383, 16), (30 * k, 120, 60)) for k in range(4)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    clip = load_video(buf.getvalue(), frames=4)
    with pytest.raises(VideoError) as caught:
        clip_tensor(clip, Preprocessing(224, resize_size=224))
    assert str(caught.value) == "the clip's frames are 16383x16 px, too elongated to prepare for a model that sees 224x224 px"


def test_the_video_menus_hub_repositories_are_kept_in_the_hub_cache_like_the_image_menus():
    from vitviz.server.models import ModelCache

    kept = ModelCache().menu_repos
    assert {"MCG-NJU/videomae-base-finetuned-kinetics", "facebook/timesformer-base-finetuned-k400"} <= kept
    assert all(name.removeprefix("hf:") in kept for name in video.MODELS if name.startswith("hf:"))


def test_the_relevance_map_is_the_librarys_for_the_top_class_and_priced_as_it_runs(app, gif, uploaded):
    from torch.utils.flop_counter import FlopCounterMode

    from vitviz.clips import clip_tensor, load_video
    from vitviz.cost import price
    from vitviz.video.analysis import frame_maps, space_time_relevance
    from vitviz.video.shapes import load_shapes_video, to_videos

    tab = video.TAB
    out = tab.on_video_run(uploaded(gif), "shapes_video", 1, 1, 1, 1, None, "relevance")
    model = load_shapes_video()
    videos = clip_tensor(load_video(str(gif), frames=model.spec.frames, sampling=model.spec.sampling), model.spec.preprocessing)
    top = model.spec.categories.index(next(iter(out[tab.prediction])))
    kept = app.SERVER.store.get(out[tab.held].key)
    torch.testing.assert_close(kept.maps, frame_maps(space_time_relevance(model, videos, top)[0], model.spec.grid), atol=1e-6, rtol=1e-5)
    assert out[tab.strip]["label"].startswith("What made the top class") and out[tab.gif]["value"].endswith("-relevance.gif")
    app.SERVER.store.drop(out[tab.held].key)
    with pytest.raises(gr.Error, match="Choose a map: rollout or relevance"):
        tab.on_video_run(uploaded(gif), "shapes_video", 1, 1, 1, 1, None, "saliency<script>")
    counter = FlopCounterMode(display=False)
    with counter:
        video.run_on_device(app.SERVER.name, "shapes_video", to_videos(_rightward())[0], "relevance")
    cost = price(model.spec, "video_relevance")
    assert counter.get_total_flops() / 1.5 <= cost.flops <= counter.get_total_flops() * 1.5, (cost.flops, counter.get_total_flops())
    assert cost.bytes > price(model.spec, "video").bytes
