"""open_clip's CLIP through vitviz (when open_clip_torch is installed): a small random model gives
open_clip's own logits and attention; `open_clip:<arch>/<tag>` loads from the Hugging Face cache
offline with the tag's preprocessing and open_clip's tokenizer; what vitviz does not model is refused."""

import numpy as np
import pytest
import torch
from conftest import write_hub_cache

import vitviz
from vitviz.imagetext import ImageTextModel
from vitviz.sources.open_clip import OpenClipTokenizer

open_clip = pytest.importorskip("open_clip")

VISION = dict(layers=2, width=32, head_width=16, patch_size=8, image_size=32, mlp_ratio=2.0)
TEXT = dict(context_length=16, vocab_size=100, width=32, heads=2, layers=2)


def _tiny(*, quick_gelu: bool = True, seed: int = 0):
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    torch.manual_seed(seed)
    model = CLIP(embed_dim=16, vision_cfg=CLIPVisionCfg(**VISION), text_cfg=CLIPTextCfg(**TEXT), quick_gelu=quick_gelu)
    with torch.no_grad():
        for name, p in model.named_parameters():  # every parameter away from its init, so a dropped one shows
            if "ln" in name:
                p.normal_(1.0, 0.2) if name.endswith("weight") else p.normal_(0, 0.2)
            elif name == "logit_scale":
                p.fill_(2.0)
            else:
                p.normal_(0, 0.15)
    return model.eval()


def _ids(seed: int = 1):
    """3 texts of 5, 9 and 3 tokens ending in the highest id (99), padded with 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(3, 16, dtype=torch.long)
    for i, n in enumerate((5, 9, 3)):
        ids[i, : n - 1] = torch.randint(1, 90, (n - 1,), generator=g)
        ids[i, n - 1] = 99
    return ids


def _letters(texts, context_length):
    """A tokenizer for the tiny vocabulary, called as open_clip's: a letter's id (1-26), then 99, padded with 0."""
    ids = torch.zeros(len(texts), context_length, dtype=torch.long)
    for i, text in enumerate(texts):
        letters = [ord(c) - 96 for c in text if c.isalpha()][: context_length - 1]
        ids[i, : len(letters)] = torch.tensor(letters, dtype=torch.long)
        ids[i, len(letters)] = 99
    return ids


def _block_attention(blocks, x):
    """Each block's attention per head, asked of its own nn.MultiheadAttention on its input."""
    seen = []
    for block in blocks:
        h = block.ln_1(x)
        _, w = block.attn(h, h, h, need_weights=True, average_attn_weights=False)
        seen.append(w)
        x = block(x)
    return torch.stack(seen)


@pytest.mark.parametrize("quick_gelu", [True, False])
def test_open_clip_gives_its_own_logits_and_attention(quick_gelu):
    model = _tiny(quick_gelu=quick_gelu)
    ours = vitviz.from_open_clip(model)
    assert isinstance(ours, ImageTextModel) and ours.image.config.act == ("quick_gelu" if quick_gelu else "gelu")
    x, ids = torch.randn(2, 3, 32, 32), _ids()
    with torch.inference_mode():
        image, text, scale = model(x, ids)
        want = scale * image @ text.T
        with vitviz.record_attention(ours) as rec:
            got = ours(x, ids)
        v = model.visual
        tokens = v.conv1(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([v.class_embedding.expand(2, 1, -1), tokens], dim=1) + v.positional_embedding
        attn = _block_attention(v.transformer.resblocks, v.ln_pre(tokens))
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    torch.testing.assert_close(rec.attentions, attn, atol=1e-5, rtol=0)
    with torch.inference_mode():
        torch.testing.assert_close(ours.encode_image(x), model.encode_image(x), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.encode_text(ids), model.encode_text(ids), atol=1e-5, rtol=1e-4)


def test_the_tokenizer_is_open_clips_padded_to_the_context_length():
    ours = vitviz.from_open_clip(_tiny(), tokenizer=open_clip.get_tokenizer("ViT-B-32"))
    ids, mask = ours.tokenize(["a red star", "a photo of a cat"])
    assert mask is None and ids.shape == (2, 16)
    assert torch.equal(ids, open_clip.get_tokenizer("ViT-B-32")(["a red star", "a photo of a cat"], context_length=16))


def test_what_vitviz_does_not_model_is_refused():
    model = _tiny()
    model.text_pool_type = "first"
    with pytest.raises(NotImplementedError, match="reads its text by 'first'"):
        vitviz.from_open_clip(model)
    model = _tiny()
    model.visual.pool_type = "avg"
    with pytest.raises(NotImplementedError, match="pools otherwise"):
        vitviz.from_open_clip(model)
    for bad, match in (("open_clip:ViT-B-32", "open_clip:<architecture>/<pretrained tag>"), ("open_clip:../x/openai", "architecture"),
                       ("open_clip:Nope-1/openai", "no architecture"), ("open_clip:ViT-B-32/nope", "no pretrained weights 'nope'")):
        with pytest.raises(ValueError, match=match):
            vitviz.get_spec(bad)


def test_a_named_model_loads_from_the_hub_cache_offline(no_network, monkeypatch, tmp_path):
    """A tiny architecture and tag registered with open_clip, its weights in the Hugging Face cache:
    open_clip:<arch>/<tag> resolves offline (the tag's preprocessing), loads, and scores as open_clip."""
    import json

    from open_clip import factory, pretrained

    config = dict(embed_dim=16, quick_gelu=True, vision_cfg=VISION, text_cfg=TEXT)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "vitviz-tiny.json").write_text(json.dumps(config))
    open_clip.add_model_config(tmp_path / "cfg")
    repo = "vitviz-test/tiny-open-clip"
    tag = dict(hf_hub=f"{repo}/", mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.4), interpolation="bilinear", resize_mode="shortest", quick_gelu=True)
    monkeypatch.setitem(pretrained._PRETRAINED, "vitviz-tiny", {"tiny": tag})
    model = _tiny(seed=3)
    snap = write_hub_cache(no_network, repo, {})
    torch.save(model.state_dict(), snap / "open_clip_pytorch_model.bin")
    name = "open_clip:vitviz-tiny/tiny"
    try:
        spec = vitviz.get_spec(name)
        assert spec.preprocessing.mean == (0.5, 0.4, 0.3) and spec.preprocessing.interpolation == "bilinear"
        assert vitviz.weights_status(name) == "cached"
        ours = vitviz.load_model(name, device="cpu")
        assert isinstance(ours, ImageTextModel) and len(ours.labels) == 1000
        assert ours.tokenizer.tokenizer.__class__ is open_clip.get_tokenizer("vitviz-tiny").__class__
        ours.tokenizer = OpenClipTokenizer(_letters)  # ids the tiny vocabulary holds
        img = np.random.default_rng(2).integers(0, 256, (40, 48, 3), dtype=np.uint8)
        x = vitviz.preprocess(vitviz.load_image(img), spec.preprocessing)[0][None]
        ids, _ = ours.tokenize(["a cat", "a dog"])
        with torch.inference_mode():
            image, text, scale = model(x, ids)
            torch.testing.assert_close(ours(x, ids), scale * image @ text.T, atol=1e-5, rtol=1e-4)
        e = vitviz.explain(ours, img, method="gradient", text=["a cat", "a dog"])
        assert len(e) == 2 and e[0].map.shape == (4, 4)
    finally:
        factory._MODEL_CONFIGS.pop("vitviz-tiny", None)


def _authors_legrad(model, x, text, *, layer_index: int = -2):
    """LeGrad as its authors compute it on an open_clip CLIP (`LeWrapper.compute_legrad_clip` of pip
    `legrad_torch` 1.1), written here on open_clip's own modules: each block's attention made
    explicitly from its nn.MultiheadAttention weights; for each block from `layer_index` on, the
    mean of all its output tokens through `ln_post` and `proj`, normalised, dotted with the
    normalised text embedding; the gradient of that with respect to that block's attention, positive
    part, mean over heads and query rows, patch columns, upsampled bilinearly to pixels; summed over
    the blocks and min-maxed per image [B, S, S]."""
    v = model.visual
    blocks = list(v.transformer.resblocks)
    start = layer_index % len(blocks)
    b = x.shape[0]
    with torch.enable_grad():
        h = v.conv1(x).flatten(2).transpose(1, 2)
        h = v.ln_pre(torch.cat([v.class_embedding.expand(b, 1, -1), h], dim=1) + v.positional_embedding)
        attentions, outputs = [], []
        for block in blocks:
            mha, y = block.attn, block.ln_1(h)
            heads = mha.num_heads
            q, k, val = torch.nn.functional.linear(y, mha.in_proj_weight, mha.in_proj_bias).chunk(3, dim=-1)
            q, k, val = (t.reshape(b, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, val))
            a = (q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5)).softmax(-1)  # [B, H, N, N]
            o = (a @ val).transpose(1, 2).reshape(b, -1, heads * q.shape[-1])
            h = h + block.ls_1(mha.out_proj(o))
            h = h + block.ls_2(block.mlp(block.ln_2(h)))
            attentions.append(a)
            outputs.append(h)
        text = torch.nn.functional.normalize(text, dim=-1)
        n = attentions[0].shape[-1] - 1
        side = int(n**0.5)
        total = 0
        for l in range(start, len(blocks)):
            image = torch.nn.functional.normalize(v.ln_post(outputs[l].mean(dim=1)) @ v.proj, dim=-1)
            (g,) = torch.autograd.grad((image @ text).sum(), [attentions[l]], retain_graph=True)
            relevance = g.clamp(min=0).mean(dim=1).mean(dim=1)[:, 1:].reshape(b, 1, side, side)
            total = total + torch.nn.functional.interpolate(relevance, scale_factor=v.patch_size[0], mode="bilinear")
    total = total[:, 0]
    low, high = total.amin(dim=(1, 2), keepdim=True), total.amax(dim=(1, 2), keepdim=True)
    return (total - low) / (high - low)


def _pixels(maps, patch_size):
    """vitviz's maps [B, gh, gw] as the authors' pixels: bilinear upsampling, min-maxed again."""
    up = torch.nn.functional.interpolate(maps[:, None], scale_factor=patch_size, mode="bilinear")[:, 0]
    low, high = up.amin(dim=(1, 2), keepdim=True), up.amax(dim=(1, 2), keepdim=True)
    return (up - low) / (high - low)


@pytest.mark.parametrize("layer_index", [-2, 0])
def test_legrad_is_the_authors_legrad_on_open_clip(layer_index):
    """By default (the mean of the tokens, the last two layers) vitviz's LeGrad is the authors' map;
    start_layer=0 sums every layer as their layer_index=0 does."""
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    torch.manual_seed(7)
    model = CLIP(embed_dim=16, vision_cfg=CLIPVisionCfg(**{**VISION, "layers": 4}), text_cfg=CLIPTextCfg(**TEXT), quick_gelu=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.2) if "ln" in name and name.endswith("weight") else p.normal_(0, 0.15)
    model.eval()
    ours = vitviz.from_open_clip(model)
    x, ids = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3)), _ids()
    options = {} if layer_index == -2 else {"start_layer": 0}
    maps, _, _ = vitviz.relevance_maps(ours, x, methods=["legrad"], text=ids, **options)  # [B, T, gh, gw]
    with torch.no_grad():
        texts = model.encode_text(ids)
    for t in range(3):
        want = _authors_legrad(model, x, texts[t], layer_index=layer_index)
        torch.testing.assert_close(_pixels(maps["legrad"][:, t], 8), want, atol=1e-5, rtol=1e-4)
    cls, _, _ = vitviz.relevance_maps(ours, x, methods=["legrad"], text=ids, readout="cls")
    assert (cls["legrad"] - maps["legrad"]).abs().max() > 1e-2  # the cls read-out is another map
