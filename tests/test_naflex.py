"""Images of any aspect ratio: SigLIP 2's NaFlex resize rule (`vitviz.config.fit_size`, mode "fit")
against Hugging Face's and timm's own, and timm's `NaFlexVit` exactly, on an image tensor and on
timm's padded batch of patches."""

import numpy as np
import pytest
import torch
from PIL import Image

import vitviz
from vitviz.config import Preprocessing, fit_size
from vitviz.preprocess import check_crop, crop, preprocess

timm = pytest.importorskip("timm")

from conftest import random_timm  # noqa: E402
from vitviz.dev.zoo import timm_attention  # noqa: E402

SIZES = [(300, 600), (600, 300), (224, 224), (1, 5000), (5000, 1), (37, 1000), (777, 333), (16, 16), (15, 17), (1080, 1920)]


def test_a_2_to_1_image_fits_by_hand():
    """300 x 600 px, 16 px patches, at most 576: s = 0.88 makes 264 x 528 -> 17 x 33 = 561 patches
    (0.89 would make 18 x 34 = 612): the aspect ratio 1.94, the nearest whole patches can give."""
    assert fit_size(300, 600, patch_size=16, max_patches=576) == (272, 528)
    assert fit_size(16, 16, patch_size=16, max_patches=1) == (16, 16)
    assert fit_size(1, 5000, patch_size=16, max_patches=256) == (16, 256 * 16)  # at least one patch a side


@pytest.mark.parametrize("max_patches", [1, 64, 256, 576, 1024])
def test_the_fit_rule_is_hugging_faces_and_timms(max_patches):
    from timm.data.naflex_transforms import get_image_size_for_seq

    transformers = pytest.importorskip("transformers")
    from transformers.models.siglip2.image_processing_siglip2 import get_image_size_for_max_num_patches

    del transformers
    for h, w in SIZES:
        ours = fit_size(h, w, patch_size=16, max_patches=max_patches)
        assert ours == get_image_size_for_max_num_patches(h, w, 16, max_patches), (h, w)
        assert ours == get_image_size_for_seq((h, w), 16, max_patches)[1], (h, w)
        assert ours[0] % 16 == ours[1] % 16 == 0 and (ours[0] // 16) * (ours[1] // 16) <= max_patches


def test_fit_keeps_the_whole_image_and_its_aspect_ratio():
    pre = Preprocessing(image_size=256, mode="fit", patch_size=16, max_patches=256, mean=(0.5,) * 3, std=(0.5,) * 3)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 600, 3), dtype=np.uint8))
    x, seen = preprocess(image, pre)
    assert seen.size == (352, 176) and x.shape == (3, 176, 352)  # 11 x 22 = 242 patches, 1:2
    assert pre.size_for(300, 600) == (176, 352) and not pre.square
    assert crop(image, pre).size == seen.size
    with pytest.raises(ValueError, match="whole 16 px patches, at most 256"):
        check_crop(image, pre)  # 600 x 300 is not whole patches
    with pytest.raises(ValueError, match="at most 256"):
        check_crop(Image.new("RGB", (320, 320)), pre)  # 400 patches
    assert pre.at(384).max_patches == 576
    with pytest.raises(ValueError, match="only for it"):
        Preprocessing(image_size=256, mode="fit")
    with pytest.raises(ValueError, match="only for it"):
        Preprocessing(image_size=256, patch_size=16, max_patches=256)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


NAMES = ["naflexvit_base_patch16_siglip",  # attention pooling, no prefix
         "naflexvit_so150m2_patch16_reg1_map",  # a register the pool leaves out
         "naflexvit_base_patch16_parfac_gap",  # factorised rows and columns, aspect-preserving resampling
         "naflexvit_base_patch16_radio_v3"]  # cls and 7 registers, a 128 x 128 table resampled bilinearly with aligned corners


@pytest.mark.parametrize("name", NAMES)
def test_naflex_vits_match_timm_at_any_aspect_ratio(name):
    torch.manual_seed(0)
    model = random_timm(name, depth=2)
    ours = vitviz.from_timm(model).eval()
    for h, w in [(96, 320), (320, 96), (256, 256)]:
        x = torch.randn(1, 3, h, w)
        with torch.inference_mode():
            want = model(x)
            with vitviz.record_attention(ours) as rec:
                got = ours(x)
        assert _relative(got, want) < 1e-4, (h, w)
        torch.testing.assert_close(rec.attentions, timm_attention(model, x), atol=1e-5, rtol=0)


def test_a_padded_naflex_batch_in_timm_gives_what_vitviz_gives_the_image():
    """timm's NaFlex input: the patches of a 6 x 11 grid, padded to 80 with masked tokens, beside a
    full 9 x 9 image: each image's logits, and its attention among its own tokens, are vitviz's on
    that image alone; timm gives the padding no attention."""
    torch.manual_seed(0)
    model = random_timm("naflexvit_base_patch16_siglip", depth=2)
    ours = vitviz.from_timm(model).eval()
    p, n = 16, 81
    grids = [(6, 11), (9, 9)]
    images = [torch.randn(1, 3, gh * p, gw * p) for gh, gw in grids]
    patches = torch.zeros(2, n, p * p * 3)
    coord = torch.zeros(2, n, 2, dtype=torch.long)
    valid = torch.zeros(2, n, dtype=torch.bool)
    for i, ((gh, gw), x) in enumerate(zip(grids, images)):
        patches[i, : gh * gw] = x.reshape(3, gh, p, gw, p).permute(1, 3, 2, 4, 0).reshape(gh * gw, -1)  # row by row, (y, x, c)
        yy, xx = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        coord[i, : gh * gw] = torch.stack([yy.flatten(), xx.flatten()], dim=1)
        valid[i, : gh * gw] = True
    batch = {"patches": patches, "patch_coord": coord, "patch_valid": valid}
    theirs = []  # each block's softmax, as its attention dropout (identity in eval) receives it: [L, 2, H, n, n]
    hooks = [b.attn.attn_drop.register_forward_hook(lambda m, args, out: theirs.append(args[0])) for b in model.blocks]
    for b in model.blocks:
        b.attn.fused_attn = False
    try:
        with torch.inference_mode():
            want = model(batch)
    finally:
        for h in hooks:
            h.remove()
    theirs = torch.stack(theirs)
    for i, ((gh, gw), x) in enumerate(zip(grids, images)):
        k = gh * gw
        with torch.inference_mode(), vitviz.record_attention(ours) as rec:
            got = ours(x)
        assert _relative(got[0], want[i]) < 1e-4
        torch.testing.assert_close(rec.attentions[:, 0], theirs[:, i, :, :k, :k], atol=1e-5, rtol=0)
        assert k == n or theirs[:, i, :, :k, k:].abs().max() == 0


def test_analyze_keeps_a_2_to_1_image_whole():
    torch.manual_seed(0)
    ours = vitviz.from_timm(random_timm("naflexvit_base_patch16_siglip", depth=2)).eval()
    assert ours.spec.preprocessing.mode == "fit" and ours.spec.preprocessing.max_patches == 576  # timm's 384 px: 24 x 24
    image = Image.fromarray(np.random.default_rng(1).integers(0, 255, (300, 600, 3), dtype=np.uint8))
    a = vitviz.analyze(ours, image)
    assert a.grid == (17, 33) and a.image.size == (528, 272)
    assert a.attentions.shape == (2, 12, 561, 561) and a.pool_attention.shape == (12, 561)
    torch.testing.assert_close(a.attentions.sum(-1), torch.ones(2, 12, 561))
    assert a.cls_map().shape == (17, 33) and a.rollout().shape == (561, 561)
    from vitviz.pipeline import analyze_crop

    again = analyze_crop(ours, a.image)  # the image it saw is taken as it is
    torch.testing.assert_close(again.attentions, a.attentions)


def test_naflex_names_take_a_size_as_their_patch_budget():
    spec = vitviz.get_spec("timm:naflexvit_base_patch16_siglip")
    assert spec.preprocessing.mode == "fit" and spec.preprocessing.max_patches == 576 and spec.config.grid == (16, 16)
    assert vitviz.get_spec("timm:naflexvit_base_patch16_siglip@256").preprocessing.max_patches == 256


def test_whole_feeds_any_model_whose_positions_follow_any_grid_the_whole_image(tmp_path):
    """"@whole": the model's own patch budget (shapes_p16: 6 x 6 at 96 px), the image's aspect ratio;
    refused for what learned positions for its grid only or attends within windows, and by the
    evaluator, which scores batches of square crops."""
    from vitviz.evaluate import EvaluateError, evaluate

    spec = vitviz.get_spec("shapes_p16@whole")
    assert spec.name == "shapes_p16@whole" and spec.preprocessing.mode == "fit" and spec.preprocessing.max_patches == 36
    assert spec.num_tokens == 37 and spec.config == vitviz.get_spec("shapes_p16").config
    model = vitviz.load_model("shapes_p16@whole", device="cpu")
    assert model.spec == spec
    image = Image.fromarray(np.random.default_rng(2).integers(0, 255, (100, 200, 3), dtype=np.uint8))
    a = vitviz.analyze(model, image)
    assert a.variant == "shapes_p16@whole" and a.grid == (4, 8) and a.image.size == (128, 64)
    assert vitviz.get_spec("shapes_p16@192@whole").preprocessing.max_patches == 144  # a size, then whole
    for said_twice in (vitviz.get_spec, vitviz.load_model):
        with pytest.raises(ValueError, match="said once"):
            said_twice("shapes_p16@whole@whole")
    with pytest.raises(ValueError, match="attends within windows"):
        vitviz.get_spec("shapes_swin@whole")
    with pytest.raises(ValueError, match="relative position bias learned for its grid"):
        vitviz.get_spec("timm:beit_base_patch16_224.in22k_ft_in22k_in1k@whole")
    (tmp_path / "data").mkdir()
    with pytest.raises(EvaluateError, match="batches of square crops"):
        evaluate(tmp_path / "data", out=tmp_path / "out", model="shapes_p16@whole")


@pytest.mark.parametrize("name, size, logits", [("naflexvit_base_patch16_siglip", (128, 256), 2e-2), ("vit_small_r26_s32_224", (224, 224), 5e-2),
                                                ("vit_small_resnet26d_224", (224, 224), 2e-2)])
def test_naflex_and_hybrids_in_bfloat16_stay_close_to_timm(name, size, logits):
    """Both models cast to bfloat16 (NaFlex fed a 1:2 image; a hybrid, whose timm model takes its own
    size only, a square one): logits within 2e-2 of the largest (5e-2 behind BiT's 26 layers of
    standardised convolutions and GroupNorm, where each library's bfloat16 logits are 2-3e-2 from its
    float32 ones, measured) and every block's attention within 1e-2 of timm's (vitviz's softmax in
    float32, timm's in bfloat16), as for the rotary families."""
    torch.manual_seed(0)
    model = random_timm(name, depth=2).to(torch.bfloat16)
    ours = vitviz.from_timm(model).eval()
    assert next(ours.parameters()).dtype == torch.bfloat16
    x = torch.randn(1, 3, *size, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = model(x).float()
        with vitviz.record_attention(ours) as rec:
            got = ours(x).float()
    assert _relative(got, want) < logits
    torch.testing.assert_close(rec.attentions.float(), timm_attention(model, x).float(), atol=1e-2, rtol=0)


def test_a_strip_too_elongated_for_a_square_crop_is_refused_before_it_is_resized():
    """16 x 200,000 px (3.2 megapixels, accepted): its shorter side resized to 96 px, it would be
    1.2 million px long (115 megapixels); refused in one sentence, and taken whole with "@whole"."""
    from vitviz.images import MAX_PIXELS
    from vitviz.preprocess import MAX_RESIZED

    assert MAX_RESIZED == MAX_PIXELS
    strip = Image.new("RGB", (200_000, 16), (200, 10, 10))
    with pytest.raises(vitviz.images.ImageError, match="too elongated for a 96 px square crop"):
        crop(strip, vitviz.get_spec("shapes_p16").preprocessing)
    assert crop(strip, vitviz.get_spec("shapes_p16@whole").preprocessing).size == (576, 16)
