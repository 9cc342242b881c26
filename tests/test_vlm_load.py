"""A vision–language model loaded by name (`vitviz.load_model("hf:...")`, `vitviz.from_transformers`):
its vision tower holds the whole VLM's adapter, so that `vitviz.ask(tower, ...)` asks the VLM (tiny random
Idefics3, Qwen2.5-VL and LLaVA models and processors, saved with `save_pretrained`, offline). The answer
is the saved model's own greedy generation; the server counts the whole VLM; the adapter's model follows
the tower's device and dtype; a Qwen2.5-VL processor is bounded to the tower's square; a folder without
a processor loads the tower alone and says so; the app's Ask tab opens for a VLM read from the hub's cache
and answers as the library does."""

import numpy as np
import pytest
import torch
from conftest import quiet, write_hub_cache
from PIL import Image

import vitviz
from vitviz.server.models import count_params
from vitviz.sources import source_of

transformers = pytest.importorskip("transformers")
from test_vlm_hf import QUESTION, _build, _image  # noqa: E402

from vitviz.vlm.hf import hf_vlm  # noqa: E402

FAMILIES = ["idefics3", "qwen2_5_vl", "llava"]


def _saved(folder, family: str, *, processor: bool = True, seed: int = 0):
    """A tiny random VLM of `family` saved in `folder` (with its processor unless told otherwise): (model, processor)."""
    model, proc = _build(family, seed=seed)
    model.save_pretrained(folder)
    if processor:
        proc.save_pretrained(folder)
    return model, proc


def _generated(vlm, image, tokens: int) -> list[int]:
    """The ids the adapter's model itself generates greedily after the prompt."""
    prompt = vlm.prompt(image, QUESTION)
    with torch.no_grad():
        out = vlm.model.generate(input_ids=prompt.ids[None], **prompt.inputs, max_new_tokens=tokens, do_sample=False)
    return out[0, prompt.ids.numel():].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_saved_vlm_loads_as_its_tower_holding_the_vlm(no_network, tmp_path, family):
    model, processor = _saved(tmp_path / "tiny", family)
    tower = vitviz.load_model(f"hf:vitviz-test/tiny-{family}", weights_path=tmp_path / "tiny", device="cpu")
    assert tower.spec.vlm == family and "vision–language model" in tower.spec.description
    vlm = tower.__dict__["vlm"]
    assert "vlm" not in dict(tower.named_children()) and vlm.tower is tower and vlm.name == f"vitviz-test/tiny-{family}"
    assert not any(p.requires_grad for p in vlm.model.parameters())
    # the tower is the saved model's
    side = min(tower.spec.image_size, 64)  # (Qwen's square is 448 px: 12,544 patches of this tower's 4 px)
    x = torch.randn(1, 3, side, side)
    with torch.inference_mode():
        torch.testing.assert_close(tower.encode(x), vitviz.from_transformers(model).encode(x))
    image = _image(family)
    answer = vitviz.ask(tower, image, QUESTION, max_new_tokens=3)
    assert answer.ids == _generated(vlm, image, 3) and len(answer.ids) == 3
    assert answer.ids == vitviz.ask(hf_vlm(model, processor), image, QUESTION, max_new_tokens=3).ids
    # the server counts the whole VLM, before loading it (from its config) and once loaded
    whole = sum(p.numel() for p in model.parameters())
    assert count_params(tower) == whole == source_of(tower.spec).num_params(tower.spec)
    assert whole > sum(p.numel() for p in tower.parameters())


def test_the_vlm_follows_the_towers_device_and_dtype(no_network, tmp_path):
    _saved(tmp_path / "tiny", "idefics3")
    tower = vitviz.load_model("hf:vitviz-test/tiny-follow", weights_path=tmp_path / "tiny", device="cpu", dtype="bfloat16")
    vlm = tower.__dict__["vlm"]
    prompt = vlm.prompt(_image("idefics3"), QUESTION)
    assert {p.dtype for p in vlm.model.parameters()} == {torch.bfloat16}
    assert prompt.inputs["pixel_values"].dtype == torch.bfloat16
    rotary = [b for name, b in vlm.model.named_buffers() if name.endswith("inv_freq")]
    assert rotary and all(b.dtype == torch.float32 for b in rotary)  # as transformers keeps them in a half-precision model
    tower.float()
    vitviz.ask(tower, _image("idefics3"), QUESTION, max_new_tokens=2)
    assert {p.dtype for p in vlm.model.parameters()} == {torch.float32}


def test_a_qwen_processor_is_bounded_to_the_towers_square(no_network, tmp_path):
    _saved(tmp_path / "tiny", "qwen2_5_vl")
    tower = vitviz.load_model("hf:vitviz-test/tiny-qwen-bound@96", weights_path=tmp_path / "tiny", device="cpu")
    vlm = tower.__dict__["vlm"]
    assert tower.spec.image_size == 96 and vlm.processor.image_processor.size["longest_edge"] == 96 * 96
    shape = vlm.ask_shape(QUESTION, 3)
    seen = np.random.RandomState(0).randint(0, 256, (96, 96, 3), dtype=np.uint8)  # the crop the app asks about
    prompt = vlm.prompt(seen, QUESTION)
    assert shape.image_tokens == prompt.image_positions.numel() == (96 // 8) ** 2  # 4 px patches, merged 2 x 2
    large = np.random.RandomState(1).randint(0, 256, (320, 400, 3), dtype=np.uint8)
    assert vlm.prompt(large, QUESTION).image_positions.numel() <= shape.image_tokens
    default = vitviz.load_model("hf:vitviz-test/tiny-qwen-bound", weights_path=tmp_path / "tiny", device="cpu")
    assert default.__dict__["vlm"].processor.image_processor.size["longest_edge"] == 448 * 448


@pytest.mark.parametrize("saved", ["nothing", "image processor"])
def test_a_folder_without_its_processor_loads_the_tower_alone_and_says_so(no_network, tmp_path, saved):
    model, processor = _saved(tmp_path / "bare", "idefics3", processor=False)
    if saved == "image processor":  # no tokenizer
        processor.image_processor.save_pretrained(tmp_path / "bare")
    with pytest.warns(UserWarning) as caught:
        tower = vitviz.load_model("hf:vitviz-test/bare", weights_path=tmp_path / "bare", device="cpu")
    assert any("no processor saved" in str(w.message) for w in caught)
    assert tower.spec.vlm is None and "vlm" not in tower.__dict__
    assert "no processor saved" in tower.spec.description and "vitviz.ask cannot ask" in tower.spec.description
    assert count_params(tower) == sum(p.numel() for p in tower.parameters())
    with pytest.raises(TypeError, match="cannot ask"):
        vitviz.ask(tower, _image("idefics3"), QUESTION, max_new_tokens=2)


def test_smolvlm_without_num2words_loads_the_tower_alone_and_says_so(no_network, tmp_path, monkeypatch):
    _saved(tmp_path / "tiny", "smolvlm")
    monkeypatch.setattr(transformers.utils, "is_num2words_available", lambda: False)  # SmolVLMProcessor cannot be made
    with pytest.warns(UserWarning, match="needs num2words"):
        tower = vitviz.load_model("hf:vitviz-test/tiny-smolvlm", weights_path=tmp_path / "tiny", device="cpu")
    assert tower.spec.vlm is None and "vlm" not in tower.__dict__ and "pip install num2words" in tower.spec.description


@pytest.mark.parametrize("family", FAMILIES)
def test_from_transformers_with_the_processor_holds_the_vlm(family):
    model, processor = _build(family)
    alone = vitviz.from_transformers(model)
    assert alone.spec.vlm is None and "vlm" not in alone.__dict__
    assert vitviz.from_transformers(model, processor=processor.image_processor).spec.vlm is None  # no tokenizer: not asked
    tower = vitviz.from_transformers(model, processor=processor)
    vlm = tower.__dict__["vlm"]
    assert tower.spec.vlm == family and vlm.model is model and vlm.tower is tower and not vlm.follow
    assert tower.spec.preprocessing == vitviz.from_transformers(model, processor=processor.image_processor).spec.preprocessing
    image = _image(family)
    assert vitviz.ask(tower, image, QUESTION, max_new_tokens=3).ids == _generated(vlm, image, 3)
    # an adapter's own tower holds that adapter
    adapter = hf_vlm(model, processor)
    assert adapter.tower.__dict__["vlm"] is adapter


def test_the_ask_tab_answers_for_a_vlm_read_from_the_hub_cache(no_network, tmp_path, app):
    from vitviz.server import page, tabs
    from vitviz.server.app import SERVER

    repo = "vitviz-test/tiny-vlm-app"
    snap = write_hub_cache(no_network, repo, {})
    model, _ = _saved(snap, "idefics3", seed=7)
    spec = vitviz.get_spec(f"hf:{repo}")
    assert spec.vlm == "idefics3" and source_of(spec).num_params(spec) == sum(p.numel() for p in model.parameters())
    path = tmp_path / "picture.png"
    Image.fromarray(np.random.RandomState(3).randint(0, 256, (64, 80, 3), dtype=np.uint8)).save(path)
    out = page.on_analyze(str(path), f"hf:{repo}", "mean", 0.0, progress=quiet)
    tab = tabs.ask.TAB
    assert out[tab.gate.content]["visible"] is True
    ref = out[page.PAGE.state]
    asked = tab.on_ask(ref, "what is this?", 3, "relevance", None)
    kept = SERVER.store.get(asked[tab.held].key)
    tower = SERVER.cache.get(f"hf:{repo}")[0]
    assert count_params(tower) == sum(p.numel() for p in model.parameters())
    want = vitviz.ask(tower, SERVER.store.get(ref.key).analysis.image, "what is this?", max_new_tokens=3)
    assert kept.ids == want.ids and len(kept.ids) == 3
    torch.testing.assert_close(kept.relevance, want.relevance)
