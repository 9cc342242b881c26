"""`vitviz.ask` on vitviz's own VLM (`vitviz.vlm.model.ShapesVLM`), random weights: the greedy answer,
the recorded attention and the relevance, each against a computation of its own here."""

import numpy as np
import pytest
import torch

from vitviz.config import ViTConfig
from vitviz.vlm.ask import Answer, ask, chefer_relevance, vlm_of
from vitviz.vlm.model import ShapesVLM, ShapesVLMConfig, ShapesVLMRunner, pixel_shuffle


def _tiny(merge: int = 2, seed: int = 0) -> ShapesVLM:
    torch.manual_seed(seed)
    vision = ViTConfig(image_size=32, patch_size=8, width=16, depth=2, heads=2, mlp_dim=32, num_classes=0)
    model = ShapesVLM(ShapesVLMConfig(vision=vision, merge=merge, width=24, depth=3, heads=3, mlp_dim=48, max_len=40)).double().eval()
    with torch.no_grad():  # logits large enough that the greedy answer is not a tie of near-equal values
        model.embed.weight.normal_(std=1.0)
    return model


def _image(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)


def _answer(model, question="what colour is the star ?", tokens=5) -> Answer:
    return ask(model, _image(), question, max_new_tokens=tokens)


def test_the_answer_is_the_greedy_one_token_by_token():
    model = _tiny()
    runner = vlm_of(model)
    answer = _answer(model)
    prompt = runner.prompt(_image(), "what colour is the star ?")
    ids = prompt.ids[None]
    want = []
    with torch.no_grad():
        for _ in range(len(answer.ids)):
            nxt = int(model(prompt.inputs["images"], ids)[0, -1].argmax())
            want.append(nxt)
            ids = torch.cat([ids, ids.new_tensor([[nxt]])], dim=1)
    assert answer.ids == want
    assert len(answer.ids) >= 2
    assert answer.tokens == [model.words.piece(i) for i in want]


def test_attention_is_the_producing_positions_row_at_the_image_columns():
    model = _tiny()
    answer = _answer(model)
    prompt = vlm_of(model).prompt(_image(), "what colour is the star ?")
    t = prompt.ids.numel()
    ids = torch.cat([prompt.ids, torch.tensor(answer.ids)])[None]
    keep: list[torch.Tensor] = []
    with torch.no_grad():
        model(prompt.inputs["images"], ids, keep=keep)
    image = (prompt.ids == model.words.image_id).nonzero().flatten()
    assert image.tolist() == list(range(1, 1 + model.config.image_tokens))
    n = len(answer.ids)
    assert answer.attention.shape == (n, model.config.depth, model.config.heads, image.numel())
    for i in range(n):
        for layer in range(model.config.depth):
            want = keep[layer][0, :, t - 1 + i, image].float()
            torch.testing.assert_close(answer.attention[i, layer], want, atol=1e-7, rtol=0)


def _relevance_by_hand(model: ShapesVLM, answer: Answer) -> torch.Tensor:
    """Chefer et al. 2021b's rule as written, the whole T x T matrix: R = I, R = R + mean_h((∇A ⊙ A)⁺) R."""
    prompt = vlm_of(model).prompt(_image(), answer.question)
    t = prompt.ids.numel()
    ids = torch.cat([prompt.ids, torch.tensor(answer.ids[:-1], dtype=torch.long)])[None]
    image = (prompt.ids == model.words.image_id).nonzero().flatten()
    out = []
    for i, token in enumerate(answer.ids):
        keep: list[torch.Tensor] = []
        logits = model(prompt.inputs["images"], ids, keep=keep)
        grads = [torch.autograd.grad(logits[0, t - 1 + i, token], a, retain_graph=True)[0] for a in keep]
        r = torch.eye(ids.shape[1], dtype=torch.float64)
        for a, g in zip(keep, grads):
            r = r + (g[0] * a[0]).clamp(min=0).mean(0) @ r
        out.append(r[t - 1 + i, image])
    return torch.stack(out)


def test_relevance_equals_the_rule_computed_whole():
    model = _tiny()
    answer = _answer(model)
    want = _relevance_by_hand(model, answer)
    assert want.abs().max() > 1e-6  # the rule gives something to compare
    torch.testing.assert_close(answer.relevance.double(), want, atol=1e-7, rtol=1e-5)


def test_chefer_relevance_row_equals_the_matrix_product():
    torch.manual_seed(3)
    layers = [torch.rand(1, 2, 6, 6).softmax(-1) for _ in range(3)]
    grads = [torch.randn(1, 2, 6, 6) for _ in range(3)]
    r = torch.eye(6, dtype=torch.float64)
    for a, g in zip(layers, grads):
        r = r + (g[0].double() * a[0].double()).clamp(min=0).mean(0) @ r
    for row in range(6):
        torch.testing.assert_close(chefer_relevance(layers, grads, row), r[row])


def test_pixel_shuffle_merges_neighbouring_patches_row_major():
    grid = (4, 6)
    tokens = torch.arange(24, dtype=torch.float32).reshape(1, 24, 1)
    merged = pixel_shuffle(tokens, grid, 2)
    assert merged.shape == (1, 6, 4)
    # merged token (0, 1) holds patches (0, 2), (0, 3), (1, 2), (1, 3)
    assert merged[0, 1].tolist() == [2, 3, 8, 9]
    assert merged[0, 3].tolist() == [12, 13, 18, 19]


def test_maps_lie_on_the_towers_patch_grid():
    model = _tiny(merge=2)
    answer = _answer(model)
    assert answer.token_grid == (2, 2) and answer.patch_grid == (4, 4)
    tokens = answer.token_map(0)
    patches = answer.map(0)
    assert patches.shape == (4, 4)
    assert torch.equal(patches[2:, :2], tokens[1, 0].expand(2, 2))
    summed = answer.map((0, 2), method="attention", layer=1)
    torch.testing.assert_close(summed, answer.map(0, method="attention", layer=1) + answer.map(1, method="attention", layer=1))
    everything = answer.token_map(None, method="attention")
    torch.testing.assert_close(everything, answer.attention[: len(answer.ids) - int(answer.ends)].mean((1, 2)).sum(0).reshape(2, 2))
    top = answer.top_patches(0, k=2)
    assert top[0]["value"] >= top[1]["value"]
    flat = tokens.flatten()
    assert top[0]["value"] == pytest.approx(float(flat.max()))
    assert top[0]["box"][2] - top[0]["box"][0] == 16  # one token: 2 x 2 patches of 8 px


def test_words_group_tokens():
    answer = Answer(question="q", ids=[5, 6, 7, 3], tokens=[" top", " left", "?", "<end>"], attention=torch.zeros(4, 1, 1, 4),
                    relevance=torch.zeros(4, 4), token_grid=(2, 2), merge=1, image=np.zeros((8, 8, 3), np.uint8), ends=True)
    assert answer.words() == [("top", (0, 1)), ("left?", (1, 3))]
    assert answer.text == "top left?"


@pytest.mark.parametrize("bad, message", [("", "empty"), ("x" * 501, "500"), (None, "empty")])
def test_bad_questions_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        ask(_tiny(), _image(), bad)


@pytest.mark.parametrize("tokens", [0, 65, 2.0, True])
def test_bad_token_counts_are_refused(tokens):
    with pytest.raises(ValueError, match="max_new_tokens"):
        ask(_tiny(), _image(), "how many shapes are there ?", max_new_tokens=tokens)


def test_a_model_that_is_no_vlm_is_refused():
    with pytest.raises(TypeError, match="cannot ask"):
        vlm_of(torch.nn.Linear(2, 2))


def test_a_span_outside_the_answer_is_refused():
    answer = _answer(_tiny())
    with pytest.raises(ValueError, match="outside"):
        answer.map(99)
    with pytest.raises(ValueError, match="none of"):
        answer.map((3, 3))
    with pytest.raises(ValueError, match="layer"):
        answer.map(0, method="attention", layer=7)


def test_the_runner_is_the_protocol():
    model = _tiny()
    runner = vlm_of(model)
    assert isinstance(runner, ShapesVLMRunner)
    assert runner.tower is model.tower and model.tower.tower_info.merge == 2
    assert vlm_of(runner) is runner


def test_shapes_vlm_tower_is_shapes_clips_image_tower():
    from vitviz.sources.embedded import shapes_clip_configs
    from vitviz.vlm.model import shapes_vlm_config

    assert shapes_vlm_config().vision == shapes_clip_configs()[0]
