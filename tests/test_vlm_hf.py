"""`vitviz.ask` on Hugging Face VLMs (`vitviz.vlm.hf`), tiny random configs built offline, float32, eval:
Idefics3, SmolVLM, Qwen2.5-VL and LLaVA. The answer is the model's own greedy `generate`; each token's
attention over the image is the model's own generation attention; the relevance equals a re-derivation
with the full matrix R; the image tokens are row-major on the token grid (a perturbed tile of pixels
changes only its own token in the language model's input, with towers of 0 blocks so that nothing else
mixes); maps have the tower's patch grid; `load_vlm` reads a folder saved with `save_pretrained`.

SmolVLM's own processor needs num2words; where it is missing, the Idefics3Processor stands in (the
prompt of one image without splitting is the same in both)."""

import importlib.util

import numpy as np
import pytest
import torch
from PIL import Image

from vitviz.vlm.ask import AskShape, ask, vlm_of

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from vitviz.vlm.hf import eager_attention, hf_vlm, load_vlm  # noqa: E402

FAMILIES = ["idefics3", "smolvlm", "qwen2_5_vl", "llava"]
QUESTION = "what is in the picture ?"
SPECIAL = ["<unk>", "<pad>", "<s>", "</s>", "<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>",
           "<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["User", "Assistant", "user", "assistant", ":", "what", "is", "in", "the", "picture", "?", "a", "red", "star"]
VOCAB = 128
EOS = 3
TEXT = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
            bos_token_id=2, eos_token_id=EOS, pad_token_id=1)
IDEFICS_TEMPLATE = ("{% for m in messages %}{{ m['role'] | capitalize }}:{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
                    "{% else %} {{ c['text'] }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
                    "{% if add_generation_prompt %}Assistant:{% endif %}")
QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{% if c['type'] == 'image' %}"
                 "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# the image each family is shown, at its processor's own size (so that no resize mixes pixels), and one tile of it:
# (image height, width), the pixels of one image token, the tile (row, column) perturbed
IMAGE = {"idefics3": ((48, 48), 16, (1, 2)), "smolvlm": ((48, 48), 16, (2, 0)), "qwen2_5_vl": ((40, 48), 8, (1, 4)),
         "llava": ((32, 32), 8, (1, 3))}


def _tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the prompts' words and the families' special tokens."""
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS + [f"w{i}" for i in range(VOCAB - len(SPECIAL) - len(WORDS))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL[4:]})
    return fast


def _randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter away from its init, so that the attention and the answer vary."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0, 0.2)
    return model.float().eval()


def _build(family: str, *, tower_layers: int = 2, seed: int = 0):
    """A tiny random `...ForConditionalGeneration` of `family` with its processor (eager attention)."""
    text = dict(TEXT, model_type="llama")
    if family in ("idefics3", "smolvlm"):
        cls = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[family]
        vision = dict(image_size=48, patch_size=8, hidden_size=32, num_hidden_layers=tower_layers, num_attention_heads=2, intermediate_size=64)
        config = getattr(transformers, f"{cls}Config")(vision_config=vision, text_config=text, image_token_id=4, scale_factor=2)
        model = getattr(transformers, f"{cls}ForConditionalGeneration")(config)
        sizes = dict(size={"longest_edge": 48}, max_image_size={"longest_edge": 48})
        if family == "smolvlm" and importlib.util.find_spec("num2words"):
            processor = transformers.SmolVLMProcessor(image_processor=transformers.SmolVLMImageProcessor(**sizes), tokenizer=_tokenizer(),
                                                      video_processor=transformers.SmolVLMVideoProcessor(), image_seq_len=9)
        else:
            processor = transformers.Idefics3Processor(image_processor=transformers.Idefics3ImageProcessor(**sizes), tokenizer=_tokenizer(),
                                                       image_seq_len=9, chat_template=IDEFICS_TEMPLATE if family == "idefics3" else None)
    elif family == "qwen2_5_vl":
        text = dict(TEXT, rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2], rope_theta=10000.0))
        vision = dict(depth=tower_layers, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=4, window_size=16,
                      fullatt_block_indexes=[1], out_hidden_size=32, spatial_merge_size=2, temporal_patch_size=2)
        config = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=8, vision_start_token_id=9,
                                               vision_end_token_id=10, video_token_id=11)
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
        pixels = dict(patch_size=4, merge_size=2, temporal_patch_size=2)
        processor = transformers.Qwen2_5_VLProcessor(
            image_processor=transformers.Qwen2VLImageProcessor(**pixels, size={"shortest_edge": 64, "longest_edge": 64 * 64}),
            tokenizer=_tokenizer(), video_processor=transformers.Qwen2VLVideoProcessor(**pixels), chat_template=QWEN_TEMPLATE)
    elif family == "llava":
        if tower_layers == 0:  # the connector reads the embeddings (hidden state 0: -2, the default, of a tower of one block)
            tower_layers = 1
        vision = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=tower_layers, num_attention_heads=2, intermediate_size=64,
                      model_type="clip_vision_model")
        config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=4)
        model = transformers.LlavaForConditionalGeneration(config)
        processor = transformers.LlavaProcessor(image_processor=transformers.CLIPImageProcessor(size={"shortest_edge": 32},
                                                                                                crop_size={"height": 32, "width": 32}),
                                                tokenizer=_tokenizer(), patch_size=8, vision_feature_select_strategy="default",
                                                num_additional_image_tokens=1)
    else:
        raise ValueError(family)
    model = _randomise(model, seed)
    model.set_attn_implementation("eager")
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = 1
    return model, processor


def _image(family: str, seed: int = 1) -> np.ndarray:
    (h, w), _, _ = IMAGE[family]
    return np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module", params=FAMILIES)
def asked(request):
    """(family, model, processor, the adapter, its prompt, the answer to QUESTION)."""
    family = request.param
    model, processor = _build(family)
    model.processor = processor
    image = _image(family)
    answer = ask(model, image, QUESTION, max_new_tokens=4)
    vlm = hf_vlm(model)
    return family, model, processor, vlm, vlm.prompt(image, QUESTION), answer


def test_the_answer_is_the_models_own_greedy_generation(asked):
    family, model, processor, vlm, prompt, answer = asked
    with torch.no_grad():
        out = model.generate(input_ids=prompt.ids[None], **prompt.inputs, max_new_tokens=4, do_sample=False)
    assert answer.ids == out[0, prompt.ids.numel():].tolist()
    assert len(answer.ids) == 4  # four tokens (the end token may be the fourth): each token's maps below are those of a real step
    assert answer.ends == (answer.ids[-1] == EOS)
    assert answer.tokens == [" " + processor.tokenizer.convert_ids_to_tokens(i) for i in answer.ids]  # word-level: joined by a space
    # the prompt is the processor's: its chat template when it has one, else the image placeholder then the question
    if processor.chat_template:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
    else:
        text = vlm.placeholder + QUESTION
    kwargs = dict(do_image_splitting=False) if family in ("idefics3", "smolvlm") else {}
    want = processor(text=[text], images=[Image.fromarray(_image(family))], return_tensors="pt", **kwargs)
    assert torch.equal(prompt.ids, want["input_ids"][0])
    assert (vlm.layers, vlm.heads) == (3, 4) and vlm.eos_ids == (EOS,)


def test_each_tokens_attention_is_the_generation_attention(asked):
    family, model, processor, vlm, prompt, answer = asked
    with torch.no_grad():
        out = model.generate(input_ids=prompt.ids[None], **prompt.inputs, max_new_tokens=4, do_sample=False, output_attentions=True,
                             return_dict_in_generate=True)
    cols = prompt.image_positions
    assert answer.attention.shape == (4, 3, 4, cols.numel())
    worst = 0.0
    for i in range(len(answer.ids)):
        for layer in range(3):
            want = out.attentions[i][layer][0, :, -1, cols]
            worst = max(worst, (answer.attention[i, layer] - want).abs().max().item())
    assert worst < 1e-5, worst
    assert answer.attention.sum() > 0


def test_the_relevance_is_chefers_rule_over_the_full_matrix(asked):
    family, model, processor, vlm, prompt, answer = asked
    t, n = prompt.ids.numel(), len(answer.ids)
    ids = torch.cat([prompt.ids, torch.tensor(answer.ids[:-1])])[None]
    inputs = dict(prompt.inputs, attention_mask=torch.ones_like(ids))
    if "mm_token_type_ids" in inputs:  # Qwen's 3D positions: the generated tokens are text
        inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, n - 1, dtype=torch.long)], dim=1)
    out = model(input_ids=ids, **inputs, output_attentions=True, use_cache=False)
    attentions = out.attentions
    size = ids.shape[1]
    worst = 0.0
    for i in range(n):
        grads = torch.autograd.grad(out.logits[0, t - 1 + i, answer.ids[i]], attentions, retain_graph=True)
        r = torch.eye(size, dtype=torch.float64)
        for a, g in zip(attentions, grads):
            r = r + (g[0].double() * a[0].double()).clamp(min=0).mean(0) @ r
        want = r[t - 1 + i, prompt.image_positions].float()
        assert want.abs().sum() > 0
        worst = max(worst, (answer.relevance[i] - want).abs().max().item())
    assert worst < 1e-6, worst


@pytest.mark.parametrize("family", FAMILIES)
def test_the_image_tokens_are_row_major_on_the_token_grid(family):
    model, processor = _build(family, tower_layers=0, seed=3)
    vlm = hf_vlm(model, processor)
    (h, w), side, (row, col) = IMAGE[family]
    image = _image(family, seed=5)
    perturbed = image.copy()
    perturbed[row * side:(row + 1) * side, col * side:(col + 1) * side] = 255 - perturbed[row * side:(row + 1) * side, col * side:(col + 1) * side]
    caught = []
    handle = model.get_decoder().register_forward_pre_hook(lambda module, args, kwargs: caught.append(kwargs["inputs_embeds"].detach()),
                                                           with_kwargs=True)
    try:
        prompts = [vlm.prompt(x, QUESTION) for x in (image, perturbed)]
        with torch.no_grad():
            for p in prompts:
                vlm.forward(p, p.ids[None])
    finally:
        handle.remove()
    prompt = prompts[0]
    rows, cols = prompt.token_grid
    assert (rows * side, cols * side) == (h, w) and prompt.merge == side // {"qwen2_5_vl": 4, "llava": 8}.get(family, 8)
    changed = ((caught[1] - caught[0]).abs().amax(-1)[0] > 0).nonzero().flatten()
    assert changed.tolist() == [prompt.image_positions[row * cols + col].item()]
    # the picture the tower saw is the image itself (shown at the processor's size)
    for p, x in zip(prompts, (image, perturbed)):
        assert p.image.shape == x.shape and np.abs(p.image.astype(int) - x.astype(int)).max() <= 1


def test_idefics3_sees_one_tile_without_splitting():
    model, _ = _build("idefics3")
    processor = transformers.Idefics3Processor(  # splitting on by default: a 96 px image in 2 x 2 tiles of 48 and the whole
        image_processor=transformers.Idefics3ImageProcessor(size={"longest_edge": 96}, max_image_size={"longest_edge": 48}),
        tokenizer=_tokenizer(), image_seq_len=9)
    image = np.random.RandomState(2).randint(0, 256, (96, 144, 3), dtype=np.uint8)
    split = processor(text=["<image>" + QUESTION], images=[Image.fromarray(image)], return_tensors="pt")
    assert split["pixel_values"].shape[1] == 5
    prompt = hf_vlm(model, processor).prompt(image, QUESTION)
    assert prompt.inputs["pixel_values"].shape[1:] == (1, 3, 48, 48) and prompt.token_grid == (3, 3) and prompt.image.shape == (48, 48, 3)
    assert prompt.image_positions.numel() == 9


def test_maps_have_the_towers_patch_grid(asked):
    family, model, processor, vlm, prompt, answer = asked
    patch = {"qwen2_5_vl": model.config.vision_config.patch_size}.get(family, getattr(model.config.vision_config, "patch_size", None))
    grid = (prompt.image.shape[0] // patch, prompt.image.shape[1] // patch)
    assert prompt.patch_grid == grid
    r = prompt.merge
    for method in ("relevance", "attention"):
        full, tokens = answer.map(1, method=method), answer.token_map(1, method=method)
        assert tuple(full.shape) == grid
        assert torch.equal(full, tokens.repeat_interleave(r, 0).repeat_interleave(r, 1))
    if vlm.tower is not None and hasattr(vlm.tower, "config") and hasattr(vlm.tower.config, "grid") and family != "qwen2_5_vl":
        assert tuple(vlm.tower.config.grid) == grid


def test_ask_shape_bounds_the_prompt(asked):
    family, model, processor, vlm, prompt, answer = asked
    shape = vlm.ask_shape(QUESTION, 4)
    assert isinstance(shape, AskShape)
    assert (shape.layers, shape.heads, shape.width, shape.vocab, shape.new_tokens) == (3, 4, 32, VOCAB, 4)
    assert shape.image_tokens >= prompt.image_positions.numel() and shape.prompt_tokens >= prompt.ids.numel()
    if family != "qwen2_5_vl":  # Qwen's image tokens depend on the image: the bound is its processor's largest
        assert shape.image_tokens == (prompt.ids == vlm.image_token_id).sum()


def test_a_model_on_sdpa_runs_eager_inside_forward_only():
    model, processor = _build("llava")
    model.set_attn_implementation("sdpa")
    vlm = hf_vlm(model, processor)
    prompt = vlm.prompt(_image("llava"), QUESTION)
    logits, attentions = vlm.forward(prompt, prompt.ids[None])
    assert len(attentions) == 3 and all(a.requires_grad for a in attentions)
    assert model.config._attn_implementation == "sdpa" and model.config.text_config._attn_implementation == "sdpa"
    with eager_attention(model):
        want = model(input_ids=prompt.ids[None], **prompt.inputs, output_attentions=True)
    assert model.config.text_config._attn_implementation == "sdpa"
    for a, b in zip(attentions, want.attentions):
        assert (a - b).abs().max() < 1e-6
    assert (logits - want.logits).abs().max() < 1e-5


def test_a_frozen_model_still_gives_relevance():
    model, processor = _build("idefics3")
    model.processor = processor
    image = _image("idefics3")
    want = ask(model, image, QUESTION, max_new_tokens=3)
    model.requires_grad_(False)
    got = ask(model, image, QUESTION, max_new_tokens=3)
    assert not any(p.requires_grad for p in model.parameters())
    assert got.ids == want.ids and (got.relevance - want.relevance).abs().max() < 1e-6 and got.relevance.abs().sum() > 0


def _trained(model_kind: str) -> transformers.PreTrainedTokenizerFast:
    """A small byte-level BPE ("Ġ" marks a space) or Metaspace ("▁") tokenizer, trained here."""
    if model_kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        alphabet = []
    tok.train_from_iterator(["what is in the picture ?", "a red star in the picture", "the star is red"] * 20,
                            trainers.BpeTrainer(vocab_size=len(alphabet) + 60, special_tokens=["<unk>", "<image>"], initial_alphabet=alphabet))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_a_piece_keeps_its_leading_space(kind):
    model, processor = _build("llava")
    tok = _trained(kind)
    vlm = hf_vlm(model, transformers.LlavaProcessor(image_processor=processor.image_processor, tokenizer=tok, patch_size=8,
                                                    vision_feature_select_strategy="default", num_additional_image_tokens=1))
    ids = tok.encode("the red star", add_special_tokens=False)
    pieces = [vlm.piece(i) for i in ids]
    assert "".join(pieces).strip() == "the red star" and pieces[1:] == [" red", " star"]


def test_what_is_not_a_vlm_or_has_no_processor_is_refused():
    model, processor = _build("llava")
    with pytest.raises(TypeError, match="LlavaModel"):
        hf_vlm(model.model, processor)
    with pytest.raises(TypeError):
        vlm_of(transformers.ViTModel(transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                                             image_size=32, patch_size=8)))
    with pytest.raises(ValueError, match="LlavaProcessor"):
        hf_vlm(model)


def test_load_vlm_reads_a_folder_saved_with_save_pretrained(tmp_path):
    model, processor = _build("qwen2_5_vl")
    model.save_pretrained(tmp_path / "tiny")
    processor.save_pretrained(tmp_path / "tiny")
    vlm = load_vlm("vitviz-test/tiny-qwen", weights_path=tmp_path / "tiny")
    assert isinstance(vlm.processor, transformers.Qwen2_5_VLProcessor) and not vlm.model.training
    assert next(vlm.model.parameters()).dtype == torch.float32
    image = _image("qwen2_5_vl")
    want = ask(hf_vlm(model, processor), image, QUESTION, max_new_tokens=4)
    got = ask(vlm, image, QUESTION, max_new_tokens=4)
    assert got.ids == want.ids and got.tokens == want.tokens
    assert (got.relevance - want.relevance).abs().max() < 1e-6 and (got.attention - want.attention).abs().max() < 1e-6
    model.save_pretrained(tmp_path / "no-processor")
    with pytest.raises(FileNotFoundError, match="model or processor is missing"):
        load_vlm("vitviz-test/tiny-qwen", weights_path=tmp_path / "no-processor")


def test_load_vlm_takes_repo_ids_and_says_what_is_missing(tmp_path, monkeypatch):
    from vitviz.sources.base import WeightsUnavailableError

    for name in ("../secrets", "/etc/passwd", "a/b/c", str(tmp_path)):
        with pytest.raises(ValueError, match="repository id"):
            load_vlm(name)
    monkeypatch.setenv("VITVIZ_OFFLINE", "1")
    with pytest.raises(WeightsUnavailableError, match="hf download vitviz-test/no-such-vlm"):
        load_vlm("vitviz-test/no-such-vlm")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_vlm("vitviz-test/no-such-vlm", weights_path=tmp_path)
