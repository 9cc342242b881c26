"""Models without a cls token that classify from the mean of their patch tokens (timm's "avg" pool,
`vit_medium_patch16_gap_256` and its kind): their query is "pool", the mean of the patch tokens'
rows, in every map, the explorer and the views; models with a cls token keep theirs."""

from pathlib import Path

import numpy as np
import pytest
import torch

import vitviz
from vitviz import cost
from vitviz.analysis import attention_rollout, cls_map, pooled_row, query_row, with_pooled_query
from vitviz.explanations import METHODS, explain, maps_of, record, relevance_maps
from vitviz.faithfulness import perturbation_curves
from vitviz.relevance import dino_head_maps, gradient_relevance, gradient_rollout
from vitviz.server.models import ModelFacts
from vitviz.server.pictures import explorer_data, views

IMAGE = np.random.default_rng(0).integers(0, 256, (80, 72, 3), dtype=np.uint8)


def _with_spec(model: vitviz.ViT, size: int, name: str = "pooled") -> vitviz.ViT:
    model.spec = vitviz.VariantSpec(name=name, config=model.config, preprocessing=vitviz.Preprocessing(size),
                                    categories=tuple(f"class {i}" for i in range(model.config.num_classes)), source="test", weights="random")
    return model.eval()


@pytest.fixture(scope="module")
def tiny():
    """Depth 2, 2 heads, a 2 x 2 patch grid, no cls token, the mean of the patches classified."""
    torch.manual_seed(1)
    return _with_spec(vitviz.ViT(image_size=32, patch_size=16, width=8, depth=2, heads=2, mlp_dim=16, num_classes=3,
                                 class_token=False, pool="avg"), 32)


def _timm_gap(reg_tokens: int = 0):
    import timm

    torch.manual_seed(2)
    tm = timm.create_model("vit_tiny_patch16_224", pretrained=False, class_token=False, global_pool="avg", reg_tokens=reg_tokens,
                           img_size=64, depth=2, num_classes=10).eval()
    with torch.no_grad():  # timm zero-initialises the head: every class would tie
        tm.head.weight.normal_(std=0.02)
        tm.head.bias.normal_(std=0.02)
    return tm


@pytest.fixture(scope="module", params=[0, 2], ids=["gap", "gap-reg2"])
def converted(request):
    tm = _timm_gap(request.param)
    return tm, vitviz.ViT.from_timm(tm).eval()


# ----------------------------------------------------------------------------- hand-worked


def test_pooled_rollout_of_one_layer_by_hand():
    # two patch tokens, no prefix: Â = (A + I) / 2 = [[0.6, 0.4], [0.3, 0.7]], the pooled row their mean
    attn = torch.tensor([[[[0.2, 0.8], [0.6, 0.4]]]])  # [L=1, H=1, N=2, N=2]
    r = attention_rollout(attn, num_prefix_tokens=0)
    torch.testing.assert_close(cls_map(r, grid=(1, 2), num_prefix_tokens=0, token="pool"), torch.tensor([[0.45, 0.55]]))
    # a prefix token is neither averaged nor shown: rows and columns from p on
    m = torch.tensor([[1.0, 0.0, 0.0], [0.2, 0.5, 0.3], [0.4, 0.1, 0.5]])
    torch.testing.assert_close(pooled_row(m, num_prefix_tokens=1), torch.tensor([0.3, 0.3, 0.4]))
    torch.testing.assert_close(cls_map(m, grid=(1, 2), num_prefix_tokens=1, token="pool"), torch.tensor([[0.3, 0.4]]))
    torch.testing.assert_close(with_pooled_query(m, num_prefix_tokens=1), torch.stack([m[0], torch.tensor([0.3, 0.3, 0.4]), m[1], m[2]]))


def test_pooled_rollout_of_a_tiny_vit_by_hand(tiny):
    x = torch.randn(1, 3, 32, 32)
    with torch.inference_mode(), vitviz.record_attention(tiny) as rec:
        tiny(x)
    attn = rec.attentions[:, 0]  # [L, H, N, N]
    assert attn.shape == (2, 2, 4, 4)
    # by hand: heads averaged, identity added, rows normalised, multiplied from the first layer up
    eye = torch.eye(4)
    hats = []
    for layer in attn:
        hat = layer.mean(dim=0) + eye
        hats.append(hat / hat.sum(dim=1, keepdim=True))
    r = hats[1] @ hats[0]
    want = r[:, :].mean(dim=0).reshape(2, 2)  # no prefix: every row is a patch's, every column too
    maps, _, _ = relevance_maps(tiny, x, methods=["rollout"])
    assert torch.equal(maps["rollout"][0], want)
    assert torch.equal(cls_map(attention_rollout(attn, num_prefix_tokens=0), grid=(2, 2), num_prefix_tokens=0, token="pool"), want)
    # the rolled-out pooled row still sums to 1: a mean of rows that do
    torch.testing.assert_close(want.sum(), torch.tensor(1.0))


def test_a_probe_weighted_pooled_row_of_a_stack_is_each_matrix_s_with_no_second_stack():
    """The "pool" row weighted by a probe, of a whole stack [L, H, N, N], is each matrix's, bit for bit,
    and is made without a temporary the size of the stack (the explorer's shared maxima read it for
    SigLIP's whole stack: 918 MB for so400m at 384 px)."""
    import subprocess
    import sys

    torch.manual_seed(3)
    for n in (37, 50, 197):
        m, w = torch.softmax(torch.randn(3, 4, n, n), -1), torch.softmax(torch.randn(n), -1)
        got = pooled_row(m, num_prefix_tokens=1, weights=w)
        assert got.shape == (3, 4, n) and all(torch.equal(got[l], pooled_row(m[l], num_prefix_tokens=1, weights=w)) for l in range(3))
        assert all(torch.equal(got[l, h], pooled_row(m[l, h], num_prefix_tokens=1, weights=w)) for l in range(3) for h in range(4))
        torch.testing.assert_close(got, (w[:, None] * m).sum(dim=-2), rtol=1e-6, atol=1e-7)
    script = (
        "import resource, torch; from vitviz.analysis import pooled_row\n"
        "m, w = torch.rand(12, 12, 400, 400), torch.rand(400)\n"  # 88 MiB
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "pooled_row(m, num_prefix_tokens=1, weights=w)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True,
                         cwd=Path(__file__).resolve().parent.parent)
    assert float(out.stdout) < 20, f"the peak grew by {out.stdout.strip()} MiB for an 88 MiB stack"


def test_the_analysis_of_a_pooled_model_reads_the_pooled_query(tiny):
    a = vitviz.analyze(tiny, IMAGE)
    assert a.prefix_names == () and a.query_names == ("pool",) and a.default_query == "pool" and a.pooled_query
    assert a.num_queries == 5 and [a.query_token(i) for i in range(5)] == ["pool", 0, 1, 2, 3] and a.patch_query(1, 0) == 3
    r = a.rollout()
    torch.testing.assert_close(a.cls_map(), r.mean(dim=0).reshape(2, 2))
    assert torch.equal(a.cls_map(), a.cls_map(token="pool"))
    with pytest.raises(ValueError, match="'pool' as its query"):
        a.cls_map(token=0)
    assert a.distances().shape == (2, 2) and torch.isfinite(a.distances()).all()
    assert "Mean of the patch tokens" in str(vitviz.summary(tiny))


# ----------------------------------------------------------------------------- timm's gap models


def test_a_gap_timm_model_converts_to_the_same_logits(converted):
    tm, m = converted
    assert m.config.pool == "avg" and not m.config.class_token and m.config.query_names[-1] == "pool"
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        torch.testing.assert_close(m(x), tm(x), atol=1e-5, rtol=1e-5)


def test_the_pooled_query_averages_the_tokens_timm_averages(converted):
    tm, m = converted
    x = torch.randn(2, 3, 64, 64)
    p, n = m.num_prefix_tokens, m.num_tokens
    with torch.inference_mode():
        feats = tm.forward_features(x)  # [B, N, D], after the final norm
        # the pooled row of the identity weighs each token the pool takes: 1/M on the patches, 0 on the prefix
        weights = pooled_row(torch.eye(n), num_prefix_tokens=p)
        assert torch.equal(weights[:p], torch.zeros(p)) and torch.allclose(weights[p:], torch.full((n - p,), 1 / (n - p)))
        torch.testing.assert_close(tm.fc_norm(weights @ feats), tm.forward_head(feats, pre_logits=True), atol=1e-5, rtol=1e-5)


def test_every_method_explains_a_gap_model(converted):
    _, m = converted
    torch.manual_seed(3)
    x = torch.randn(2, 3, 64, 64)
    maps, targets, probs = relevance_maps(m, x, targets=[1, None])
    assert set(maps) == set(METHODS) and targets.tolist()[0] == 1 and targets[1] == probs[1].argmax()
    for method, got in maps.items():
        assert got.shape == (2, 4, 4), method
        assert torch.isfinite(got).all(), method
        assert all(float(g.max() - g.min()) > 0 for g in got), method
    # each map is the mean of the patch tokens' rows of its method's matrix, over the patch columns
    rec = record(m, x, targets=[1, None], gradients=True)
    p = m.num_prefix_tokens
    attn, grads = rec.attentions, rec.gradients
    rows = {
        "attention": attn[-1].mean(dim=1),
        "rollout": attention_rollout(attn, num_prefix_tokens=p),
        "gradient": gradient_relevance(attn, grads),
        "grad_rollout": gradient_rollout(attn, grads, num_prefix_tokens=p),
    }
    for method, matrix in rows.items():
        torch.testing.assert_close(maps[method], matrix[:, p:, p:].mean(dim=1).reshape(2, 4, 4), atol=1e-6, rtol=1e-5)
    # the same recording read from another query on request
    if p:
        torch.testing.assert_close(maps_of(rec, ["rollout"], query=0)["rollout"], rows["rollout"][:, 0, p:].reshape(2, 4, 4))
    one = explain(m, IMAGE, method="grad_rollout", target="class 4")
    assert one.map.shape == (4, 4) and one.target == 4 and 0 < one.probability < 1


def test_faithfulness_curves_of_a_gap_model(converted):
    _, m = converted
    x = torch.randn(1, 3, 64, 64)
    maps, targets, _ = relevance_maps(m, x, methods=["gradient"])
    curves = perturbation_curves(m, x, maps["gradient"], targets, steps=4)
    assert curves.deletion.shape == curves.insertion.shape == (1, 5)
    assert torch.isfinite(curves.deletion_auc).all() and torch.isfinite(curves.insertion_auc).all()


def test_the_explorer_and_the_views_of_a_gap_model(converted, tmp_path):
    _, m = converted
    a = vitviz.analyze(m, IMAGE)
    p, n = m.num_prefix_tokens, m.num_tokens
    exp = views.Exploration(a, ModelFacts.of(m))
    assert a.query_names == m.config.prefix_names + ("pool",) and a.num_queries == n + 1
    assert a.query_token(p) == "pool" and a.query_token(p + 1) == p and a.query_token(n) == n - 1
    # the browser's file: a row per query, the pooled one after the prefix tokens'
    layout = explorer_data.layout_of(a)
    assert layout.tokens == n + 1 and layout.patches == 16
    data = explorer_data.stack_file(a, range(2))
    assert len(data) == layout.stack_bytes
    views_ = m.heads + 2
    shared = np.frombuffer(data[: 4 * (n + 1)], "<f4")
    top = np.frombuffer(data[4 * (n + 1) : 4 * (n + 1) + 4 * views_ * (n + 1)], "<f4").reshape(views_, n + 1)
    q8 = np.frombuffer(data[4 * (n + 1) * (1 + views_) : layout.stack_bytes - layout.layer_bytes], np.uint8).reshape(views_, n + 1, 16)
    for q in range(n + 1):
        for h in range(views_):
            np.testing.assert_array_equal(explorer_data.dequantise(q8[h, q], top[h, q]), explorer_data.row_values(a, layer=0, head=h, query=q))
    pooled = a.attentions[:, :, p:, p:].mean(dim=2)  # [L, H, M]: the patch tokens' rows, averaged
    torch.testing.assert_close(torch.from_numpy(top[: m.heads, p].copy()), pooled[0].amax(dim=-1))
    torch.testing.assert_close(torch.from_numpy(top[m.heads, p : p + 1].copy()), pooled[0].mean(dim=0).amax(dim=-1, keepdim=True))
    assert shared[p] == pytest.approx(float(pooled.amax()))
    np.testing.assert_array_equal(np.delete(shared, p), a.attentions[..., p:].amax(dim=(0, 1, 3)).numpy())
    value = explorer_data.write_payload(exp, key="k", folder=tmp_path)
    assert value["prefix"] == list(a.query_names) and value["tokens"] == n + 1

    # the server's views, by query index
    assert views.describe_query(exp, p).startswith("query: the mean of the patch tokens")
    first = views.patch_at(exp, 0, 0)
    assert first == p + 1 and views.describe_query(exp, first) == "query: patch row 1, column 1"
    assert views.describe_query(exp, views.patch_at(exp, 10_000, 10_000)) == "query: patch row 4, column 4"
    for q in (p, first, n):
        views.render_query(exp, layer=2, head="mean", query=q, scale="shared")
        views.render_head_mosaic(exp, layer=1, query=q)
    views.render_rollout(exp)
    views.render_dino_heads(exp)
    views.render_token_norms(exp)
    views.render_received(exp)
    views.render_distance(exp)
    views.render_feature_similarity(exp, query=first)
    with pytest.raises(ValueError, match="pick a patch"):
        views.render_feature_similarity(exp, query=p)
    maps, masks = dino_head_maps(a.attentions, grid=a.grid, num_prefix_tokens=p, query="pool")
    torch.testing.assert_close(maps, pooled[-1].reshape(m.heads, 4, 4))


# ----------------------------------------------------------------------------- models with a cls token


def test_models_with_a_cls_token_keep_the_cls_query():
    torch.manual_seed(4)
    for pool in ("token", "avg"):
        model = _with_spec(vitviz.ViT(image_size=32, patch_size=16, width=8, depth=2, heads=2, mlp_dim=16, num_classes=3, pool=pool), 32)
        assert model.config.query_names == ("cls",) and not model.config.pooled_query
        a = vitviz.analyze(model, IMAGE)
        assert a.query_names == ("cls",) and a.default_query == 0 and a.num_queries == 5
        assert [a.query_token(i) for i in range(5)] == [0, 1, 2, 3, 4] and a.patch_query(0, 0) == 1
        assert torch.equal(a.cls_map(), a.rollout()[0, 1:].reshape(2, 2))
        x = torch.randn(1, 3, 32, 32)
        rec = record(model, x, gradients=True)
        assert rec.query == 0
        got = maps_of(rec, ["attention", "rollout", "gradient", "grad_rollout"])  # what a pass with gradients gives (LeGrad needs layer_gradients)
        r = gradient_relevance(rec.attentions, rec.gradients)
        assert torch.equal(got["gradient"], r[:, 0, 1:].reshape(1, 2, 2))
        assert torch.equal(query_row(r, query=0, num_prefix_tokens=1), r[:, 0])


def test_a_pooled_models_explorer_over_the_browsers_budget_keeps_the_pooled_row(converted, tmp_path, monkeypatch):
    """A layer at a time ("layers") and drawn by the server ("server"), the layout counts the "pool"
    query's row as the stack does: a layer's file is the size its layout says, with every query's
    row, and its price counts it byte for byte."""
    from vitviz.cost import price

    _, m = converted
    a = vitviz.analyze(m, IMAGE)
    exp = views.Exploration(a, ModelFacts.of(m))
    whole = explorer_data.layout_of(a)
    assert whole.mode == "stack" and whole.tokens == a.num_queries == m.num_tokens + 1
    monkeypatch.setattr(cost, "BROWSER_BYTES", 4 * whole.tokens + whole.layer_bytes)
    layout = explorer_data.layout_of(a)
    assert layout == cost.ExplorerLayout("layers", whole.layers, whole.views, whole.tokens, whole.patches)
    value = explorer_data.write_payload(exp, key="k", folder=tmp_path)
    assert value["mode"] == "layers" and value["tokens"] == a.num_queries and "data" not in value
    data = open(explorer_data.write_layer(exp, key="k", layer=2, folder=tmp_path), "rb").read()
    assert len(data) == 4 * layout.tokens + layout.layer_bytes == price(m.spec, "explorer_layer").kept_bytes
    v, q = layout.views, layout.tokens
    top = np.frombuffer(data[4 * q : 4 * q + 4 * v * q], "<f4").reshape(v, q)
    q8 = np.frombuffer(data[4 * q + 4 * v * q :], np.uint8).reshape(v, q, layout.patches)
    for query in range(q):
        for h in range(v):
            np.testing.assert_array_equal(explorer_data.dequantise(q8[h, query], top[h, query]),
                                          explorer_data.row_values(a, layer=1, head=h, query=query))
    monkeypatch.setattr(cost, "BROWSER_BYTES", 4 * whole.tokens + whole.layer_bytes - 1)
    assert explorer_data.layout_of(a) == cost.ExplorerLayout("server", whole.layers, whole.views, whole.tokens, whole.patches)


def _layout_known_before_the_forward(model, monkeypatch) -> None:
    """`cost.explorer_layout_of` (what the server decides before the forward) is `layout_of` the analysis, at
    the browser's budget and at smaller ones, and the price of the explorer's files says the same
    (what is written: the stack, one layer's file, or nothing)."""
    from vitviz.cost import price

    a = vitviz.analyze(model, IMAGE)
    layout = explorer_data.layout_of(a)
    one = 4 * layout.tokens + layout.layer_bytes
    for budget, mode in ((cost.BROWSER_BYTES, layout.mode), (layout.stack_bytes - 1, "layers"), (one, "layers"), (one - 1, "server")):
        monkeypatch.setattr(cost, "BROWSER_BYTES", budget)
        assert cost.explorer_layout_of(model.spec) == explorer_data.layout_of(a), budget
        assert explorer_data.layout_of(a).mode == mode, budget
        written = {"stack": layout.stack_bytes, "layers": one, "server": 0}[mode]
        assert price(model.spec, "explorer").kept_bytes == written, budget
        assert price(model.spec, "explorer_layer").kept_bytes == one


@pytest.mark.parametrize("name", ["shapes_p16", "shapes_p8@288"])
def test_the_layout_known_before_the_forward_is_the_analysis_and_its_price(name, monkeypatch):
    _layout_known_before_the_forward(vitviz.load_model(name, device="cpu"), monkeypatch)


def test_a_pooled_models_layout_known_before_the_forward_is_the_analysis_and_its_price(converted, monkeypatch):
    _layout_known_before_the_forward(converted[1], monkeypatch)


def test_the_price_of_a_pooled_models_explorer_is_the_file_it_writes(converted, tmp_path):
    """The explorer's file holds a row for "pool" too; its price counts it, byte for byte."""
    from vitviz.cost import price

    _, m = converted
    exp = views.Exploration(vitviz.analyze(m, IMAGE), ModelFacts.of(m))
    value = explorer_data.write_payload(exp, key="k", folder=tmp_path)
    assert value["mode"] == "stack"
    written = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file() and f.suffix == ".bin")
    assert price(m.spec, "explorer").kept_bytes == written
