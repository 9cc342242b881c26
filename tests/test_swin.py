"""Swin Transformers: the same outputs and window attention as timm and Hugging Face (shifted layers
with border masks, padded grids), global attention checked against a dense computation of its own,
the merge map by hand, rollout and relevance through the merges against dense products, and a
one-window Swin against the plain ViT it is."""

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_hub_cache

import vitviz
from vitviz.analysis import mean_attention_distance
from vitviz.config import Preprocessing, VariantSpec, ViTConfig
from vitviz.swin import Swin, SwinConfig
from vitviz.swin_analysis import SwinAnalysis, merge_map, swin_gradient_relevance, swin_relevance, window_to_global

ROOT = Path(__file__).resolve().parent.parent

# 64 px, P 4, M 4: stage grids 16, 8, 4; stages 0 and 1 shift by 2 (border masks), stage 2's window is its grid
SHIFTED = dict(image_size=64, embed_dim=16, depths=(2, 2, 2), num_heads=(2, 4, 8), window_size=4)
# 40 px: grids 10, 5, 3; 10 and 5 are padded to whole windows (12, 8), 5 merges to 3 with a padded row and column
PADDED = dict(image_size=40, embed_dim=16, depths=(2, 2, 2), num_heads=(2, 2, 4), window_size=4)


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: one thread runs them faster than a pool of threads does."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _randomise(model: torch.nn.Module, *, seed: int = 0) -> torch.nn.Module:
    """Every parameter away from its init (norms 1/0, biases and bias tables 0): a dropped or
    misplaced one shows; the position bias large enough to matter."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "relative_position_bias_table" in name:
                p.normal_(0, 1.0)
            elif "norm" in name:
                p.normal_(1.0, 0.2) if name.endswith("weight") else p.normal_(0, 0.2)
            else:
                p.normal_(0, 0.05)
    return model.eval()


def _spec(config, *, classes: int = 5, name: str = "test-model") -> VariantSpec:
    categories = tuple(f"class {i}" for i in range(classes)) if classes else None
    return VariantSpec(name=name, config=config, preprocessing=Preprocessing(image_size=config.image_size), categories=categories,
                       source="test", weights="random")


def _ours(kind: dict, *, classes: int = 5, seed: int = 0) -> Swin:
    model = _randomise(Swin(SwinConfig(patch_size=4, num_classes=classes, **kind)), seed=seed)
    model.spec = _spec(model.config, classes=classes)
    return model


def _timm_windows(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """timm's own window softmax outputs, one per block (the zoo's reading of them)."""
    from vitviz.dev.zoo import timm_window_attention

    return timm_window_attention(model, x)


@pytest.mark.parametrize("kind", [SHIFTED, PADDED], ids=["shifted", "padded"])
def test_from_timm_gives_timms_logits_and_window_softmax(kind):
    timm = pytest.importorskip("timm")
    size = kind["image_size"]
    model = _randomise(timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=size, num_classes=7,
                                         **{k: v for k, v in kind.items() if k != "image_size"}))
    ours = vitviz.from_timm(model)
    assert isinstance(ours, Swin) and ours.spec.name == f"timm:swin_tiny_patch4_window7_224@{size}"
    assert ours.spec.categories == tuple(f"class {i}" for i in range(7)) and ours.spec.preprocessing.interpolation == "bicubic"
    x = torch.randn(2, 3, size, size)
    with torch.inference_mode():
        want = model(x)
        with vitviz.record_attention(ours) as rec:
            got = ours(x)
        fused = ours(x)  # nobody records: the fused path
    assert want.abs().max() > 1e-2 and _relative(got, want) < 1e-4
    assert (fused - got).abs().max() < 1e-5
    theirs = _timm_windows(model, x)
    geometries = ours.geometries(size, size)
    assert len(theirs) == len(rec.calls[-1]) == 6
    for mine, timms, g in zip(rec.calls[-1], theirs, geometries):
        assert mine.shape == timms.shape == (2 * g.num_windows, mine.shape[1], g.area, g.area)
        torch.testing.assert_close(mine, timms, atol=1e-5, rtol=0)
    # the border masks matter: a shifted layer masks pairs inside its windows, and timm's softmax gives them ~0
    shifted = [l for l, g in enumerate(geometries) if g.shifted]
    assert shifted == [1, 3]
    mask = geometries[1].mask()
    assert (mask == -100).any() and (mask == 0).any()
    masked = theirs[1].reshape(2, -1, *theirs[1].shape[1:]) * (mask != 0)[None, :, None]  # [B, windows, heads, M², M²]
    assert masked.max() < 1e-30
    if kind is PADDED:
        assert geometries[0].padded == (12, 12) and geometries[2].padded == (8, 8) and geometries[4].grid == (3, 3)


def _hf_swin(kind: dict, *, classifier: bool = True, classes: int = 5):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.SwinConfig(patch_size=4, num_labels=classes, attn_implementation="eager", **kind)
    model = transformers.SwinForImageClassification(cfg) if classifier else transformers.SwinModel(cfg)
    return _randomise(model)


def _hf_run(model, ours, x, attention: str):
    """transformers' outputs (with attentions), vitviz's outputs and recording, and each of
    transformers' `attention` modules' window softmax as it returns it, on `x`."""
    caught = []
    handles = [m.register_forward_hook(lambda mod, i, o: caught.append(o[1])) for m in model.modules() if type(m).__name__ == attention]
    try:
        with torch.inference_mode():
            out = model(pixel_values=x, output_attentions=True)
            with vitviz.record_attention(ours) as rec:
                got = ours(x)
    finally:
        for h in handles:
            h.remove()
    return out, got, rec, caught


@pytest.mark.parametrize("kind", ["classifier-shifted", "classifier-padded", "features"])
def test_from_transformers_gives_the_same_logits_and_window_softmax(kind):
    # transformers shrinks a window larger than its grid but keeps the full bias table (it cannot run that), so the
    # padded case has two stages: grids 10 and 5, both padded to whole windows (before the shift, as transformers does)
    shape = {"classifier-shifted": SHIFTED, "features": SHIFTED, "classifier-padded": dict(PADDED, depths=(2, 2), num_heads=(2, 4))}[kind]
    model = _hf_swin(shape, classifier=kind != "features")
    ours = vitviz.from_transformers(model)
    assert isinstance(ours, Swin) and ours.config.pad_before_shift
    size = shape["image_size"]
    x = torch.randn(2, 3, size, size)
    out, got, rec, caught = _hf_run(model, ours, x, "SwinAttention")
    want = out.logits if kind != "features" else out.pooler_output
    assert _relative(got, want) < 1e-4
    mine = rec.calls[-1]
    assert len(caught) == len(mine) == sum(shape["depths"])
    for a, b in zip(mine, caught):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # output_attentions: the last block of each stage
    last = [sum(shape["depths"][: s + 1]) - 1 for s in range(len(shape["depths"]))]
    for l, theirs in zip(last, out.attentions):
        torch.testing.assert_close(mine[l], theirs, atol=1e-5, rtol=0)
    if kind == "features":
        assert ours.spec.categories is None
    else:
        assert ours.spec.categories == tuple(f"LABEL_{i}" for i in range(5))


# ---------------------------------------------------------------------------------------------
# global attention


def _timm_regions(padded: tuple[int, int], window: tuple[int, int], shift: tuple[int, int]) -> torch.Tensor:
    """timm's `img_mask` of a shifted layer, by its own slice loop: the region of each cell [Hp, Wp]."""
    regions = torch.zeros(padded, dtype=torch.long)
    count = 0
    for h in ((0, -window[0]), (-window[0], -shift[0]), (-shift[0], None)):
        for w in ((0, -window[1]), (-window[1], -shift[1]), (-shift[1], None)):
            regions[h[0]:h[1], w[0]:w[1]] = count
            count += 1
    return regions


def _dense_attention(block, x_normed: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """The block's attention over every pair of its stage's tokens, from first principles: q k^T /
    sqrt(d) + the bias of the two tokens' offset in the rolled grid, -inf where they are in different
    windows of the rolled grid or in different regions of timm's mask; softmax. [B, heads, N, N]."""
    attn = block.attn
    gh, gw = grid
    (wh, ww), (sh, sw) = block.window, block.shift
    b, n = x_normed.shape[0], gh * gw
    qkv = attn.qkv(x_normed.reshape(b, n, -1)).reshape(b, n, 3, attn.heads, -1).permute(2, 0, 3, 1, 4)
    logits = (qkv[0] @ qkv[1].transpose(-2, -1)) * attn.scale  # [B, heads, N, N]
    r, c = torch.arange(n) // gw, torch.arange(n) % gw
    rr, cc = (r - sh) % gh, (c - sw) % gw  # where torch.roll(-shift) puts each token
    window = (rr // wh) * (gw // ww) + cc // ww
    region = _timm_regions((gh, gw), (wh, ww), (sh, sw))[rr, cc] if sh or sw else torch.zeros(n, dtype=torch.long)
    offset = ((rr % wh)[:, None] - (rr % wh)[None, :] + wh - 1) * (2 * ww - 1) + ((cc % ww)[:, None] - (cc % ww)[None, :] + ww - 1)
    same = (window[:, None] == window[None, :]) & (region[:, None] == region[None, :])
    bias = attn.relative_position_bias_table[offset].permute(2, 0, 1)  # [heads, N, N]
    logits = torch.where(same, logits + bias, torch.tensor(float("-inf")))
    return logits.softmax(dim=-1)


def test_window_to_global_is_the_dense_attention_of_each_layer():
    """Each layer's window attention, made global, against the same layer computed densely over all
    N x N pairs with everything outside the query's shifted window (and its mask region) at -inf."""
    model = _ours(SHIFTED)
    x = torch.randn(2, 3, 64, 64)
    inputs = []
    handles = [b.norm1.register_forward_hook(lambda m, i, o: inputs.append(o)) for b in model.blocks]
    try:
        with torch.inference_mode(), vitviz.record_attention(model) as rec:
            model(x)
    finally:
        for h in handles:
            h.remove()
    for l, (block, g) in enumerate(zip(model.blocks, model.geometries(64, 64))):
        got = window_to_global(rec.calls[-1][l], g)
        with torch.inference_mode():
            want = _dense_attention(block, inputs[l], g.grid)
        assert got.shape == want.shape == (2, block.attn.heads, g.num_tokens, g.num_tokens)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        torch.testing.assert_close(got.sum(-1), torch.ones(got.shape[:-1]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", [SHIFTED, PADDED], ids=["shifted", "padded"])
def test_global_attention_rows_sum_to_one_and_nothing_leaves_the_window(kind):
    model = _ours(kind)
    size = kind["image_size"]
    image = (np.random.default_rng(0).random((size + 9, size + 3, 3)) * 255).astype(np.uint8)
    result = vitviz.analyze(model, image)
    assert isinstance(result, SwinAnalysis) and result.layout.attention == "windowed" and result.layout.pooled_query
    assert result.layout.grids == model.stage_grids(size, size) and not result.layout.position_embeddings
    padding_seen = []
    for l in range(result.num_layers):
        g = result.geometries[l]
        a = result.global_attention(l)  # [heads, N, N]
        gh, gw = g.grid
        outside = torch.stack([~result.window_of(l, i // gw, i % gw).flatten() for i in range(gh * gw)])  # [N, N]
        assert (a[:, outside] == 0).all()
        assert outside.sum(1).min() >= gh * gw - g.area  # at most M² cells visible
        rows = a.sum(-1)
        if g.padded == g.grid:
            torch.testing.assert_close(rows, torch.ones_like(rows), atol=1e-5, rtol=0)
        else:  # the rest is the padding's, which the window attention holds
            win = result.attentions[l]
            tokens = g.window_tokens()
            padding_mass = (win * (tokens < 0)[:, None, None, :]).sum(-1)  # [windows, heads, M²]
            window, place = g.placement()
            torch.testing.assert_close(rows + padding_mass[window, :, place].T, torch.ones_like(rows), atol=1e-5, rtol=0)
            padding_seen.append(padding_mass[window, :, place].max().item())
    if kind is PADDED:  # the padding takes a real share in unshifted layers (a shifted one's mask sets it apart here)
        assert max(padding_seen) > 1e-2


def test_the_window_of_a_shifted_query_by_hand():
    """Stage 1 of SHIFTED: an 8 x 8 grid, windows of 4, rolled by 2. Worked by hand: (0, 0) rolls to
    (6, 6), in the bottom-right window of the rolled grid with rows and columns 4-7 = original 6, 7,
    0, 1; the mask keeps its own region, original rows and columns 0-1. (3, 3) rolls to (1, 1): the
    window of original rows and columns 2-5, one region. (2, 7) rolls to (0, 5): rows 2-5, and of
    columns 6, 7, 0, 1 the region of 6, 7."""
    model = _ours(SHIFTED)
    result = vitviz.analyze(model, (np.random.default_rng(1).random((64, 64, 3)) * 255).astype(np.uint8))
    assert result.geometries[3].grid == (8, 8) and result.shifts[3] == (2, 2) and result.shifts[2] == (0, 0)

    def cells(rows, cols):
        out = torch.zeros(8, 8, dtype=torch.bool)
        out[np.ix_(rows, cols)] = True
        return out

    assert torch.equal(result.window_of(3, 0, 0), cells([0, 1], [0, 1]))
    assert torch.equal(result.window_of(3, 3, 3), cells([2, 3, 4, 5], [2, 3, 4, 5]))
    assert torch.equal(result.window_of(3, 2, 7), cells([2, 3, 4, 5], [6, 7]))
    assert torch.equal(result.window_of(2, 2, 7), cells([0, 1, 2, 3], [4, 5, 6, 7]))  # not shifted: the plain window
    # the relative position bias: entry (query place, key place) is the table's row of their offset
    bias, table = result.relative_position_bias(3), model.blocks[3].attn.relative_position_bias_table.detach()
    assert bias.shape == (4, 16, 16)
    q, k = 1 * 4 + 2, 3 * 4 + 0  # places (1, 2) and (3, 0): offset (-2, 2) -> row (-2 + 3) * 7 + (2 + 3)
    torch.testing.assert_close(bias[:, q, k], table[1 * 7 + 5])


# ---------------------------------------------------------------------------------------------
# the merge map, rollout and relevance through the merges


def test_merge_map_by_hand():
    q = 0.25
    want = torch.tensor([
        # children in raster order of the 4 x 4 grid: (0,0) (0,1) (0,2) (0,3) (1,0) ... (3,3)
        [q, q, 0, 0, q, q, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # merged (0, 0): rows 0-1, columns 0-1
        [0, 0, q, q, 0, 0, q, q, 0, 0, 0, 0, 0, 0, 0, 0],  # merged (0, 1): rows 0-1, columns 2-3
        [0, 0, 0, 0, 0, 0, 0, 0, q, q, 0, 0, q, q, 0, 0],  # merged (1, 0): rows 2-3, columns 0-1
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, q, q, 0, 0, q, q],  # merged (1, 1): rows 2-3, columns 2-3
    ])
    assert torch.equal(merge_map((4, 4)), want)
    # an odd grid: 3 x 3 -> 2 x 2, the border tokens merge with the zero padding: equal shares of what exists
    h = 0.5
    odd = torch.tensor([
        [q, q, 0, q, q, 0, 0, 0, 0],
        [0, 0, h, 0, 0, h, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, h, h, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 1],
    ])
    assert torch.equal(merge_map((3, 3)), odd)


def test_a_two_stage_rollout_is_the_product_with_the_hand_merge_map():
    """16 x 16 px, P 4, M 4 covering stage 0 (a 4 x 4 grid), then a 2 x 2 stage: rollout is
    Â_3 Â_2 M Â_1 Â_0 with M the matrix of `test_merge_map_by_hand`."""
    model = _ours(dict(image_size=16, embed_dim=8, depths=(2, 2), num_heads=(2, 2), window_size=4))
    result = vitviz.analyze(model, (np.random.default_rng(2).random((16, 16, 3)) * 255).astype(np.uint8))
    assert result.stage_grids == ((4, 4), (2, 2))
    q = 0.25
    m = torch.tensor([[q, q, 0, 0, q, q, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], [0, 0, q, q, 0, 0, q, q, 0, 0, 0, 0, 0, 0, 0, 0],
                      [0, 0, 0, 0, 0, 0, 0, 0, q, q, 0, 0, q, q, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, q, q, 0, 0, q, q]], dtype=torch.float64)
    hats = []
    for l in range(4):
        a = result.attentions[l][0].double().mean(0)  # one window: the whole grid, raster order
        hat = a + torch.eye(a.shape[0], dtype=torch.float64)
        hats.append(hat / hat.sum(-1, keepdim=True))
    want = hats[3] @ hats[2] @ m @ hats[1] @ hats[0]  # [4, 16]
    torch.testing.assert_close(result.rollout().double(), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(result.cls_map().double(), want.mean(0).reshape(4, 4), atol=1e-6, rtol=0)


def _dense_through(attn, grads, geometries, stages, *, rule):
    """Dense reference: the global matrices of every layer (`window_to_global`) and `merge_map`,
    multiplied first layer first in float64: rollout R <- rownorm(mean_h A + I) R, or Chefer's
    R <- R + mean_h (G ⊙ A)⁺ R; R <- M R between stages."""
    r = None
    for l, g in enumerate(geometries):
        a = window_to_global(attn[l].double(), g)  # [B, H, N, N]
        if r is None:
            r = torch.eye(g.num_tokens, dtype=torch.float64).expand(a.shape[0], -1, -1)
        elif stages[l] != stages[l - 1]:
            r = merge_map(geometries[l - 1].grid, dtype=torch.float64) @ r
        eye = torch.eye(g.num_tokens, dtype=torch.float64)
        if rule == "rollout":
            hat = a.mean(1) + eye
            r = (hat / hat.sum(-1, keepdim=True)) @ r
        else:
            cam = (window_to_global(grads[l].double(), g) * a).clamp(min=0).mean(1)
            r = r + cam @ r
    return r


@pytest.mark.parametrize("slice_elements", [2**22, 50], ids=["whole", "sliced"])
@pytest.mark.parametrize("kind", [SHIFTED, PADDED], ids=["shifted", "padded"])
def test_rollout_and_relevance_equal_the_dense_products(kind, slice_elements, monkeypatch):
    # "sliced": Q's columns go through the layers in slices of one or two columns, a step after each
    # layer of each slice, and the products are the same
    monkeypatch.setattr(vitviz.swin_global, "SLICE_ELEMENTS", slice_elements)
    stepped = []
    model = _ours(kind, classes=5, seed=3)
    with torch.no_grad():
        model.head.weight.mul_(100)  # gradients large enough that relevance moves away from the merges alone
    size = kind["image_size"]
    x = torch.randn(2, 3, size, size, requires_grad=True)
    with vitviz.record_attention(model, gradients=True) as rec:
        logits = model(x)
        logits[:, 2].sum().backward()
    attn, grads = rec.calls[-1], rec.grad_calls[-1]
    geometries, stages = model.geometries(size, size), model.layer_stages
    want = _dense_through(attn, grads, geometries, stages, rule="rollout")
    with vitviz.steps.between_steps(lambda: stepped.append(1)):
        got = vitviz.swin_analysis.swin_rollout(attn, geometries, stages)
    slices = -(-geometries[-1].num_tokens // max(1, slice_elements // geometries[0].num_tokens))
    assert len(stepped) == slices * len(geometries) and (slices > 1) == (slice_elements == 50)
    assert got.shape == want.shape == (2, geometries[-1].num_tokens, geometries[0].num_tokens)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.sum(-1), torch.ones(got.shape[:-1]), atol=1e-5, rtol=0)
    want = _dense_through(attn, grads, geometries, stages, rule="add")
    got = swin_gradient_relevance(attn, grads, geometries, stages)
    merges_alone = merge_map(geometries[2].grid, dtype=torch.float64) @ merge_map(geometries[0].grid, dtype=torch.float64)
    assert (want - merges_alone).abs().max() > 5e-3  # what the layers add (1/16 is the largest entry of the merges)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)
    # the public maps: the pooled query's row (the mean of the final tokens' rows), on the finest grid
    maps, targets, _ = vitviz.relevance_maps(model, x.detach(), methods=["gradient", "rollout"], targets=[2, 2])
    assert targets.tolist() == [2, 2]
    torch.testing.assert_close(maps["gradient"].double(), want.mean(1).reshape(2, *geometries[0].grid).float().double(), atol=1e-5, rtol=1e-5)
    one = swin_relevance(model, x[1].detach(), target=2)
    torch.testing.assert_close(one, maps["gradient"][1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", [SHIFTED, PADDED], ids=["shifted", "padded"])
def test_distances_equal_the_dense_mean_attention_distance_of_each_stage(kind):
    model = _ours(kind)
    result = vitviz.analyze(model, (np.random.default_rng(4).random((80, 80, 3)) * 255).astype(np.uint8))
    for renormalize in (True, False):
        got = result.distances(renormalize=renormalize)
        for l, g in enumerate(result.geometries):
            want = mean_attention_distance(result.global_attention(l)[None], patch_size=4 * 2 ** result.stages[l], num_prefix_tokens=0,
                                           grid=g.grid, renormalize=renormalize)[0]
            assert got[l].shape == (result.heads(l),)
            torch.testing.assert_close(got[l], want, atol=1e-4, rtol=1e-5)
    # a query never looks further than its window: at most the window's diagonal, in the stage's pixels
    for l, g in enumerate(result.geometries):
        assert result.distances()[l].max() <= math.hypot(*g.window) * 4 * 2 ** result.stages[l]


@pytest.mark.parametrize("kind", [SHIFTED, PADDED], ids=["shifted", "padded"])
def test_attention_received_and_token_norms_equal_the_dense_matrix_and_a_forward_by_hand(kind):
    from einops import rearrange

    from vitviz.analysis import attention_received
    from vitviz.preprocess import to_input

    model = _ours(kind)
    result = vitviz.analyze(model, (np.random.default_rng(5).random((80, 80, 3)) * 255).astype(np.uint8))
    received = result.attention_received()
    for l, g in enumerate(result.geometries):
        want = attention_received(result.global_attention(l)[None]).mean(dim=1)[0]  # [N_s]: over queries, heads averaged
        assert received[l].shape == (g.grid[0] * g.grid[1],)
        torch.testing.assert_close(received[l], want, atol=1e-6, rtol=1e-5)
    sums = torch.stack([r.sum() for r in received])
    if kind is PADDED:  # a padded stage's rows give the padding a share
        assert (sums < 1 - 1e-3).any() and (sums <= 1 + 1e-6).all()
    else:
        torch.testing.assert_close(sums, torch.ones_like(sums))
    # the norms: each block's output, from a forward written out here
    with torch.inference_mode():
        x = model.patch_norm(rearrange(model.patch_embed(to_input(result.image, model.spec.preprocessing)[None]), "b c h w -> b h w c"))
        want = []
        for stage in model.stages:
            x = stage.merge(x) if stage.merge is not None else x
            for block in stage.blocks:
                x = block(x)
                want.append(x[0].norm(dim=-1).flatten())
    assert len(result.token_norms) == len(want) == result.num_layers
    for got, w in zip(result.token_norms, want):
        torch.testing.assert_close(got, w)


# ---------------------------------------------------------------------------------------------
# one window covering the grid: a plain ViT


def _plain_pair(*, depth: int = 3, heads: int = 4, width: int = 32):
    """A one-stage Swin whose window covers its 4 x 4 grid (nothing shifts, nothing merges) with a zero
    position bias, and the plain ViT with the same weights: mean pooling, no cls token, zero position
    embeddings, the patch norm as the norm before the blocks."""
    config = SwinConfig(image_size=16, patch_size=4, embed_dim=width, depths=(depth,), num_heads=(heads,), window_size=7, num_classes=5)
    swin = _randomise(Swin(config))
    with torch.no_grad():
        for block in swin.blocks:
            block.attn.relative_position_bias_table.zero_()
    swin.spec = _spec(config)
    vc = ViTConfig(image_size=16, patch_size=4, width=width, depth=depth, heads=heads, mlp_dim=4 * width, num_classes=5, class_token=False,
                   pool="avg", norm_pre=True, eps=1e-5)
    vit = vitviz.ViT(vc).eval()
    sd = {"patch_embed.proj.weight": swin.patch_embed.weight, "patch_embed.proj.bias": swin.patch_embed.bias,
          "pos_embed": torch.zeros_like(vit.pos_embed), "norm_pre.weight": swin.patch_norm.weight, "norm_pre.bias": swin.patch_norm.bias,
          "norm.weight": swin.norm.weight, "norm.bias": swin.norm.bias, "head.weight": swin.head.weight, "head.bias": swin.head.bias}
    for i, block in enumerate(swin.blocks):
        sd |= {f"blocks.{i}.{k}": v for k, v in block.state_dict().items() if "relative_position" not in k}
    vit.load_state_dict(sd)
    vit.spec = _spec(vc)
    return swin, vit


def test_a_one_window_swin_is_the_plain_vit_it_holds():
    swin, vit = _plain_pair()
    g = swin.geometries(16, 16)
    assert all(x.window == (4, 4) and not x.shifted and x.num_windows == 1 for x in g) and len(swin.stages) == 1
    image = (np.random.default_rng(5).random((37, 29, 3)) * 255).astype(np.uint8)
    x = vitviz.preprocess(vitviz.load_image(image), swin.spec.preprocessing)[0][None]
    with torch.inference_mode():
        assert vit(x).abs().max() > 1e-2 and (swin(x) - vit(x)).abs().max() < 1e-6
    for method in ("rollout", "gradient", "attention", "grad_rollout"):
        for target in (None, 3):
            plain = vitviz.explain(vit, image, method=method, target=target)
            ours = vitviz.explain(swin, image, method=method, target=target)
            assert ours.map.shape == plain.map.shape == (4, 4) and ours.target == plain.target
            assert plain.map.abs().max() > 1e-3 and (ours.map - plain.map).abs().max() < 1e-6, method
    plain, ours = vitviz.analyze(vit, image), vitviz.analyze(swin, image)
    assert (ours.cls_map() - plain.cls_map()).abs().max() < 1e-6
    assert (torch.stack(ours.distances()) - plain.distances()).abs().max() < 1e-4
    assert (ours.global_attention(2) - plain.attentions[2]).abs().max() < 1e-6
    assert ours.predictions(2) == plain.predictions(2)
    assert (swin_relevance(swin, image, target=3) - vitviz.explain(vit, image, method="gradient", target=3).map).abs().max() < 1e-6


def test_what_a_swin_cannot_do_is_refused_clearly():
    swin, _ = _plain_pair(depth=1)
    image = (np.random.default_rng(6).random((16, 16, 3)) * 255).astype(np.uint8)
    with pytest.raises(ValueError, match="'legrad' cannot run on a Swin"):
        vitviz.explain(swin, image, method="legrad")
    with pytest.raises(ValueError, match="discard_ratio is not defined for windowed attention"):
        vitviz.explain(swin, image, method="rollout", discard_ratio=0.5)
    with pytest.raises(ValueError, match="unknown class"):
        vitviz.explain(swin, image, method="gradient", target="no such class")
    bare = Swin(swin.config)
    with pytest.raises(ValueError, match="has no VariantSpec"):
        vitviz.analyze(bare, image)


def test_a_batch_gives_each_image_its_own_maps_and_the_fused_path_the_same_output():
    model = _ours(SHIFTED, seed=7)
    x = torch.randn(3, 3, 64, 64)
    maps, targets, probs = vitviz.relevance_maps(model, x, methods=["gradient", "rollout", "attention"], targets=[0, "class 4", None])
    assert targets.tolist()[:2] == [0, 4] and targets[2] == probs[2].argmax()
    for i in range(3):
        one, _, _ = vitviz.relevance_maps(model, x[i:i + 1], methods=["gradient", "rollout", "attention"], targets=[int(targets[i])])
        for m in one:
            torch.testing.assert_close(one[m][0], maps[m][i], atol=1e-6, rtol=1e-5)
    with torch.inference_mode():
        fused = model(x)
        with vitviz.record_attention(model):
            explicit = model(x)
    assert (fused - explicit).abs().max() < 1e-5
    assert all(not b.attn.attend._forward_hooks for b in model.blocks)  # no hook left behind


# ---------------------------------------------------------------------------------------------
# loading by name, offline


def _run(code: str, hf_home: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.mark.slow
def test_load_model_reads_timm_and_hugging_face_swins_from_the_hub_cache_offline(tmp_path):
    timm = pytest.importorskip("timm")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save

    name = "swin_tiny_patch4_window7_224"
    model = _randomise(timm.create_model(name, pretrained=False), seed=8)
    write_hub_cache(tmp_path / "hf" / "hub", f"timm/{name}.ms_in1k", {"model.safetensors": save(model.state_dict())})
    headless = tmp_path / "ten_classes.safetensors"  # a fine-tuned checkpoint of 10 classes, named by its architecture
    tuned = _randomise(timm.create_model(name, pretrained=False, num_classes=10), seed=9)
    (headless).write_bytes(save(tuned.state_dict()))
    hf = _hf_swin(SHIFTED)
    repo = "vitviz-test/tiny-swin"
    snap = write_hub_cache(tmp_path / "hf" / "hub", repo, {})
    hf.save_pretrained(snap)
    transformers.ViTImageProcessor(size={"height": 64, "width": 64}, resample=3).save_pretrained(snap)
    x224, x64 = torch.randn(1, 3, 224, 224), torch.randn(1, 3, 64, 64)
    torch.save({"x224": x224, "x64": x64}, tmp_path / "x.pt")
    with torch.inference_mode():
        torch.save({"timm": model(x224), "tuned": tuned(x224), "hf": hf(pixel_values=x64).logits}, tmp_path / "want.pt")
    code = f"""
import torch, vitviz
x, want = torch.load({str(tmp_path / "x.pt")!r}), torch.load({str(tmp_path / "want.pt")!r})
rel = lambda got, w: ((got - w).abs().max() / w.abs().max()).item()
assert vitviz.weights_status("timm:{name}") == "cached"
m = vitviz.load_model("timm:{name}", device="cpu")
t = vitviz.load_model("timm:{name}", device="cpu", weights_path={str(headless)!r})
h = vitviz.load_model("hf:{repo}", device="cpu")
with torch.inference_mode():
    print(type(m).__name__, rel(m(x["x224"]), want["timm"]), m.spec.categories[0].split(",")[0], m.spec.preprocessing.resize_size)
    print(type(t).__name__, rel(t(x["x224"]), want["tuned"]), len(t.spec.categories))
    print(type(h).__name__, rel(h(x["x64"]), want["hf"]), h.spec.preprocessing.mode, h.spec.preprocessing.interpolation, h.spec.name)
r = vitviz.analyze(m, torch.randint(0, 256, (250, 300, 3), dtype=torch.uint8).numpy())
print(r.layout.grids, r.window_sizes[-1], r.cls_map().shape)
"""
    out = _run(code, tmp_path / "hf")
    assert out.returncode == 0, out.stderr[-3000:]
    timm_line, tuned_line, hf_line, layout_line = out.stdout.strip().split("\n")
    kind, rel, first, resize = timm_line.split()
    assert kind == "Swin" and float(rel) < 1e-4 and first == "tench" and resize == str(math.floor(224 / 0.9))
    kind, rel, classes = tuned_line.split()
    assert kind == "Swin" and float(rel) < 1e-4 and classes == "10"
    kind, rel, mode, interpolation, spec_name = hf_line.split()
    assert kind == "Swin" and float(rel) < 1e-4 and mode == "squash" and interpolation == "bicubic" and spec_name == f"hf:{repo}"
    assert layout_line == "((56, 56), (28, 28), (14, 14), (7, 7)) (7, 7) torch.Size([56, 56])"


# 40 px, P 4, M 2: grids 10 and 5; the last stage's 5 x 5 grid is padded to 6 x 6 and its second block shifted by 1
LAST_SHIFTED = dict(image_size=40, embed_dim=16, depths=(2, 2), num_heads=(2, 4), window_size=2)


def test_the_last_stages_lens_and_attribution_by_hand_token_by_token():
    """The lens and direct logit attribution read through the pooled mean of the last stage: each
    head's part of the logit computed another way, token by token from its window's recorded
    attention over the values (a padded place's value is v's bias: the norm's output padded with
    zeros), put through W_O, centred, divided by each final token's σ, scaled by γ, averaged over the
    tokens and read by the head's row; the parts add up to the logit; each lens row is the head
    applied to the stream where it was recorded."""
    model = _ours(LAST_SHIFTED, seed=3)
    g_last = model.geometries(40, 40)[-1]
    assert g_last.shifted and g_last.padded != g_last.grid
    image = (np.random.default_rng(7).random((44, 52, 3)) * 255).astype(np.uint8)
    a = vitviz.analyze(model, image)
    x = vitviz.preprocess(vitviz.load_image(image), model.spec.preprocessing)[0][None]
    stage = model.stages[-1]
    seen: dict[int, torch.Tensor] = {}
    hooks = [b.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[0].detach())) for i, b in enumerate(stage.blocks)]
    hooks.append(stage.blocks[-1].register_forward_hook(lambda m, args, out: seen.__setitem__("out", out.detach())))
    with torch.no_grad():
        logits = model(x)[0].double()
    for h in hooks:
        h.remove()
    target = int(logits.argmax())
    parts = a.logit_attribution()
    first = len(model.blocks) - len(stage.blocks)
    assert parts.target == target and parts.first_layer == first == 2
    assert abs(parts.total() - float(logits[target])) < 1e-5 and abs(float(parts.logit) - float(logits[target])) < 1e-5

    final = seen["out"][0].flatten(0, 1).double()  # [N, D]
    sigma = (final.var(dim=-1, unbiased=False) + model.norm.eps).sqrt()
    gamma, row = model.norm.weight.double(), model.head.weight[target].double()

    def project(part: torch.Tensor) -> float:  # [N, D] -> its share of the logit
        centred = part - part.mean(dim=-1, keepdim=True)
        return float((centred / sigma[:, None] * gamma).mean(dim=0) @ row)

    heads = model.config.num_heads[-1]
    for i, block in enumerate(stage.blocks):
        layer, d = first + i, model.config.dims[-1] // heads
        g, attn = a.geometries[layer], a.attentions[layer].double()  # [W, H, M², M²]
        with torch.no_grad():
            normed = block.norm1(seen[i])[0].flatten(0, 1).double()
            w_v = block.attn.qkv.weight[2 * heads * d:].double()
            b_v = block.attn.qkv.bias[2 * heads * d:].double()
        v = normed @ w_v.T + b_v  # [N, D]
        keys, (window, place) = g.window_tokens(), g.placement()
        values = torch.where((keys >= 0)[..., None], v[keys.clamp(min=0)], b_v)  # [W, M², D]
        w_o = block.attn.proj.weight.double()
        for h in range(heads):
            cols = slice(h * d, (h + 1) * d)
            o = torch.stack([attn[window[t], h, place[t]] @ values[window[t], :, cols] for t in range(g.num_tokens)])  # [N, d]
            assert abs(project(o @ w_o[:, cols].T) - float(parts.heads[i, h])) < 1e-5, (layer, h)

    lens = a.logit_lens(logits=True)
    assert lens.shape == (len(stage.blocks) + 1, 5)
    with torch.no_grad():
        for j, stream in enumerate([seen[0], seen[1], seen["out"]]):
            assert (lens[j] - model.head(model.norm(stream).flatten(1, 2).mean(dim=1))[0]).abs().max() < 1e-5
    assert (a.logit_lens()[-1] - a.probabilities).abs().max() < 1e-6


def test_a_one_window_swins_lens_and_attribution_are_the_plain_vits():
    """The one-window Swin and the plain ViT it holds: the same lens, and the same logit split part
    by part (the embedding, every head, the output biases, the MLPs)."""
    swin, vit = _plain_pair()
    image = (np.random.default_rng(5).random((37, 29, 3)) * 255).astype(np.uint8)
    ours, plain = vitviz.analyze(swin, image), vitviz.analyze(vit, image)
    assert ours.inside.first_layer == 0 and ours.inside.readout == plain.inside.readout == "normed mean"
    assert (ours.logit_lens() - plain.logit_lens()).abs().max() < 1e-6
    mine, theirs = ours.logit_attribution(3), plain.logit_attribution(3)
    for name in ("embedding", "heads", "attn_biases", "mlps", "norm_bias", "logit"):
        assert (getattr(mine, name) - getattr(theirs, name)).abs().max() < 1e-5, name
    assert [r[:3] for r in mine.rows()] == [r[:3] for r in theirs.rows()]


def test_a_swin_v2s_lens_works_and_its_attribution_says_why_not():
    model = _ours(dict(LAST_SHIFTED, version=2), seed=4)
    a = vitviz.analyze(model, (np.random.default_rng(1).random((40, 40, 3)) * 255).astype(np.uint8))
    assert (a.logit_lens()[-1] - a.probabilities).abs().max() < 1e-6
    with pytest.raises(ValueError, match="res-post-norm"):
        a.logit_attribution()
    features = _ours(LAST_SHIFTED, classes=0)
    assert vitviz.analyze(features, np.zeros((40, 40, 3), dtype=np.uint8)).inside is None
