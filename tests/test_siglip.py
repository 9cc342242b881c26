"""SigLIP through vitviz: Hugging Face's `SiglipModel` (small random configs) gives the same
`logits_per_image` and the same attention, blocks and attention-pooling probe alike; the probe's
attention makes the pooled query's row of rollout and of the gradient rule, each checked against a
computation of its own on transformers' forward; zero-shot scores are sigmoids; the hub cache path
offline."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import write_hub_cache

import vitviz
from vitviz.imagetext import ImageTextModel
from vitviz.words import WordTokenizer

transformers = pytest.importorskip("transformers")

TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
            max_position_embeddings=16, projection_size=32, bos_token_id=1, eos_token_id=2, pad_token_id=0)
VISION = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def _siglip(seed: int = 0, kind: str = "Siglip", vision: dict | None = None):
    """A small random `SiglipModel` (or, with kind "Siglip2", a `Siglip2Model` of `vision`), eager."""
    config = getattr(transformers, f"{kind}Config")(text_config=TEXT, vision_config=vision or VISION)
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = "eager"
    model = getattr(transformers, f"{kind}Model")(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # every parameter away from its init, so a dropped one shows
            if "norm" in name:
                p.normal_(1.0, 0.2) if name.endswith("weight") else p.normal_(0, 0.2)
            elif name in ("logit_scale", "logit_bias"):
                p.fill_(2.0 if name == "logit_scale" else -1.5)
            else:
                p.normal_(0, 0.15)
    return model.eval()


def _relative(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def _probe_attention(head, tokens):
    """The probe's attention per head [B, H, N], asked of the head's own `nn.MultiheadAttention`."""
    probe = head.probe.expand(tokens.shape[0], -1, -1)
    _, weights = head.attention(probe, tokens, tokens, need_weights=True, average_attn_weights=False)
    return weights[:, :, 0]


def _hf_pieces(model, x, ids, mask=None):
    """transformers' forward, taken apart so that every attention is a tensor on the graph: the
    blocks' (eager softmax outputs) and the probe's (written out from the head's weights)."""
    vision = model.vision_model
    out = vision(pixel_values=x, output_attentions=True)
    tokens = out.last_hidden_state  # after post_layernorm
    head, d, h = vision.head, VISION["hidden_size"], VISION["num_attention_heads"]
    w, b = head.attention.in_proj_weight, head.attention.in_proj_bias
    q = F.linear(head.probe, w[:d], b[:d]).reshape(1, 1, h, d // h).transpose(1, 2)  # [1, H, 1, d/h]
    k = F.linear(tokens, w[d : 2 * d], b[d : 2 * d]).reshape(x.shape[0], -1, h, d // h).transpose(1, 2)
    v = F.linear(tokens, w[2 * d :], b[2 * d :]).reshape(x.shape[0], -1, h, d // h).transpose(1, 2)
    probe = (q @ k.transpose(-1, -2) / (d // h) ** 0.5).softmax(-1)  # [B, H, 1, N]
    y = head.attention.out_proj((probe @ v).transpose(1, 2).reshape(x.shape[0], 1, d))
    image = (y + head.mlp(head.layernorm(y)))[:, 0]
    text = model.get_text_features(input_ids=ids, attention_mask=mask).pooler_output
    logits = model.logit_scale.exp() * F.normalize(image, dim=-1) @ F.normalize(text, dim=-1).T + model.logit_bias
    return logits, list(out.attentions), probe


def test_siglip_gives_transformers_logits_block_attention_and_probe_attention():
    model = _siglip()
    ours = vitviz.from_transformers(model)
    assert isinstance(ours, ImageTextModel) and ours.image.attn_pool is not None and ours.logit_bias is not None
    assert ours.spec.prefix_names == () and ours.spec.config.pooled_query
    x, ids = torch.randn(2, 3, 32, 32), torch.randint(3, 100, (3, 16))
    with torch.inference_mode():
        out = model(pixel_values=x, input_ids=ids, output_attentions=True)
        with vitviz.record_attention(ours) as rec:
            logits = ours(x, ids)
        hidden = model.vision_model(pixel_values=x).last_hidden_state
        probe = _probe_attention(model.vision_model.head, hidden)
    assert _relative(logits, out.logits_per_image) < 1e-4
    torch.testing.assert_close(rec.attentions, torch.stack(out.vision_model_output.attentions), atol=1e-5, rtol=0)
    assert rec.pool_attention.shape == (2, 4, 16)
    torch.testing.assert_close(rec.pool_attention, probe, atol=1e-5, rtol=0)
    with torch.inference_mode():
        assert _relative(ours.encode_image(x), model.get_image_features(pixel_values=x).pooler_output) < 1e-4
        assert _relative(ours.encode_text(ids), model.get_text_features(input_ids=ids).pooler_output) < 1e-4


def test_the_pooled_query_reads_the_token_rows_through_the_probe():
    """analyze: the rollout's "pool" row is the rows of R = (0.5 A_2 + 0.5 I)(0.5 A_1 + 0.5 I)
    weighted by the probe's attention (mean over its heads), computed here by hand; the explorer's
    pooled row of a layer is that layer's rows so weighted; the attention method's map is the probe's
    own attention (the last attention the pooled query has)."""
    model = _siglip(seed=1)
    ours = vitviz.from_transformers(model)
    img = np.random.default_rng(5).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    a = vitviz.analyze(ours, img)
    x = vitviz.preprocess(vitviz.load_image(img), ours.spec.preprocessing)[0][None]
    with torch.inference_mode():
        out = model.vision_model(pixel_values=x, output_attentions=True)
        probe = _probe_attention(model.vision_model.head, out.last_hidden_state)[0]  # [H, N]
    torch.testing.assert_close(a.pool_attention, probe, atol=1e-5, rtol=0)
    eye = torch.eye(16)
    r = eye
    for layer in out.attentions:
        r = (0.5 * layer[0].mean(0) + 0.5 * eye) @ r
    w = probe.mean(0)
    torch.testing.assert_close(a.cls_map(), (w @ r).reshape(4, 4), atol=1e-5, rtol=0)
    assert a.query_names == ("pool",) and a.default_query == "pool"
    torch.testing.assert_close(vitviz.query_attention(a.attentions, layer=1, query="pool", num_prefix_tokens=0, pool_weights=a.pool_weights),
                               (w @ out.attentions[1][0].mean(0)).reshape(4, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(vitviz.explain(ours, img, method="attention").map, w.reshape(4, 4), atol=1e-5, rtol=0)
    rollout = vitviz.explain(ours, img, method="rollout").map
    torch.testing.assert_close(rollout, (w @ r).reshape(4, 4), atol=1e-5, rtol=0)


def test_the_gradient_rule_for_a_phrase_weights_the_relevance_rows_by_the_probes_relevance():
    """Chefer et al.'s rule over the blocks, R = I + sum over layers of mean_h ReLU(dS/dA * A) @ R,
    then the probe's own step without a residual: map = mean_h ReLU(dS/dP * P) @ R, with S the
    phrase's logit and every attention differentiated on transformers' forward (written out here);
    two phrases in one call equal one at a time."""
    model = _siglip(seed=2)
    ours = vitviz.from_transformers(model)
    ours.tokenizer = WordTokenizer()
    phrases = ["a red star", "a blue circle"]
    ids, mask = ours.tokenize(phrases)
    img = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    x = vitviz.preprocess(vitviz.load_image(img), ours.spec.preprocessing)[0][None]
    got = vitviz.explain(ours, img, method="gradient", text=phrases)
    for t, e in enumerate(got):
        logits, blocks, probe = _hf_pieces(model, x, ids, mask)
        grads = torch.autograd.grad(logits[0, t], blocks + [probe])
        r = torch.eye(16)
        for a, g in zip(blocks, grads[:-1]):
            r = r + (g[0] * a[0]).clamp(min=0).mean(0) @ r
        w = (grads[-1][0, :, 0] * probe[0, :, 0]).clamp(min=0).mean(0)
        torch.testing.assert_close(e.map, (w @ r).reshape(4, 4).detach(), atol=1e-6, rtol=1e-4)
        assert e.text == phrases[t] and abs(e.similarity - logits[0, t].item()) < 1e-4
        alone = vitviz.explain(ours, img, method="gradient", text=phrases[t])
        torch.testing.assert_close(alone.map, e.map, atol=1e-6, rtol=1e-5)
    for method in ("grad_rollout", "legrad", "rollout"):
        maps = vitviz.explain(ours, img, method=method, text=phrases)
        assert all(m.map.shape == (4, 4) and torch.isfinite(m.map).all() for m in maps)


def test_siglip_zero_shot_scores_each_label_by_its_sigmoid():
    model = _siglip(seed=3)
    ours = vitviz.from_transformers(model)
    ours.tokenizer = WordTokenizer()
    img = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    labels = ["red star", "blue circle", "green ring"]
    a = vitviz.analyze(ours, img, labels=labels, template="a {}")
    x = vitviz.preprocess(vitviz.load_image(img), ours.spec.preprocessing)[0][None]
    ids, mask = ours.tokenize([f"a {label}" for label in labels])
    with torch.inference_mode():
        want = model(pixel_values=x, input_ids=ids, attention_mask=mask).logits_per_image[0].sigmoid()
    torch.testing.assert_close(a.probabilities, want, atol=1e-5, rtol=1e-4)
    assert a.categories == tuple(labels)


def test_load_model_reads_a_siglip_repository_from_the_hub_cache_offline(no_network):
    repo = "vitviz-test/tiny-siglip"
    model = _siglip(seed=4)
    snap = write_hub_cache(no_network, repo, {})
    model.save_pretrained(snap)
    transformers.SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(snap)
    ours = vitviz.load_model(f"hf:{repo}", device="cpu")
    assert isinstance(ours, ImageTextModel) and ours.tokenizer is None and ours.labels is None  # no tokenizer saved: no zero-shot
    pre = ours.spec.preprocessing
    assert (pre.mode, pre.image_size) == ("squash", 32) and pre.mean == (0.5, 0.5, 0.5)
    img = np.random.default_rng(2).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    x = vitviz.preprocess(vitviz.load_image(img), pre)[0][None]
    ids = torch.randint(3, 100, (2, 16))
    with torch.inference_mode():
        assert _relative(ours(x, ids), model(pixel_values=x, input_ids=ids).logits_per_image) < 1e-4
    result = vitviz.analyze(ours, img)
    assert result.layout.text and result.probabilities is None and result.pool_attention.shape == (4, 16)
