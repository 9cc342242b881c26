"""Video transformers through vitviz (`vitviz.video`): Hugging Face's TimeSformer, VideoMAE, ViViT and
V-JEPA 2 give the same outputs and the same attention as transformers' own forward (tiny random configs,
eager attention); the "hf:" path through a saved folder; the space-time rollout of divided attention
against an independent construction; frame maps and attention distances on hand-worked cases."""

import pytest
import torch

import vitviz
from vitviz.video import (
    VideoAttention,
    VideoConfig,
    VideoSpec,
    VideoViT,
    attention_across_frames,
    attention_across_frames_all,
    frame_maps,
    mean_attention_distance_space_time,
    space_time_rollout,
)

transformers = pytest.importorskip("transformers")

FRAMES, SIDE, PATCH = 4, 32, 8
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, attn_implementation="eager")


def _randomise(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter away from its init (norms 1, biases 0), so a dropped one shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0, 0.1)
    return model.eval()


def _models() -> dict:
    t = transformers
    tsf = dict(SMALL, intermediate_size=64, image_size=SIDE, patch_size=PATCH, num_frames=FRAMES)
    vjepa = dict(SMALL, crop_size=SIDE, patch_size=PATCH, frames_per_clip=FRAMES, tubelet_size=2, pred_hidden_size=32,
                 pred_num_hidden_layers=1, pred_num_attention_heads=2)
    return {
        "timesformer-classifier": lambda: t.TimesformerForVideoClassification(t.TimesformerConfig(**tsf, num_labels=5)),
        "timesformer-joint": lambda: t.TimesformerModel(t.TimesformerConfig(**tsf, attention_type="joint_space_time")),
        "videomae-classifier": lambda: t.VideoMAEForVideoClassification(t.VideoMAEConfig(**tsf, tubelet_size=2, num_labels=5)),
        "videomae-first": lambda: t.VideoMAEModel(t.VideoMAEConfig(**tsf, tubelet_size=2, use_mean_pooling=False, qv_bias=False)),
        "vivit-classifier": lambda: t.VivitForVideoClassification(
            t.VivitConfig(**SMALL, intermediate_size=64, image_size=SIDE, num_frames=FRAMES, tubelet_size=[2, PATCH, PATCH], num_labels=5)),
        "vjepa2": lambda: t.VJEPA2Model(t.VJEPA2Config(**vjepa)),
        "vjepa2-classifier": lambda: t.VJEPA2ForVideoClassification(t.VJEPA2Config(**vjepa, num_labels=5, num_pooler_layers=1)),
    }


def _hf_forward(model, x: torch.Tensor, **kw):
    if model.config.model_type == "vjepa2":
        if type(model).__name__ == "VJEPA2Model":
            kw["skip_predictor"] = True
        return model(pixel_values_videos=x, **kw)
    return model(pixel_values=x, **kw)


def _hf_tokens(model, x: torch.Tensor) -> torch.Tensor:
    """The encoder's tokens after its final norm, in vitviz's order (TimeSformer's reordered frame by frame)."""
    base = getattr(model, model.base_model_prefix, model)
    tokens = _hf_forward(base, x).last_hidden_state
    if model.config.model_type == "timesformer":
        tokens = tokens[:, _timesformer_order(model.config)]
    return tokens


def _timesformer_order(cfg) -> torch.Tensor:
    """vitviz's token i is Hugging Face's TimeSformer token order[i]: its patches go position by position."""
    s = (cfg.image_size // cfg.patch_size) ** 2
    return torch.tensor([0] + [1 + p * cfg.num_frames + f for f in range(cfg.num_frames) for p in range(s)])


def _timesformer_time_attention(model) -> tuple[list, list]:
    """Hooks on each layer's temporal attention that keep transformers' own softmax of it (its
    `output_attentions` returns the space attention alone)."""
    base = getattr(model, model.base_model_prefix, model)
    kept, handles = [], []
    for layer in base.encoder.layer:
        def hook(module, inputs, output):
            kept.append(module.forward(inputs[0], True)[1])  # forward itself: no hook runs again
        handles.append(layer.temporal_attention.attention.register_forward_hook(hook))
    return kept, handles


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("kind", list(_models()))
def test_video_models_give_transformers_outputs_and_attention(kind):
    model = _randomise(_models()[kind]())
    ours = vitviz.from_transformers(model)
    assert isinstance(ours, VideoViT) and isinstance(ours.spec, VideoSpec)
    torch.manual_seed(1)
    x = torch.randn(2, FRAMES, 3, SIDE, SIDE)
    divided = ours.config.attention == "divided"
    kept, handles = _timesformer_time_attention(model) if divided else ([], [])
    try:
        with torch.inference_mode():
            out = _hf_forward(model, x, output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    with torch.inference_mode(), vitviz.record_attention(ours) as rec:
        tokens = ours.encode(x)
        outputs = ours.head_logits(tokens)
    with torch.inference_mode():
        hf_tokens = _hf_tokens(model, x)
    assert _relative(tokens, hf_tokens) < 1e-4
    if ours.config.num_classes:
        assert _relative(outputs, out.logits) < 1e-4
    elif kind == "vjepa2":  # the encoder's features: the mean of its tokens
        assert _relative(outputs, out.last_hidden_state.mean(1)) < 1e-4
    else:  # token 0 after the final norm (the cls token, or VideoMAE's first tubelet without mean pooling)
        assert _relative(outputs, hf_tokens[:, 0]) < 1e-4
    hf_attention = list(out.attentions)
    assert len(hf_attention) == ours.config.depth
    if divided:  # the recorder sees each block's time attention, then its space attention
        assert len(rec.layers) == 2 * ours.config.depth and len(kept) == ours.config.depth
        torch.testing.assert_close(torch.stack(rec.layers[0::2]), torch.stack(kept), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.stack(rec.layers[1::2]), torch.stack(hf_attention), atol=1e-5, rtol=0)
    else:
        want = torch.stack(hf_attention)
        if kind == "timesformer-joint":
            order = _timesformer_order(model.config)
            want = want[..., order, :][..., order]
        torch.testing.assert_close(rec.attentions, want, atol=1e-5, rtol=0)
    attention = ours.attention(x[:1])
    assert attention.kind == ours.config.attention and attention.depth == ours.config.depth
    if divided:
        t, h, w = attention.grid
        assert attention.time.shape == (2, 2, h * w, t, t) and attention.space.shape == (2, 2, t, 1 + h * w, 1 + h * w)
        torch.testing.assert_close(attention.space, torch.stack(hf_attention)[:, :t].transpose(1, 2), atol=1e-5, rtol=0)
    else:
        assert attention.joint.shape == (2, 2, ours.spec.config.num_tokens, ours.spec.config.num_tokens)
    assert (attention.pool is not None) == (kind == "vjepa2-classifier")


def test_vjepa2_takes_a_single_frame_as_transformers_does():
    """Fewer frames than a tubelet are repeated to one (an image), and other clip lengths follow the rotary positions."""
    model = _randomise(_models()["vjepa2"]())
    ours = vitviz.from_transformers(model)
    for frames in (1, 6):
        x = torch.randn(1, frames, 3, SIDE, SIDE)
        with torch.inference_mode():
            assert _relative(ours.encode(x), _hf_forward(model, x).last_hidden_state) < 1e-4


def test_a_video_model_loads_from_a_folder_saved_with_save_pretrained(tmp_path):
    model = _randomise(_models()["vivit-classifier"]())
    model.config.id2label = {i: f"action {i}" for i in range(5)}
    model.config.label2id = {v: k for k, v in model.config.id2label.items()}
    model.save_pretrained(tmp_path)
    transformers.VivitVideoProcessor(size={"shortest_edge": 36}, crop_size={"height": SIDE, "width": SIDE}).save_pretrained(tmp_path)
    ours = vitviz.load_model("hf:someone/vivit-tiny", weights_path=tmp_path, device="cpu")
    assert isinstance(ours, VideoViT)
    spec = ours.spec
    assert spec.name == "hf:someone/vivit-tiny" and spec.source == "hf" and spec.categories == tuple(f"action {i}" for i in range(5))
    assert spec.frames == FRAMES and spec.sampling == "uniform" and spec.frame_indices(40) == [0, 10, 20, 30]
    pre = spec.preprocessing  # x / 127.5 - 1, then (· - 0.5) / 0.5: mean 0.75, std 0.25 on [0, 1] pixels
    assert (pre.image_size, pre.resize_size) == (SIDE, 36)
    assert pre.mean == pytest.approx((0.75,) * 3) and pre.std == pytest.approx((0.25,) * 3)
    x = torch.randn(1, FRAMES, 3, SIDE, SIDE)
    with torch.inference_mode():
        assert _relative(ours(x), model(pixel_values=x).logits) < 1e-4


def test_a_saved_vjepa2_encoder_without_a_processor_loads_with_its_family_defaults(tmp_path):
    model = _randomise(_models()["vjepa2"]())
    model.save_pretrained(tmp_path)
    ours = vitviz.load_model("hf:someone/vjepa2-tiny", weights_path=tmp_path, device="cpu")
    spec = ours.spec
    assert spec.categories is None and spec.sampling == "stride" and spec.frame_stride == 4
    assert spec.frame_indices(100) == [43, 47, 51, 55] and spec.frame_indices(5) == [0, 4, 4, 4]
    assert spec.preprocessing.mean == pytest.approx(vitviz.config.IMAGENET_MEAN) and "no video processor saved" in spec.description
    x = torch.randn(1, FRAMES, 3, SIDE, SIDE)
    with torch.inference_mode():
        assert _relative(ours.encode(x), _hf_forward(model, x).last_hidden_state) < 1e-4


def _divided_model(frames: int, num_classes: int = 0) -> VideoViT:
    """A small random TimeSformer-like model whose attention is far from uniform."""
    torch.manual_seed(frames)
    model = VideoViT(VideoConfig(frames=frames, tubelet=1, image_size=16, patch_size=8, width=16, depth=3, heads=2, mlp_dim=32,
                                 attention="divided", class_token=True, positions="divided", pool="cls",
                                 num_classes=num_classes)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("qkv.weight"):
                p.mul_(6.0)
    return model


def _mix(x: torch.Tensor, time: torch.Tensor, space: torch.Tensor, frames: int, s: int) -> torch.Tensor:
    """One divided block's linearised token mixing applied to x [N, k] (cls, then patches frame by frame),
    laid out as transformers' TimeSformer lays it out: residuals halved, the cls token outside the time
    step, its outputs of the frames' space steps averaged."""
    k = x.shape[-1]
    cls, patches = x[:1], x[1:]
    by_position = patches.reshape(frames, s, k).transpose(0, 1)  # [s, T, k]: Hugging Face's layout
    by_position = 0.5 * by_position + 0.5 * torch.einsum("pij,pjk->pik", time, by_position)
    per_frame = torch.cat([cls[None].expand(frames, 1, k), by_position.transpose(0, 1)], dim=1)  # [T, 1 + s, k]
    mixed = torch.einsum("fij,fjk->fik", space, per_frame)
    cls = 0.5 * cls + 0.5 * mixed[:, 0].mean(dim=0, keepdim=True)
    patches = 0.5 * per_frame[:, 1:] + 0.5 * mixed[:, 1:]
    return torch.cat([cls, patches.reshape(frames * s, k)])


def test_the_divided_rollout_is_the_product_of_each_blocks_time_and_space_steps():
    model = _divided_model(frames=3)
    attention = model.attention(torch.randn(3, 3, 16, 16))
    t, h, w = attention.grid
    rollout = space_time_rollout(attention)
    n = 1 + t * h * w
    assert rollout.shape == (n, n)
    want = torch.eye(n)
    for time, space in zip(attention.time.mean(dim=1), attention.space.mean(dim=1)):
        want = _mix(want, time, space, t, h * w)  # unit vectors pushed through block after block
    torch.testing.assert_close(rollout, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(rollout.sum(dim=-1), torch.ones(n), atol=1e-5, rtol=0)
    assert rollout.std() > 0.01  # not a uniform matrix: the check had something to see
    maps = frame_maps(rollout, attention.grid)
    assert maps.shape == (t, h, w) and maps.sum().item() == pytest.approx(1 - rollout[0, 0].item(), abs=1e-5)


def test_a_one_frame_divided_model_rolls_out_as_an_image_vit():
    model = _divided_model(frames=1)
    attention = model.attention(torch.randn(1, 3, 16, 16))
    assert torch.equal(attention.time, torch.ones_like(attention.time))
    image = vitviz.attention_rollout(attention.space[:, :, 0], num_prefix_tokens=1)
    torch.testing.assert_close(space_time_rollout(attention), image, atol=1e-6, rtol=0)


def test_frame_maps_read_a_query_row_frame_by_frame():
    torch.manual_seed(0)
    model = VideoViT(VideoConfig(frames=4, tubelet=2, image_size=16, patch_size=8, width=16, depth=2, heads=2, mlp_dim=32,
                                 positions="sinusoidal", pool="mean")).eval()
    attention = model.attention(torch.randn(1, 4, 3, 16, 16))
    rollout = space_time_rollout(attention)
    torch.testing.assert_close(rollout, vitviz.attention_rollout(attention.joint, num_prefix_tokens=0))
    maps = frame_maps(rollout, attention.grid, query=3)
    assert maps.shape == (2, 2, 2)
    torch.testing.assert_close(maps.flatten(), rollout[3])
    torch.testing.assert_close(frame_maps(rollout, attention.grid, query="pool").flatten(), rollout.mean(dim=0))
    across = attention_across_frames(attention, 1, 1, 0, 1)
    torch.testing.assert_close(across.flatten(1), attention.joint[1, :, 4 + 1])


def test_attention_across_frames_of_a_divided_model_joins_its_two_steps():
    model = _divided_model(frames=3)
    attention = model.attention(torch.randn(3, 3, 16, 16))
    across = attention_across_frames(attention, 2, 1, 1, 0)  # patch (t=1, y=1, x=0): position s = 2
    assert across.shape == (2, 3, 2, 2)
    torch.testing.assert_close(across[:, 1].flatten(1), attention.space[2, :, 1, 3, 1:])
    for frame in (0, 2):
        torch.testing.assert_close(across[:, frame, 1, 0], attention.time[2, :, 2, 1, frame])
        assert across[:, frame].sum().item() == pytest.approx(across[:, frame, 1, 0].sum().item())


@pytest.mark.parametrize("attention_kind", ["joint", "divided"])
def test_every_querys_attention_across_frames_at_once_is_each_querys(attention_kind):
    if attention_kind == "divided":
        model = _divided_model(frames=3)
        x = torch.randn(3, 3, 16, 16)
    else:
        torch.manual_seed(0)
        model = VideoViT(VideoConfig(frames=4, tubelet=2, image_size=16, patch_size=8, width=16, depth=2, heads=2, mlp_dim=32)).eval()
        x = torch.randn(4, 3, 16, 16)
    attention = model.attention(x)
    t, h, w = attention.grid
    for layer in range(attention.depth):
        every = attention_across_frames_all(attention, layer)
        assert every.shape == (attention.heads, t * h * w, t, h, w)
        for q in range(t * h * w):
            assert torch.equal(every[:, q], attention_across_frames(attention, layer, q // (h * w), q % (h * w) // w, q % w)), (layer, q)
    with pytest.raises(ValueError, match="layer"):
        attention_across_frames_all(attention, attention.depth)


@pytest.mark.parametrize("attention_kind", ["joint", "divided"])
def test_the_attentions_forward_gives_the_logits_of_a_plain_forward(attention_kind):
    """`VideoViT.attention` keeps the output of the forward that recorded it: the logits a forward without
    recording gives (the fused attention's path), so that one forward serves both."""
    if attention_kind == "divided":
        model = _divided_model(frames=3)
        model.head = torch.nn.Linear(16, 5)
        x = torch.randn(3, 3, 16, 16)
    else:
        torch.manual_seed(0)
        model = VideoViT(VideoConfig(frames=4, tubelet=2, image_size=16, patch_size=8, width=16, depth=2, heads=2, mlp_dim=32,
                                     num_classes=5)).eval()
        x = torch.randn(4, 3, 16, 16)
    attention = model.attention(x)
    with torch.no_grad():
        plain = model(x[None])[0]
    assert attention.logits.shape == plain.shape == (5,)
    torch.testing.assert_close(attention.logits, plain, atol=1e-5, rtol=1e-5)


def _one_hot(rows: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(rows), len(rows)).float()


def test_attention_distances_on_hand_worked_attention():
    """Joint: head 0 looks at its own position k = 2 tokens (4 frames with tubelets of 2) away in time, head
    1 at the next column in its own frame (P px). Divided: the same through the time and space steps, the
    space step half on the cls token (left out by the renormalisation)."""
    grid, k, patch, tubelet = (4, 2, 2), 2, 8, 2
    t, h, w = grid
    index = lambda tt, y, x: tt * h * w + y * w + x  # noqa: E731
    later = [index((tt + k) % t, y, x) for tt in range(t) for y in range(h) for x in range(w)]
    beside = [index(tt, y, (x + 1) % w) for tt in range(t) for y in range(h) for x in range(w)]
    joint = torch.stack([_one_hot(later), _one_hot(beside)])[None]  # [1, 2, N, N]
    space_d, time_d = mean_attention_distance_space_time(VideoAttention(grid, 0, joint=joint), grid, patch, tubelet)
    torch.testing.assert_close(time_d, torch.tensor([[k * tubelet, 0.0]]))
    torch.testing.assert_close(space_d, torch.tensor([[0.0, float(patch)]]))
    s = h * w
    time = _one_hot([(tt + k) % t for tt in range(t)]).expand(s, t, t)  # [s, t, t]
    frame = torch.zeros(1 + s, 1 + s)
    frame[0, 0] = 1.0
    for y in range(h):
        for x in range(w):
            frame[1 + y * w + x, 0] = frame[1 + y * w + x, 1 + y * w + (x + 1) % w] = 0.5
    divided = VideoAttention(grid, 1, time=time[None, None].expand(1, 2, s, t, t), space=frame.expand(1, 2, t, 1 + s, 1 + s))
    space_d, time_d = mean_attention_distance_space_time(divided, grid, patch, tubelet)
    torch.testing.assert_close(time_d, torch.full((1, 2), float(k * tubelet)))
    torch.testing.assert_close(space_d, torch.full((1, 2), float(patch)))


def test_unsupported_clips_and_configs_say_so():
    model = VideoViT(VideoConfig(frames=4, tubelet=2, image_size=16, patch_size=8, width=16, depth=1, heads=2, mlp_dim=32))
    with pytest.raises(ValueError, match="learned for 4 frames"):
        model(torch.randn(1, 6, 3, 16, 16))
    with pytest.raises(ValueError, match="16x16 px"):
        model(torch.randn(1, 4, 3, 24, 24))
    with pytest.raises(ValueError, match="cls token"):
        VideoConfig(attention="divided", class_token=False)
    with pytest.raises(ValueError, match="one clip"):
        model.attention(torch.randn(2, 4, 3, 16, 16))


@pytest.fixture
def hub_timesformer(tmp_path, monkeypatch):
    """A tiny random TimeSformer classifier in an offline Hugging Face cache: its `hf:` name."""
    from huggingface_hub import constants

    from conftest import write_hub_cache

    model = _randomise(_models()["timesformer-classifier"]())
    root = tmp_path / "hub"
    model.save_pretrained(write_hub_cache(root, "someone/timesformer-tiny", {}))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return "hf:someone/timesformer-tiny"


def test_the_image_tabs_refuse_a_video_model_and_the_model_cache_keeps_one_without_image_facts(hub_timesformer):
    from vitviz.server.guards.inputs import InputError, variant
    from vitviz.server.models import ModelCache

    with pytest.raises(InputError, match="is a video model: the Video tab runs video models on a clip"):
        variant(hub_timesformer)
    cache = ModelCache(max_models=2, device="cpu")
    model, facts = cache.get(hub_timesformer)
    assert isinstance(model, VideoViT) and facts is None and cache.loaded() == [hub_timesformer]
    assert cache.get(hub_timesformer)[0] is model  # kept: loaded once
    calls = []

    def load(name, *, device=None):
        calls.append(name)
        return vitviz.load_model(name, device=device)

    again = ModelCache(max_models=2, device="cpu")
    assert isinstance(again.get(hub_timesformer, load=load)[0], VideoViT) and calls == [hub_timesformer]


@pytest.mark.parametrize("kind", ["joint", "divided"])
def test_a_querys_rollout_row_is_the_matrixs_row_without_the_matrix_product(kind):
    from vitviz.video.analysis import space_time_relevance, space_time_rollout_row

    torch.manual_seed(1)
    if kind == "divided":
        model = _divided_model(3)
    else:
        model = VideoViT(VideoConfig(frames=4, tubelet=2, image_size=16, patch_size=8, width=16, depth=3, heads=2, mlp_dim=32,
                                     class_token=True, pool="cls", num_classes=4)).eval()
    x = torch.randn(model.config.frames, 3, 16, 16)
    attention = model.attention(x)
    for fusion in ("mean", "max"):
        matrix = space_time_rollout(attention, head_fusion=fusion)
        for query in (0, 3, "pool"):
            row = space_time_rollout_row(attention, query=query, head_fusion=fusion)
            want = matrix[query] if query != "pool" else matrix[1:].mean(0)
            torch.testing.assert_close(row, want, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(frame_maps(row, attention.grid), frame_maps(matrix, attention.grid, query=query))
    if kind == "joint":
        batch = torch.randn(2, *x.shape)
        whole = space_time_relevance(model, batch, torch.tensor([1, 3]))
        for query in (0, "pool"):
            rows = space_time_relevance(model, batch, torch.tensor([1, 3]), query=query)
            want = whole[:, 0] if query == 0 else whole[:, 1:].mean(1)
            torch.testing.assert_close(rows, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["joint", "divided"])
@pytest.mark.parametrize("fusion", ["mean", "max"])
def test_attention_recorded_with_its_heads_fused_is_the_fused_attention(kind, fusion):
    from vitviz.analysis import fuse_heads

    torch.manual_seed(2)
    model = _divided_model(2) if kind == "divided" else VideoViT(VideoConfig(
        frames=4, tubelet=2, image_size=16, patch_size=8, width=16, depth=2, heads=2, mlp_dim=32, class_token=False, num_classes=3)).eval()
    x = torch.randn(model.config.frames, 3, 16, 16)
    whole, fused = model.attention(x), model.attention(x, head_fusion=fusion)
    assert fused.heads == 1 and whole.heads == 2
    torch.testing.assert_close(fused.logits, whole.logits)
    for name in ("joint", "time", "space"):
        if getattr(whole, name) is not None:
            torch.testing.assert_close(getattr(fused, name)[:, 0], fuse_heads(getattr(whole, name), fusion, dim=1))


@pytest.mark.parametrize("kind", ["joint", "divided", "attentive"])
def test_attention_and_relevance_from_one_pass_are_each_on_its_own(kind):
    """The Video tab's relevance run: the attention with its heads fused, the logits and the probe's
    row from the relevance's own forward equal `VideoViT.attention`'s, and the relevance row
    `space_time_relevance`'s, for the predicted class and another, the cls token and the patches' mean."""
    from vitviz.video.analysis import attention_and_relevance, space_time_relevance

    torch.manual_seed(6)
    if kind == "divided":
        model = _divided_model(2, num_classes=4)
    else:
        pool = dict(pool="attentive", pool_layers=1, pool_mlp_dim=32) if kind == "attentive" else dict(class_token=True, pool="cls")
        model = _randomise(VideoViT(VideoConfig(frames=4, tubelet=2, image_size=16, patch_size=8, width=16, depth=2, heads=2, mlp_dim=32,
                                                num_classes=4, **pool))).eval()
    x = torch.randn(model.config.frames, 3, 16, 16)
    for fusion in ("mean", "max"):
        alone = model.attention(x, head_fusion=fusion)
        for target, query in ((None, 0 if model.config.num_prefix_tokens else "pool"), (2, "pool")):
            attention, row = attention_and_relevance(model, x, target, query=query, head_fusion=fusion)
            for name in ("joint", "time", "space", "pool", "logits"):
                want = getattr(alone, name)
                assert (want is None) == (getattr(attention, name) is None), name
                if want is not None:
                    torch.testing.assert_close(getattr(attention, name), want, atol=1e-6, rtol=1e-5)
            explained = int(alone.logits.argmax()) if target is None else target
            torch.testing.assert_close(row, space_time_relevance(model, x, explained, query=query)[0], atol=1e-6, rtol=1e-5)
    assert (kind == "attentive") == (alone.pool is not None)
    with pytest.raises(ValueError, match="one clip"):
        attention_and_relevance(model, torch.randn(2, *x.shape))


def test_divided_relevance_is_each_blocks_time_then_space_step_placed_token_by_token():
    """TimeSformer's relevance against the rule written out token by token in float64: each block's
    time term T (a patch's row over its own position in every frame; the cls row 0) then its space term
    S (a patch's row over its frame and the cls token; the cls row the sum over frames of its rows),
    R <- R + T R, R <- R + S R; the rows without the matrices, and a batch of two as each clip alone."""
    from vitviz.hooks import record_attention
    from vitviz.relevance import relevance_layer
    from vitviz.video.analysis import space_time_relevance

    model = _divided_model(2, num_classes=3)
    torch.manual_seed(5)
    x = torch.randn(1, 2, 3, 16, 16)
    target = 2
    inp = x.clone().requires_grad_(True)
    with torch.enable_grad(), record_attention(model, graph=True) as rec:
        logits = model(inp)
    attn = rec.graph_attentions
    grads = torch.autograd.grad(logits[0, target], attn)
    t, h, w = model.grid_for(x)
    s = h * w
    n = 1 + t * s

    def token(f: int, pos: int) -> int:
        return 1 + f * s + pos

    r = torch.eye(n, dtype=torch.float64)
    for layer in range(len(attn) // 2):
        time = relevance_layer(attn[2 * layer].detach().double(), grads[2 * layer].double())  # [s, t, t]
        space = relevance_layer(attn[2 * layer + 1].detach().double(), grads[2 * layer + 1].double())  # [t, 1 + s, 1 + s]
        big_t = torch.zeros(n, n, dtype=torch.float64)
        for pos in range(s):
            for fq in range(t):
                for fk in range(t):
                    big_t[token(fq, pos), token(fk, pos)] = time[pos, fq, fk]
        big_s = torch.zeros(n, n, dtype=torch.float64)
        for f in range(t):  # the cls token's row: the sum of its rows (each frame's gradient carries the mean's 1/t)
            big_s[0, 0] += space[f, 0, 0]
            for pk in range(s):
                big_s[0, token(f, pk)] = space[f, 0, 1 + pk]
            for pq in range(s):
                big_s[token(f, pq), 0] = space[f, 1 + pq, 0]
                for pk in range(s):
                    big_s[token(f, pq), token(f, pk)] = space[f, 1 + pq, 1 + pk]
        r = r + big_t @ r
        r = r + big_s @ r
    ours = space_time_relevance(model, x, target)[0]
    torch.testing.assert_close(ours.double(), r, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(space_time_relevance(model, x, target, query=0)[0].double(), r[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(space_time_relevance(model, x, target, query="pool")[0].double(), r[1:].mean(0), atol=1e-5, rtol=1e-4)
    assert r[0, 1:].abs().sum() > 1e-3  # the cls token's relevance reaches the patches: the check is not of an identity
    other = torch.randn(1, 2, 3, 16, 16)
    both = torch.cat([x, other])
    for query in (None, 0, "pool"):
        together = space_time_relevance(model, both, torch.tensor([target, 0]), query=query)
        torch.testing.assert_close(together[0], space_time_relevance(model, x, target, query=query)[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(together[1], space_time_relevance(model, other, 0, query=query)[0], atol=1e-5, rtol=1e-4)


def test_the_probes_row_is_the_threads_own_clips():
    """Two requests on one cached model at once: a forward in another thread while a clip's probe
    row is recorded leaves that row the clip's own."""
    import threading

    from vitviz.video.model import pool_row

    torch.manual_seed(8)
    model = _randomise(VideoViT(VideoConfig(frames=4, tubelet=2, image_size=16, patch_size=8, width=16, depth=1, heads=2, mlp_dim=32,
                                            num_classes=3, pool="attentive", pool_layers=1, pool_mlp_dim=32))).eval()
    mine, theirs = torch.randn(1, 4, 3, 16, 16), torch.randn(1, 4, 3, 16, 16)
    with torch.no_grad(), model.recording_pool() as pooled:
        model(mine)
        other = threading.Thread(target=lambda: model(theirs))
        other.start()
        other.join()
    assert len(pooled) == 1
    torch.testing.assert_close(pool_row(pooled), model.attention(mine[0]).pool)
    assert not torch.allclose(model.attention(theirs[0]).pool, model.attention(mine[0]).pool)
