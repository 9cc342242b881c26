"""The explorer's file written while the analysis' forward runs (`explorer_data.StackStream`, through
`views.explore(..., stream_to=...)`): complete, byte for byte the file `explorer_data.stack_file`
writes from the finished analysis, each layer on disk before the next layer runs, no file left by a
forward that fails, and the app sending the explorer's value with the analysis."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitviz
from vitviz.model import Attention
from vitviz.pipeline import image_tower
from vitviz.server.models import ModelFacts
from vitviz.server.pictures import explorer_data, views
from vitviz.server.pictures.drawers import drawer

IMAGE = np.random.default_rng(0).integers(0, 256, (90, 70, 3), dtype=np.uint8)


class _Cache:
    """`views.explore`'s model cache, holding one model."""

    def __init__(self, model):
        self.model = model

    def get(self, variant):
        return self.model, ModelFacts.of(self.model)


def _with_spec(model: vitviz.ViT, size: int, name: str) -> vitviz.ViT:
    model.spec = vitviz.VariantSpec(name=name, config=model.config, preprocessing=vitviz.Preprocessing(size),
                                    categories=tuple(f"class {i}" for i in range(model.config.num_classes)), source="test", weights="random")
    return model.eval()


def _torchvision_small():
    """A torchvision ViT of the B/16 architecture, made small: 64 px, 3 layers of 4 heads."""
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(5)
    tv = VisionTransformer(image_size=64, patch_size=16, num_layers=3, num_heads=4, hidden_dim=32, mlp_dim=64, num_classes=7).eval()
    torch.nn.init.normal_(tv.heads.head.weight, std=0.02)
    return vitviz.ViT.from_torchvision(tv).eval()


def _pooled(pool: str):
    """No cls token, the patches' mean ("avg") or an attention probe ("map") classified: the "pool" query."""
    torch.manual_seed(6)
    return _with_spec(vitviz.ViT(image_size=48, patch_size=16, width=16, depth=3, heads=2, mlp_dim=32, num_classes=3,
                                 class_token=False, pool=pool), 48, f"pooled-{pool}")


def _prefixed():
    """A cls token, DeiT's distillation token and two registers: four named queries."""
    torch.manual_seed(7)
    return _with_spec(vitviz.ViT(image_size=48, patch_size=16, width=16, depth=3, heads=2, mlp_dim=32, num_classes=3,
                                 distill_token=True, register_tokens=2), 48, "prefixed")


MODELS = {
    "shapes_p16": lambda: vitviz.load_model("shapes_p16", device="cpu"),
    "torchvision": _torchvision_small,
    "pooled-mean": lambda: _pooled("avg"),
    "pooled-probe": lambda: _pooled("map"),
    "prefixed": _prefixed,
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def _numpy_rule(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The quantisation rule written out in numpy float64: floor(a / max x 255 + 1/2), max from float32."""
    top = rows.astype(np.float32).max(axis=-1)
    safe = np.where(top > 0, top, 1).astype(np.float64)
    return np.clip(np.floor(rows.astype(np.float32).astype(np.float64) / safe[..., None] * 255.0 + 0.5), 0, 255).astype(np.uint8), top


def test_quantised_rows_follow_the_float64_rule():
    torch.manual_seed(0)
    rows = torch.rand(5, 40, 300) ** 4
    rows[0, 0] = 0  # a row of zeros: all 0, its maximum 0
    rows[1, 1, :3] = torch.tensor([1.0, 0.5 / 255, 1.5 / 255])  # values at a half step, as close as float32 gets
    q, top = explorer_data.quantise_rows(rows)
    want_q, want_top = _numpy_rule(rows.numpy())
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(top, want_top)
    assert q.dtype == np.uint8 and top.dtype == np.float32 and not q[0, 0].any()


def test_the_streamed_file_is_the_finished_analysis_file(model, tmp_path):
    path = tmp_path / "key-stack.bin"
    exp = views.explore(_Cache(model), IMAGE, model.spec.name, stream_to=path)
    a = exp.analysis
    assert explorer_data.layout_of(a).mode == "stack"
    assert path.read_bytes() == explorer_data.stack_file(a, range(a.attentions.shape[0]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key-stack.bin"]  # no temporary file left
    # the library's analysis is the same with and without the stream
    plain = vitviz.analyze(model, IMAGE)
    assert torch.equal(plain.attentions, a.attentions) and torch.equal(plain.tokens, a.tokens)
    # the page's value finds the file written: the same bytes, not written again
    before = path.stat().st_mtime_ns
    value = explorer_data.write_payload(exp, key="key", folder=tmp_path)
    assert value["data"] == str(path) and path.stat().st_mtime_ns == before


def test_each_layer_is_on_disk_before_the_next_layer_runs(tmp_path):
    model = _torchvision_small()
    path = tmp_path / "k-stack.bin"
    part = path.with_name(path.name + ".part")
    blocks = [m for m in model.modules() if isinstance(m, Attention)]
    seen = {}

    def looking(layer):
        def hook(module, args):
            seen[layer] = part.read_bytes() if part.exists() else None  # before this layer's attention is computed
        return hook

    handles = [m.register_forward_pre_hook(looking(i)) for i, m in enumerate(blocks)]
    try:
        exp = views.explore(_Cache(model), IMAGE, "tv", stream_to=path)
    finally:
        for h in handles:
            h.remove()
    a = exp.analysis
    layout = explorer_data.layout_of(a)
    head = 4 * layout.tokens
    assert seen[0] is None or len(seen[0]) == 0  # nothing written before the first layer
    for layer in range(1, len(blocks)):
        written = seen[layer]
        # every layer before this one is there, at its place, and nothing after it yet
        assert len(written) == head + layer * layout.layer_bytes
        for done in range(layer):
            at = head + done * layout.layer_bytes
            assert written[at : at + layout.layer_bytes] == explorer_data.layer_block(a, done)
    assert path.read_bytes()[:head] == explorer_data.shared_max(a).astype("<f4").tobytes()  # the header, written last


def test_the_file_is_complete_as_the_last_attention_is_while_the_forward_goes_on(model, tmp_path):
    """The file under its name, every byte of it, before the last block's MLP and the head run; a
    probe-weighted pooled query (its rows need the probe, after every block) completes it at `finish`."""
    path = tmp_path / "key-stack.bin"
    last_mlp = image_tower(model).blocks[-1].mlp
    events = []
    handle = last_mlp.register_forward_hook(lambda *args: events.append("last MLP ran"))

    def complete(layout, where):
        events.append(("complete", where, where.read_bytes(), layout))

    try:
        exp = views.explore(_Cache(model), IMAGE, model.spec.name, stream_to=path, on_file=complete)
    finally:
        handle.remove()
    a = exp.analysis
    (step, where, data, layout), = [e for e in events if e[0] == "complete"]
    assert where == path and data == explorer_data.stack_file(a, range(a.attentions.shape[0])) and layout == explorer_data.layout_of(a)
    deferred = image_tower(model).attn_pool is not None
    assert events.index((step, where, data, layout)) == (1 if deferred else 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key-stack.bin"]


def test_a_complete_file_goes_with_an_analysis_that_fails_after_it(tmp_path):
    model = _torchvision_small()
    path = tmp_path / "k-stack.bin"

    def fail(*args):
        raise RuntimeError("out of memory in the head")

    handle = model.head.register_forward_hook(fail)
    completed = []
    try:
        with pytest.raises(RuntimeError, match="the head"):
            views.explore(_Cache(model), IMAGE, "tv", stream_to=path, on_file=lambda layout, where: completed.append(where.exists()))
    finally:
        handle.remove()
    assert completed == [True] and list(tmp_path.iterdir()) == []
    # a layer given twice is refused, and the stream leaves nothing
    stream = explorer_data.StackStream(path, depth=3, num_prefix_tokens=1)
    a = vitviz.analyze(model, IMAGE)
    stream.on_layer(0, a.attentions[0])
    with pytest.raises(RuntimeError, match="twice"):
        stream.on_layer(0, a.attentions[0])
    stream.abort()
    assert list(tmp_path.iterdir()) == []


def test_a_forward_that_fails_leaves_no_file(tmp_path):
    model = _torchvision_small()
    path = tmp_path / "k-stack.bin"
    blocks = [m for m in model.modules() if isinstance(m, Attention)]

    def fail(module, args):
        raise RuntimeError("out of memory in layer 3")

    handle = blocks[2].register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="layer 3"):
            views.explore(_Cache(model), IMAGE, "tv", stream_to=path)
    finally:
        handle.remove()
    assert list(tmp_path.iterdir()) == []
    # a stream that never saw every layer refuses to finish, and leaves nothing
    stream = explorer_data.StackStream(path, depth=3, num_prefix_tokens=1)
    a = vitviz.analyze(model, IMAGE)
    stream.on_layer(0, a.attentions[0])
    with pytest.raises(RuntimeError, match="1 of 3 layers"):
        stream.finish(a)
    assert list(tmp_path.iterdir()) == []


def test_a_stack_over_the_budget_is_not_streamed(tmp_path):
    model = _torchvision_small()
    path = tmp_path / "k-stack.bin"
    stream = explorer_data.StackStream(path, depth=3, num_prefix_tokens=1, budget=1000)
    a = vitviz.analyze(model, IMAGE, on_layer=stream.on_layer)
    assert stream.finish(a) is None and list(tmp_path.iterdir()) == []


def test_a_picture_file_is_its_size_then_its_rgb_rows():
    rgb = np.random.default_rng(1).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    data = explorer_data.rgb_file(Image.fromarray(rgb))
    assert data[:8] == bytes([7, 0, 0, 0, 5, 0, 0, 0]) and data[8:] == rgb.tobytes()  # width, height, little-endian
    assert np.array_equal(np.asarray(explorer_data.read_rgb_file(data)), rgb)
    grey = Image.fromarray(rgb[..., 0])  # any mode is written as RGB
    assert explorer_data.rgb_file(grey)[8:] == np.repeat(rgb[..., :1], 3, axis=2).tobytes()
    with pytest.raises(ValueError, match="has 113 bytes, not 112"):
        explorer_data.read_rgb_file(data[:-1])


# ----------------------------------------------------------------------------- the app


@pytest.fixture(scope="module")
def app():
    global page, runtime, tabs
    from vitviz.server import app as app_module, page, runtime, tabs

    return app_module


def _quiet(*args, **kwargs):
    pass


def test_the_page_gets_the_value_the_outputs_bring_before_the_head_runs(app, model, tmp_path, monkeypatch):
    """`runtime._Early`: the pictures before the forward, then the explorer's value, made from the spec
    and the crop while the forward runs, equal to the one the analysis' outputs bring (its drawer's
    `write_explorer`, from the finished analysis), every key of it; for every model but a
    probe-weighted pooled one, published before the head runs."""
    from vitviz.server.app import SERVER
    import asyncio

    monkeypatch.setattr(SERVER, "explorer_dir", tmp_path)

    def published(ticket, step):
        try:
            return asyncio.run(asyncio.wait_for(SERVER.early.wait(ticket, step), 0.05))
        except asyncio.TimeoutError:
            return None

    seen = []
    handle = image_tower(model).head.register_forward_hook(lambda *args: seen.append(published(ticket, "explorer")))
    key = runtime.new_key()
    try:
        with SERVER.early.opened(runtime.new_key()) as ticket:
            early = runtime._Early(SERVER.name, ticket, model.spec, key)
            path = tmp_path / f"{key}-stack.bin"
            exp = views.explore(_Cache(model), IMAGE, model.spec.name, stream_to=path, on_crop=early.on_crop, on_file=early.on_file)
            early.after(exp, path)
            pictures, value = published(ticket, "pictures"), published(ticket, "explorer")
    finally:
        handle.remove()
    first = value.pop("first")
    outputs = drawer(exp).write_explorer(views.Exploration(exp.analysis, exp.facts), key=key, folder=tmp_path)
    assert value == outputs and list(value) == list(outputs)
    assert all(value[k] == pictures[k] for k in pictures) and first == explorer_data.first_shown(value)
    probe = image_tower(model).attn_pool is not None and model.config.pooled_query
    assert (seen == [None]) if probe else (seen[0] is not None and seen[0]["id"] == key)


def test_callbacks_that_never_reach_the_server_still_give_the_page_its_explorer(app, monkeypatch):
    """As on ZeroGPU, where the analysis runs in a worker process and its calls to `on_crop` and
    `on_file` publish nothing here: the explorer is published from the finished analysis."""
    from vitviz.server.app import SERVER
    import asyncio

    original = runtime._analyze_on_device
    monkeypatch.setattr(runtime, "_analyze_on_device", lambda server, image, variant, stream_to=None, on_crop=None, on_file=None:
                        original(server, image, variant, stream_to=stream_to))
    key = runtime.new_key()
    with SERVER.early.opened(runtime.new_key()) as ticket:
        exp = SERVER.run(runtime.EXAMPLES[3], "shapes_p16", explorer_key=key, ticket=ticket)
        pictures, value = (asyncio.run(asyncio.wait_for(SERVER.early.wait(ticket, step), 1.0)) for step in ("pictures", "explorer"))
    first = value.pop("first")
    assert value == explorer_data.write_payload(exp, key=key, folder=SERVER.explorer_dir) and first == explorer_data.first_shown(value)
    assert pictures == {k: value[k] for k in pictures} and set(pictures) == {*explorer_data.PICTURES, "scale"}


def test_an_analysis_that_fails_after_its_file_removes_the_files_it_published(app, monkeypatch):
    """A failure in the head, after the explorer's value went to the page: the stack file and the
    pictures go with the analysis, whose job ends; the server goes on."""
    from vitviz.server.app import SERVER
    model, _ = SERVER.cache.get("shapes_p16")

    def fail(*args):
        raise RuntimeError("out of memory in the head")

    before = set(SERVER.explorer_dir.glob("*")) if SERVER.explorer_dir.exists() else set()
    handle = model.head.register_forward_hook(fail)
    try:
        with SERVER.early.opened(runtime.new_key()) as ticket, pytest.raises(RuntimeError, match="the head"):
            SERVER.run(runtime.EXAMPLES[2], "shapes_p16", explorer_key=runtime.new_key(), ticket=ticket)
    finally:
        handle.remove()
    assert set(SERVER.explorer_dir.glob("*")) == before and SERVER.work.running() == []
    out = page.on_analyze(runtime.EXAMPLES[2], "shapes_p16", "mean", 0.0, progress=_quiet)
    assert out[page.PAGE.notice] == "" and Path(out[tabs.explorer.TAB.live["global"]]["data"]).exists()


def test_the_analysis_sends_the_explorer_with_its_outputs(app):
    from vitviz.server.app import SERVER
    out = page.on_analyze(runtime.EXAMPLES[0], "shapes_p16", "mean", 0.0, progress=_quiet)
    ref, explorer = out[page.PAGE.state], tabs.explorer.TAB
    live = out[explorer.live["global"]]
    assert live["mode"] == "stack" and live["id"] == ref.key
    data = Path(live["data"])
    assert data.name == f"{ref.key}-stack.bin" and data.parent == SERVER.explorer_dir
    exp = SERVER.recall(ref)
    assert exp.key == ref.key and data.read_bytes() == explorer_data.stack_file(exp.analysis, range(exp.analysis.attentions.shape[0]))
    assert out[explorer.server_explorer]["visible"] is False and out[explorer.boxes["global"]]["visible"] is True
    # its pictures: the crop the model sees, which the page shows `scale` times as wide, pixel for pixel
    # the server's views' image (`views.display_of`), and the crop at a mosaic tile's size
    base = np.asarray(explorer_data.read_rgb_file(Path(live["base"]).read_bytes()))
    k, tile = live["scale"], explorer_data.mosaic_tile_px(exp.analysis.grid)
    assert k > 1 and np.array_equal(base, np.asarray(exp.analysis.image.convert("RGB")))
    assert np.array_equal(base.repeat(k, axis=0).repeat(k, axis=1), np.asarray(exp.display_image.convert("RGB")))
    assert sum(Path(live[k]).stat().st_size for k in explorer_data.PICTURES) == explorer_data.pictures_bytes(base.shape[0], exp.analysis.grid)
    tile_base = explorer_data.read_rgb_file(Path(live["tile_base"]).read_bytes())
    assert np.array_equal(np.asarray(tile_base), np.asarray(exp.analysis.image.convert("RGB").resize((tile, tile), Image.BILINEAR)))
    # priced with the file: the analysis' job holds one layer's rows beside the forward
    plain, streamed = SERVER.analysis_price("shapes_p16"), SERVER.analysis_price("shapes_p16", explorer=True)
    assert streamed.bytes > plain.bytes and streamed.kept_bytes == plain.kept_bytes and streamed.flops == plain.flops
    # an explorer a layer at a time writes nothing while the forward runs: priced as the analysis alone
    assert SERVER.analysis_price("shapes_p8@288", explorer=True) == SERVER.analysis_price("shapes_p8@288")


@pytest.mark.skipif(not (vitviz.sources.assets_dir() / "shapes_swin.pt").is_file(), reason="assets/shapes_swin.pt is not trained yet")
def test_a_windowed_models_explorer_comes_with_the_analysis_within_its_job_and_price(app):
    """The embedded Swin: its explorer's file is written after the forward, within the analysis' own
    job, and its value comes with the analysis' outputs in the windowed widget (the global one
    emptied). The analysis' price holds what writing the file takes beside the analysis'; one job
    in all."""
    from vitviz.cost import price
    from vitviz.server.app import SERVER
    from vitviz.server.pictures import swin_explorer

    spec = vitviz.get_spec("shapes_swin")
    file = price(spec, "explorer")
    plain, priced = SERVER.analysis_price("shapes_swin"), SERVER.analysis_price("shapes_swin", explorer=True)
    assert file.kept_bytes > 0 and priced.bytes >= plain.bytes + 2 * file.kept_bytes  # the file and its copy, beside the analysis
    assert priced.kept_bytes == plain.kept_bytes and priced.flops >= plain.flops
    jobs, held = [], []
    original, stack_file = SERVER.priced, swin_explorer.stack_file
    with pytest.MonkeyPatch.context() as m:
        m.setattr(SERVER, "priced", lambda cost, *args, **kwargs: (jobs.append(cost), original(cost, *args, **kwargs))[1])
        m.setattr(swin_explorer, "stack_file", lambda a: (held.append([j.cost for j in SERVER.work.running()]), stack_file(a))[1])
        out = page.on_analyze(runtime.EXAMPLES[-2], "shapes_swin", "mean", 0.0, progress=_quiet)
    assert out[page.PAGE.notice] == "", out[page.PAGE.notice]
    explorer, ref = tabs.explorer.TAB, out[page.PAGE.state]
    live = out[explorer.live["windowed"]]
    assert live["id"] == ref.key and live["mode"] == "stack" and Path(live["data"]).stat().st_size == file.kept_bytes
    assert out[explorer.live["global"]] is None and out[explorer.boxes["windowed"]]["visible"] is True
    assert out[explorer.boxes["global"]]["visible"] is False and out[explorer.server_explorer]["visible"] is False
    assert jobs == [priced] and held == [[priced]]  # written once, within the analysis' one job


def test_a_failed_analysis_leaves_no_explorer_file_and_the_server_goes_on(app, monkeypatch):
    from vitviz.server.app import SERVER
    calls = []
    original = explorer_data._block_parts  # each layer's block as the forward writes it

    def failing(rows, p):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the disk is full")
        return original(rows, p)

    monkeypatch.setattr(explorer_data, "_block_parts", failing)
    before = set(SERVER.explorer_dir.glob("*")) if SERVER.explorer_dir.exists() else set()
    with pytest.raises(RuntimeError, match="disk is full"):
        page.on_analyze(runtime.EXAMPLES[1], "shapes_p16", "mean", 0.0, progress=_quiet)
    assert set(SERVER.explorer_dir.glob("*")) == before  # nothing written, nothing half written
    assert SERVER.work.running() == []  # its job is over
    monkeypatch.setattr(explorer_data, "_block_parts", original)
    out = page.on_analyze(runtime.EXAMPLES[1], "shapes_p16", "mean", 0.0, progress=_quiet)
    assert out[page.PAGE.notice] == "" and Path(out[tabs.explorer.TAB.live["global"]]["data"]).exists()
