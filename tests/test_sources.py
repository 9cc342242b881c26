"""Weights sources: variants, the real weights-loading path (offline), preprocessing parity and clear errors."""

import urllib.error

import pytest
import torch
from conftest import random_torchvision
from PIL import Image

import vitviz
from vitviz.preprocess import preprocess


@pytest.fixture
def empty_torch_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.delenv("VITVIZ_OFFLINE", raising=False)

    def unreachable(url, dst, *args, **kwargs):
        raise urllib.error.URLError("network is unreachable")

    monkeypatch.setattr(torch.hub, "download_url_to_file", unreachable)
    return tmp_path / "torch" / "hub" / "checkpoints"


def test_registry_lists_every_torchvision_variant_and_the_embedded_ones():
    specs = {s.name: s for s in vitviz.list_variants()}
    for name in ["vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14", "vit_b_16_swag", "vit_l_16_swag",
                 "vit_b_16_swag_linear", "vit_l_16_swag_linear", "vit_h_14_swag_linear", "shapes_p8", "shapes_p16"]:
        assert name in specs
    b16 = specs["vit_b_16"]
    assert (b16.image_size, b16.patch_size, b16.width, b16.depth, b16.heads, b16.num_prefix_tokens) == (224, 16, 768, 12, 12, 1)
    assert b16.resize_size == 256 and b16.interpolation == "bilinear" and len(b16.categories) == 1000
    assert b16.filename == "vit_b_16-c867db91.pth" and b16.top1 == pytest.approx(81.072)
    assert specs["vit_b_16_swag"].image_size == 384 and specs["vit_b_16_swag"].interpolation == "bicubic"
    assert specs["vit_l_16_swag"].image_size == 512
    assert specs["vit_h_14"].image_size == 518  # torchvision's default for H/14 is SWAG end-to-end
    assert specs["shapes_p8"].categories == vitviz.shapes.CLASSES
    with pytest.raises(dataclasses_frozen()):
        b16.width = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown variant 'vit_x'.*vit_b_16"):
        vitviz.get_spec("vit_x")


def dataclasses_frozen():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_offline_without_cache_raises_a_message_that_says_what_to_do(empty_torch_home):
    assert vitviz.weights_status("vit_l_16") == "download"
    with pytest.raises(vitviz.WeightsUnavailableError) as info:
        vitviz.load_model("vit_l_16", device="cpu")
    msg = str(info.value)
    assert "vit_l_16" in msg and "vit_l_16-852ce7e3.pth" in msg and str(empty_torch_home) in msg
    assert not isinstance(info.value, urllib.error.URLError)


def test_offline_flag_skips_the_download(empty_torch_home, monkeypatch):
    monkeypatch.setenv("VITVIZ_OFFLINE", "1")
    with pytest.raises(vitviz.WeightsUnavailableError, match="VITVIZ_OFFLINE"):
        vitviz.load_model("vit_b_32", device="cpu")
    name, reason = vitviz.default_variant()
    assert name == "shapes_p16" and "vit_b_16" in reason and "not cached" in reason and "vit_b_16-c867db91.pth" in reason


def test_cached_torchvision_checkpoint_loads_through_the_users_path(empty_torch_home):
    """torchvision reads a file already in $TORCH_HOME/hub/checkpoints without checking its hash."""
    tv = random_torchvision("vit_b_32")
    empty_torch_home.mkdir(parents=True)
    torch.save(tv.state_dict(), empty_torch_home / "vit_b_32-d86f8d99.pth")
    assert vitviz.weights_status("vit_b_32") == "cached"
    model = vitviz.load_model("vit_b_32", device="cpu")
    assert not model.training and model.spec.name == "vit_b_32"
    x = torch.randn(1, 3, 224, 224)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), tv(x), atol=1e-4, rtol=0)
    # torchvision's own loader reads the same file: the same network, the same logits
    import torchvision

    tv2 = torchvision.models.vit_b_32(weights="IMAGENET1K_V1").eval()
    with torch.inference_mode():
        torch.testing.assert_close(tv2(x), tv(x))
    # and a local file passed explicitly
    again = vitviz.load_model("vit_b_32", device="cpu", weights_path=empty_torch_home / "vit_b_32-d86f8d99.pth")
    with torch.inference_mode():
        torch.testing.assert_close(again(x), tv(x), atol=1e-4, rtol=0)


def test_a_checkpoint_of_the_wrong_variant_is_refused_clearly(tmp_path):
    path = tmp_path / "p8.pt"
    torch.save(vitviz.get_spec("shapes_p8").build().state_dict(), path)
    with pytest.raises(ValueError, match="does not fit shapes_p16"):
        vitviz.load_model("shapes_p16", device="cpu", weights_path=path)


@pytest.mark.parametrize("name", ["vit_b_16", "vit_b_16_swag", "vit_l_16"])
def test_preprocessing_matches_the_weights_own_transforms(name):
    from torchvision.models import get_weight

    spec = vitviz.get_spec(name)
    enum, member = spec.weights.split()[1].split(".")
    weights = get_weight(f"{enum}.{member}")
    img = Image.fromarray(torch.randint(0, 256, (300, 451, 3), dtype=torch.uint8).numpy())
    ours, crop = preprocess(img, spec.preprocessing)
    theirs = weights.transforms()(img)
    assert crop.size == (spec.image_size, spec.image_size)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_device_default_and_override():
    assert vitviz.default_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    model = vitviz.load_model("shapes_p16", device="cpu")
    assert next(model.parameters()).device.type == "cpu"


@pytest.mark.parametrize("size", ["0", "-16", "abc", "", "16.5", " 96", "096", "٩٦"])
def test_a_size_suffix_is_a_whole_number_of_pixels(size):
    with pytest.raises(ValueError) as info:
        vitviz.get_spec(f"shapes_p16@{size}")
    assert "after @ comes the side of the images the model is fed, a whole number of pixels above 0" in str(info.value)
    assert "multiple of the model's patch size" in str(info.value) and f"got {size!r}" in str(info.value)


def test_a_size_suffix_is_a_multiple_of_the_patch_size():
    with pytest.raises(ValueError, match="90 px is not a multiple of shapes_p16's patch size 16: 80 or 96 px would be"):
        vitviz.get_spec("shapes_p16@90")
    with pytest.raises(ValueError, match="8 px is not a multiple of shapes_p16's patch size 16: 16 px would be"):
        vitviz.get_spec("shapes_p16@8")
    spec = vitviz.get_spec("shapes_p16@160")
    assert spec.name == "shapes_p16@160" and spec.image_size == 160 and spec.grid == (10, 10)
    with pytest.raises(ValueError, match="a whole number of pixels above 0"):
        vitviz.get_spec("shapes_p16").at(-16)
    with pytest.raises(ValueError, match="unknown variant 'vit_x@96'"):
        vitviz.get_spec("vit_x@96")
