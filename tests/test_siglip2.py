"""SigLIP 2 (NaFlex) through vitviz: Hugging Face's `Siglip2Model` (small random configs), fed its
padded batch of patches, gives for each image the `logits_per_image` and the attention among its own
tokens that vitviz gives the image alone at its own aspect ratio; its processor's pixels are vitviz's
"fit" crop; zero-shot, analysis of a 2:1 image and the hub cache path offline."""

import numpy as np
import pytest
import torch
from conftest import write_hub_cache
from test_siglip import _relative, _siglip
from PIL import Image

import vitviz
from vitviz.imagetext import ImageTextModel
from vitviz.preprocess import preprocess
from vitviz.words import WordTokenizer

transformers = pytest.importorskip("transformers")

VISION = dict(num_patches=16, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def _siglip2(seed: int = 0):
    return _siglip(seed, kind="Siglip2", vision=VISION)


def _patches(x: torch.Tensor, p: int) -> torch.Tensor:
    """[1, 3, gh*p, gw*p] -> [gh*gw, p*p*3]: each patch row by row, its pixels (y, x, channel), as the processor cuts them."""
    _, c, h, w = x.shape
    return x.reshape(c, h // p, p, w // p, p).permute(1, 3, 2, 4, 0).reshape((h // p) * (w // p), -1)


def test_siglip2_gives_transformers_logits_and_attention_on_a_padded_batch():
    """Two images, 3 x 6 and 4 x 4 patches, padded to 20 with masked patches: each one's logits over
    three texts and its blocks' attention among its own tokens are vitviz's on the image alone
    (the table of 4 x 4 resampled to 3 x 6 bilinearly, antialiased)."""
    model = _siglip2()
    ours = vitviz.from_transformers(model)
    assert isinstance(ours, ImageTextModel) and ours.image.config.pos_embed_interpolation == "bilinear"
    assert ours.spec.preprocessing.mode == "fit" and ours.spec.preprocessing.max_patches == 16
    p, n, grids = 8, 20, [(3, 6), (4, 4)]
    torch.manual_seed(1)
    images = [torch.randn(1, 3, gh * p, gw * p) for gh, gw in grids]
    pixels = torch.zeros(2, n, p * p * 3)
    mask = torch.zeros(2, n, dtype=torch.long)
    for i, ((gh, gw), x) in enumerate(zip(grids, images)):
        pixels[i, : gh * gw], mask[i, : gh * gw] = _patches(x, p), 1
    ids = torch.randint(3, 100, (3, 16))
    with torch.inference_mode():
        out = model(pixel_values=pixels, pixel_attention_mask=mask, spatial_shapes=torch.tensor(grids), input_ids=ids,
                    output_attentions=True)
    for i, ((gh, gw), x) in enumerate(zip(grids, images)):
        k = gh * gw
        with torch.inference_mode(), vitviz.record_attention(ours) as rec:
            logits = ours(x, ids)
        assert _relative(logits[0], out.logits_per_image[i]) < 1e-4
        theirs = torch.stack([a[i, :, :k, :k] for a in out.vision_model_output.attentions])
        torch.testing.assert_close(rec.attentions[:, 0], theirs, atol=1e-5, rtol=0)
        assert rec.pool_attention.shape == (1, 4, k)


@pytest.mark.parametrize("kind, tolerance", [("Siglip2ImageProcessorPil", 1e-6), ("Siglip2ImageProcessor", 2 / 255 + 1e-6)])
def test_the_processors_pixels_are_vitviz_fit_crop(kind, tolerance):
    """The PIL processor's pixels exactly; the torchvision one's rounds a few pixels the other way
    (1/255 before normalising by 0.5)."""
    cls = getattr(transformers, kind, None)
    if cls is None:
        pytest.skip(f"transformers has no {kind}")
    processor = cls(patch_size=16, max_num_patches=256)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 600, 3), dtype=np.uint8))
    out = processor(images=image, return_tensors="pt")
    pre = vitviz.sources.hf.preprocessing_from_processor(processor.to_dict(), 0)
    assert (pre.mode, pre.patch_size, pre.max_patches, pre.image_size, pre.interpolation) == ("fit", 16, 256, 256, "bilinear")
    x, seen = preprocess(image, pre)
    gh, gw = out["spatial_shapes"][0].tolist()
    assert seen.size == (gw * 16, gh * 16) == (352, 176)
    assert (_patches(x[None], 16) - out["pixel_values"][0, : gh * gw]).abs().max() <= tolerance


def test_siglip2_zero_shot_and_analysis_of_a_2_to_1_image():
    model = _siglip2(seed=3)
    ours = vitviz.from_transformers(model)
    ours.tokenizer = WordTokenizer()
    img = np.random.default_rng(1).integers(0, 256, (20, 40, 3), dtype=np.uint8)
    labels = ["red star", "blue circle", "green ring"]
    a = vitviz.analyze(ours, img, labels=labels, template="a {}")
    assert a.grid == (3, 5) and a.image.size == (40, 24)  # 15 patches of at most 16: 3:5, the nearest to 1:2
    x = vitviz.preprocess(vitviz.load_image(img), ours.spec.preprocessing)[0][None]
    ids, mask = ours.tokenize([f"a {label}" for label in labels])
    pixels, valid = _patches(x, 8)[None], torch.ones(1, 15, dtype=torch.long)
    with torch.inference_mode():
        want = model(pixel_values=pixels, pixel_attention_mask=valid, spatial_shapes=torch.tensor([[3, 5]]), input_ids=ids,
                     attention_mask=mask).logits_per_image[0].sigmoid()
    torch.testing.assert_close(a.probabilities, want, atol=1e-5, rtol=1e-4)
    assert a.cls_map().shape == (3, 5) and a.pool_attention.shape == (4, 15)


def test_load_model_reads_a_siglip2_repository_from_the_hub_cache_offline(no_network):
    repo = "vitviz-test/tiny-siglip2"
    model = _siglip2(seed=4)
    snap = write_hub_cache(no_network, repo, {})
    model.save_pretrained(snap)
    transformers.Siglip2ImageProcessorPil(patch_size=8, max_num_patches=16).save_pretrained(snap)
    ours = vitviz.load_model(f"hf:{repo}", device="cpu")
    pre = ours.spec.preprocessing
    assert isinstance(ours, ImageTextModel) and (pre.mode, pre.max_patches, pre.patch_size) == ("fit", 16, 8)
    result = vitviz.analyze(ours, np.random.default_rng(2).integers(0, 256, (30, 60, 3), dtype=np.uint8))
    assert result.grid == (3, 5) and result.pool_attention.shape == (4, 15)
