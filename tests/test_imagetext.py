"""Image–text models (Hugging Face CLIP) through vitviz: the same `logits_per_image` and the same
image-tower attention as transformers' own forward (small random configs, texts of different
lengths with padding), the hub cache path offline, and what the model offers besides."""

import pytest
import torch
from conftest import write_hub_cache

import vitviz
from vitviz.imagetext import ImageTextModel

transformers = pytest.importorskip("transformers")

TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=100,
            max_position_embeddings=16, hidden_act="quick_gelu", bos_token_id=0)
VISION = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
              hidden_act="quick_gelu")
EOS = 99  # the end-of-text token of these tests' texts (and their padding)


def _randomise(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter away from its init (norms 1 and 0, biases 0), so a dropped one shows."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2) if name.endswith("weight") else p.normal_(0, 0.2)
            elif name == "logit_scale":
                p.fill_(2.0)
            else:
                p.normal_(0, 0.1)
    return model.eval()


def _clip(*, eos_token_id: int = EOS, seed: int = 0):
    t = transformers
    config = t.CLIPConfig(text_config=dict(TEXT, eos_token_id=eos_token_id), vision_config=VISION, projection_dim=16)
    config._attn_implementation = "eager"
    for sub in (config.text_config, config.vision_config):
        sub._attn_implementation = "eager"
    return _randomise(t.CLIPModel(config), seed)


def _texts(eos: int = EOS):
    """3 texts of 5, 9 and 3 tokens ending in `eos`, padded with `eos` to 9, and their attention mask."""
    g = torch.Generator().manual_seed(1)
    lengths = (5, 9, 3)
    ids = torch.full((3, 9), eos, dtype=torch.long)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, : n - 1] = torch.randint(1, 90, (n - 1,), generator=g)
        mask[i, :n] = 1
    return ids, mask


def _relative(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def _hf(model, x, ids, mask):
    with torch.inference_mode():
        return model(pixel_values=x, input_ids=ids, attention_mask=mask, output_attentions=True)


def test_clip_gives_transformers_logits_and_image_attention():
    model = _clip()
    ours = vitviz.from_transformers(model)
    assert isinstance(ours, ImageTextModel) and isinstance(ours.image, vitviz.ViT)
    x = torch.randn(2, 3, 32, 32)
    ids, mask = _texts()
    out = _hf(model, x, ids, mask)
    with torch.inference_mode(), vitviz.record_attention(ours) as rec:
        logits = ours(x, ids, mask)
    assert logits.shape == (2, 3)
    assert _relative(logits, out.logits_per_image) < 1e-4
    # the image tower's attention only, every layer, as transformers' eager softmax
    attn = torch.stack(out.vision_model_output.attentions)  # [L, B, H, N, N]
    assert rec.attentions.shape == attn.shape == (2, 2, 2, 17, 17)
    torch.testing.assert_close(rec.attentions, attn, atol=1e-5, rtol=0)
    # the embeddings are transformers' projected features, not normalised
    with torch.inference_mode():
        assert _relative(ours.encode_image(x), model.get_image_features(pixel_values=x).pooler_output) < 1e-4
        want = model.get_text_features(input_ids=ids, attention_mask=mask).pooler_output
        assert _relative(ours.encode_text(ids, mask), want) < 1e-4
        # the text tower's own attention, for a hook of its own, is transformers' (causal, padding masked)
        seen = []
        handle = ours.text.blocks[1].attn.attend.register_forward_hook(lambda m, i, o: seen.append(o))
        try:
            ours.encode_text(ids, mask)
        finally:
            handle.remove()
        torch.testing.assert_close(seen[0], out.text_model_output.attentions[1], atol=1e-5, rtol=0)
    spec = ours.spec
    assert spec is ours.image.spec and spec.categories is None and spec.num_prefix_tokens == 1 and "image–text" in spec.description


def test_a_text_is_read_at_its_first_end_of_text_token_or_at_its_highest_id():
    """transformers' two rules: the first position of `eos_token_id`; with the old configs'
    eos_token_id 2, the position of the highest id (padding here is 0, the texts end in 99)."""
    for eos_token_id, pad in ((EOS, EOS), (2, 0)):
        model = _clip(eos_token_id=eos_token_id)
        ours = vitviz.from_transformers(model)
        assert ours.text.config.eos_token_id == (None if eos_token_id == 2 else EOS)
        ids, mask = _texts()
        ids = ids.masked_fill(mask == 0, pad)
        x = torch.randn(2, 3, 32, 32)
        with torch.inference_mode():
            assert _relative(ours(x, ids, mask), _hf(model, x, ids, mask).logits_per_image) < 1e-4


def test_the_causal_mask_and_the_end_of_text_token_matter():
    """The parity above can fail: without the causal mask, or read at the last position (padding),
    the logits move far beyond its bound."""
    model = _clip()
    ours = vitviz.from_transformers(model)
    x = torch.randn(2, 3, 32, 32)
    ids, mask = _texts()
    want = _hf(model, x, ids, mask).logits_per_image
    config = ours.text.config
    for broken in (dict(causal=False), dict(pool="last")):
        ours.text.config = config.__class__(**{**config.__dict__, **broken})
        with torch.inference_mode():
            assert _relative(ours(x, ids, mask), want) > 1e-2, broken
    ours.text.config = config


def test_analyze_takes_the_image_text_model_and_reads_its_image_tower():
    model = _clip()
    ours = vitviz.from_transformers(model)
    import numpy as np
    from PIL import Image

    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8))
    result = vitviz.analyze(ours, img)
    alone = vitviz.analyze(ours.image, img)
    assert result.probabilities is None and result.predictions() == []
    assert result.attentions.shape == (2, 2, 17, 17)
    torch.testing.assert_close(result.attentions, alone.attentions)
    assert result.layout.text and not alone.layout.text and result.layout.lacks({"text"}) is None


def test_tokenize_needs_a_tokenizer_and_says_so():
    ours = vitviz.from_transformers(_clip())
    with pytest.raises(RuntimeError, match=r"has no tokenizer .* transformers\.AutoTokenizer\.from_pretrained"):
        ours.tokenize(["a cat"])


def test_bad_token_ids_are_refused_with_their_shape():
    ours = vitviz.from_transformers(_clip())
    with pytest.raises(ValueError, match=r"\[T, C\] with 1 <= C <= 16, got \[3, 17\]"):
        ours.encode_text(torch.full((3, 17), EOS))
    with pytest.raises(ValueError, match=r"rows \[1\] do not"):
        ours.encode_text(torch.tensor([[5, EOS], [5, 6]]))


def _tiny_tokenizer():
    """A CLIP tokenizer over single letters: "<|startoftext|>" 0, "<|endoftext|>" 99 (end and padding)."""
    vocab = {"<|startoftext|>": 0}
    for c in "abcdefghijklmnopqrstuvwxyz":
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    vocab["<|endoftext|>"] = EOS
    return transformers.CLIPTokenizer(vocab=vocab, merges=[])


def test_load_model_reads_a_clip_repository_from_the_hub_cache_offline(no_network):
    """A CLIP repository saved into the Hugging Face cache (weights, image processor, tokenizer):
    load_model("hf:...") finds it offline and gives transformers' logits on the processor's pixels
    and the tokenizer's ids."""
    repo = "vitviz-test/tiny-clip"
    model = _clip(seed=3)
    snap = write_hub_cache(no_network, repo, {})
    model.save_pretrained(snap)
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32}, resample=3)
    processor.save_pretrained(snap)
    tokenizer = _tiny_tokenizer()
    tokenizer.save_pretrained(snap)
    assert vitviz.weights_status(f"hf:{repo}") == "cached"
    ours = vitviz.load_model(f"hf:{repo}", device="cpu")
    assert isinstance(ours, ImageTextModel) and ours.tokenizer is not None
    pre = ours.spec.preprocessing
    assert (pre.mode, pre.image_size, pre.resize_size, pre.interpolation) == ("crop", 32, 40, "bicubic")
    assert pre.mean == tuple(processor.image_mean) and pre.std == tuple(processor.image_std)
    import numpy as np
    from PIL import Image

    img = Image.fromarray(np.random.default_rng(2).integers(0, 256, (50, 64, 3), dtype=np.uint8))
    x = vitviz.preprocess(img, pre)[0][None]
    texts = ["a cat", "a dog on a mat", "sky"]
    ids, mask = ours.tokenize(texts)
    want = tokenizer(texts, padding=True, return_tensors="pt")
    assert torch.equal(ids, want["input_ids"]) and torch.equal(mask, want["attention_mask"])
    assert (ids == EOS).any(dim=-1).all() and len(set(mask.sum(-1).tolist())) == 3  # padded
    with torch.inference_mode():
        got = ours(x, ids, mask)
        hf = model(pixel_values=x, input_ids=ids, attention_mask=mask).logits_per_image
    assert _relative(got, hf) < 1e-4
    result = vitviz.analyze(ours, img)
    assert result.variant == f"hf:{repo}" and result.layout.text


def test_a_saved_clip_folder_loads_with_its_tokenizer_or_without_one(no_network, tmp_path):
    model = _clip(seed=4)
    model.save_pretrained(tmp_path / "clip")
    ours = vitviz.load_model("hf:me/clip", device="cpu", weights_path=tmp_path / "clip")
    assert isinstance(ours, ImageTextModel) and ours.tokenizer is None and ours.spec.locator == str(tmp_path / "clip")
    _tiny_tokenizer().save_pretrained(tmp_path / "clip")
    ours = vitviz.load_model("hf:me/clip", device="cpu", weights_path=tmp_path / "clip")
    ids, mask = ours.tokenize("a cat")
    x = torch.randn(1, 3, 32, 32)
    with torch.inference_mode():
        assert _relative(ours(x, ids, mask), model(pixel_values=x, input_ids=ids, attention_mask=mask).logits_per_image) < 1e-4


@pytest.mark.parametrize("where", ["folder", "hub cache"])
def test_an_image_processor_saved_inside_processor_config_is_read_as_transformers_reads_it(no_network, tmp_path, where):
    """transformers 5 saves a processor as processor_config.json with the image processor inside it
    (no preprocessor_config.json): vitviz feeds the model the processor's own pixels, and its logits
    are the library's on them."""
    import numpy as np
    from PIL import Image

    model = _clip(seed=5)
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32}, resample=3,
                                                      image_mean=[0.3, 0.4, 0.5], image_std=[0.2, 0.25, 0.3])
    processor = transformers.CLIPProcessor(image_processor=image_processor, tokenizer=_tiny_tokenizer())
    folder = tmp_path / "clip" if where == "folder" else write_hub_cache(no_network, "vitviz-test/clip-5", {})
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    assert (folder / "processor_config.json").is_file() and not (folder / "preprocessor_config.json").exists()
    ours = vitviz.load_model("hf:vitviz-test/clip-5", device="cpu", weights_path=folder if where == "folder" else None)
    pre = ours.spec.preprocessing
    assert (pre.mode, pre.image_size, pre.resize_size, pre.interpolation) == ("crop", 32, 40, "bicubic")
    assert pre.mean == (0.3, 0.4, 0.5) and pre.std == (0.2, 0.25, 0.3) and "no image processor" not in ours.spec.description
    img = Image.fromarray(np.random.default_rng(5).integers(0, 256, (50, 60, 3), dtype=np.uint8))  # 40 x 48: an even margin to crop
    x = vitviz.preprocess(img, pre)[0][None]
    theirs = processor(images=img, text=["a cat"], return_tensors="pt")["pixel_values"]
    assert (x - theirs).abs().max() < 2e-2  # the same resize, crop, mean and std (their resize rounds to uint8)
    ids, mask = ours.tokenize("a cat")
    with torch.inference_mode():
        assert _relative(ours(x, ids, mask), model(pixel_values=x, input_ids=ids, attention_mask=mask).logits_per_image) < 1e-4


def test_a_model_saved_without_an_image_processor_says_what_it_is_fed(no_network, tmp_path):
    _clip(seed=6).save_pretrained(tmp_path / "clip")
    with pytest.warns(UserWarning, match="no image processor saved"):
        ours = vitviz.load_model("hf:me/clip", device="cpu", weights_path=tmp_path / "clip")
    assert "no image processor saved (processor_config.json or preprocessor_config.json)" in ours.spec.description
    assert ours.spec.preprocessing.mean == vitviz.config.IMAGENET_MEAN


def test_a_model_built_from_configs_scores_by_the_scaled_cosine_plus_its_bias():
    """The options of `ImageTextModel` without a Hugging Face model: no image projection (the pooled
    features are the embedding), a logit bias, a text read at its last position without a causal
    mask; batched equals one text at a time."""
    from vitviz.config import TextConfig

    vision = vitviz.ViTConfig(image_size=32, patch_size=8, width=16, depth=1, heads=2, mlp_dim=32, num_classes=0)
    text = TextConfig(vocab_size=50, context_length=8, width=24, depth=1, heads=2, mlp_dim=48, embed_dim=16, causal=False,
                      pool="last", proj_bias=True)
    torch.manual_seed(0)
    model = ImageTextModel(vision, text, image_projection=False, logit_bias=True).eval()
    with torch.no_grad():
        model.logit_bias.fill_(-3.0)
    assert isinstance(model.image_projection, torch.nn.Identity) and model.tokenizer is None and model.spec is None
    x, ids = torch.randn(2, 3, 32, 32), torch.randint(0, 50, (3, 8))
    with torch.inference_mode():
        logits = model(x, ids)
        image, texts = model.image(x), model.text(ids)
        cos = torch.nn.functional.cosine_similarity(image[:, None], texts[None], dim=-1)
        torch.testing.assert_close(logits, model.logit_scale.exp() * cos - 3.0)
        torch.testing.assert_close(model.encode_text(ids), torch.cat([model.encode_text(ids[i : i + 1]) for i in range(3)]))
    with pytest.raises(ValueError, match="width 16 must be the embedding's 24"):
        ImageTextModel(vision, text.__class__(**{**text.__dict__, "embed_dim": 24}), image_projection=False)
    with pytest.raises(ValueError, match="no head"):
        ImageTextModel(vision.replace(num_classes=10), text)


def test_a_clip_classifier_is_refused_clearly():
    t = transformers
    config = t.CLIPConfig(text_config=TEXT, vision_config=VISION, projection_dim=16, num_labels=3)
    with pytest.raises(NotImplementedError, match="has no text tower"):
        vitviz.from_transformers(t.CLIPForImageClassification(config))
