"""Half precision: a model loaded in bfloat16 or float16 (`load_model(..., dtype=)`) records its
attention, and computes relevance and the lens, in float32, close to the float32 model's."""

import pytest
import torch

import vitviz
from vitviz.sources import weights_dtype

IMAGE = "assets/examples/star.png"


@pytest.fixture(scope="module")
def models():
    return {dtype: vitviz.load_model("shapes_p16", device="cpu", dtype=dtype) for dtype in ("float32", "bfloat16")}


def test_a_bfloat16_model_records_float32_attention_close_to_the_float32_models(models):
    full, half = models["float32"], models["bfloat16"]
    assert next(half.parameters()).dtype == torch.bfloat16 and next(full.parameters()).dtype == torch.float32
    a32, a16 = vitviz.analyze(full, IMAGE), vitviz.analyze(half, IMAGE)
    assert a16.attentions.dtype == torch.float32
    torch.testing.assert_close(a16.attentions.sum(-1), torch.ones(a16.attentions.shape[:-1]), atol=1e-5, rtol=0)  # a float32 softmax
    assert (a16.attentions - a32.attentions).abs().max() < 0.05  # bfloat16 weights upstream: ~0.015 measured
    assert (a16.probabilities - a32.probabilities).abs().max() < 0.01
    assert a16.probabilities.argmax() == a32.probabilities.argmax()


def test_relevance_and_the_lens_of_a_bfloat16_model_are_float32(models):
    from vitviz import inside

    half = models["bfloat16"]
    x = vitviz.preprocess(vitviz.load_image(IMAGE), half.spec.preprocessing)[0]
    maps, *_ = vitviz.relevance_maps(half, x[None])
    assert all(m.dtype == torch.float32 and torch.isfinite(m).all() for m in maps.values())
    lens = inside.logit_lens(half, x)
    assert lens.dtype == torch.float32 and torch.allclose(lens.sum(-1), torch.ones(lens.shape[0]), atol=1e-4)


def test_dtypes_are_named_or_refused():
    assert weights_dtype(None) is torch.float32 and weights_dtype("bf16") is torch.bfloat16 and weights_dtype("half") is torch.float16
    assert weights_dtype(torch.bfloat16) is torch.bfloat16
    for bad in ("int8", torch.int8, "float64"):
        with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
            weights_dtype(bad)
