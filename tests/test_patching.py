"""Activation patching (vitviz.patching) held to a patching of its own: one full forward of the
corrupted image per site, a plain hook replacing that one activation by the clean run's, the
logits of the model's own forward. Patching nothing gives the corrupted run, patching the whole
stream the clean one; batched equals one site at a time; no hook is left behind."""

import itertools
import threading

import pytest
import torch
import torch.nn.functional as F

import vitviz
from vitviz import steps
from vitviz.config import TextConfig
from vitviz.imagetext import ImageTextModel
from vitviz.patching import KINDS, copy_bytes, patch, patch_forwards, patched_logits


def _moved(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Norms and biases away from their init, so that one left out or misplaced shows."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3) if name.endswith("weight") else p.normal_(0.0, 0.3)
            elif name.endswith("bias") or "token" in name or "gamma" in name:
                p.normal_(0.0, 0.3)
    return model


def _vit(seed: int = 0, **kwargs) -> vitviz.ViT:
    """A 3-layer ViT of 2 heads on a 4 x 4 grid, built in float32 and run in float64 (so that the
    float32 copy of its head, which the unembedding takes, is exact)."""
    torch.manual_seed(seed)
    fields = dict(image_size=32, patch_size=8, width=16, depth=3, heads=2, mlp_dim=32, num_classes=5) | kwargs
    model = _moved(vitviz.ViT(**fields), seed)
    c = model.config
    model.spec = vitviz.VariantSpec(name="test", config=c, preprocessing=vitviz.Preprocessing(c.image_size),
                                    categories=tuple(f"class {i}" for i in range(c.num_classes)), source="test", weights="random")
    return model.double().eval()


def _image_text() -> ImageTextModel:
    from vitviz.words import END_ID, VOCABULARY, WordTokenizer

    vision = vitviz.ViTConfig(image_size=32, patch_size=8, width=16, depth=3, heads=2, mlp_dim=32, num_classes=0)
    text = TextConfig(vocab_size=len(VOCABULARY), context_length=8, width=16, depth=1, heads=2, mlp_dim=32, embed_dim=12,
                      causal=True, pool="eos", eos_token_id=END_ID)
    torch.manual_seed(7)
    model = _moved(ImageTextModel(vision, text), 7).double().eval()
    model.tokenizer = WordTokenizer()
    model.labels, model.template = ("red star", "blue circle", "green ring", "yellow arrow"), "a photo of a {}"
    return model


BUILDERS = {
    "cls": lambda: _vit(),
    "deit-distilled": lambda: _vit(1, distill_token=True),  # cls and distillation token, a head each
    "mean-pooled": lambda: _vit(2, class_token=False, pool="avg", fc_norm=True),
    "registers-layerscale": lambda: _vit(3, register_tokens=2, layer_scale=0.5),
    "rotary": lambda: _vit(4, rope="axial", rope_temperature=100.0, abs_pos_embed=False),
    "image-text": _image_text,
}


@pytest.fixture(scope="module", params=list(BUILDERS))
def model(request):
    return BUILDERS[request.param]()


def _tower(model) -> vitviz.ViT:
    return model.image if isinstance(model, ImageTextModel) else model


def _images(model, seeds=(1, 2)) -> list[torch.Tensor]:
    s = _tower(model).config.image_size
    return [torch.randn(3, s, s, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) for seed in seeds]


def _no_hooks_left(model: torch.nn.Module) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


# ----------------------------------------------------------------------------- the reference


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    """The model's own forward of one image [3, H, W]: logits [C], float64 (an image–text model's
    scaled cosine to its label texts)."""
    with torch.no_grad():
        if isinstance(model, ImageTextModel):
            text = model.label_embeddings(model.labels, model.template).double()
            return (model.logit_scale.exp() * F.normalize(model.encode_image(x[None]), dim=-1) @ text.T)[0]
        return model(x[None])[0]


_INPUT = {"resid_pre", "head", "head_token"}  # the activation is its module's input (else its output)


def _module(model, kind: str, layer: int) -> torch.nn.Module:
    block = _tower(model).blocks[layer]
    return {"resid_pre": block, "attn_out": block.attn, "mlp_out": block.mlp, "head": block.attn.norm,
            "head_token": block.attn.norm, "pattern": block.attn.attend}[kind]


def _hooked(model, x: torch.Tensor, kind: str, layer: int, fn) -> torch.Tensor:
    """The model's forward with fn(activation) -> activation hooked on `kind`'s module at `layer`."""
    module = _module(model, kind, layer)
    if kind in _INPUT:
        handle = module.register_forward_pre_hook(lambda m, args: (fn(args[0]),) + args[1:])
    else:
        handle = module.register_forward_hook(lambda m, args, out: fn(out))
    try:
        return _logits(model, x)
    finally:
        handle.remove()


def _reference(model, clean: torch.Tensor, corrupt: torch.Tensor, kind: str, t: int, o: int) -> torch.Tensor:
    """The scores of every site of `kind`, one full forward of the corrupted image per site."""
    tower = _tower(model)
    layers, heads, tokens = tower.config.depth, tower.config.heads, tower.config.num_tokens
    ld = lambda logits: float(logits[t] - logits[o])  # noqa: E731
    ld_clean, ld_corrupted = ld(_logits(model, clean)), ld(_logits(model, corrupt))
    shape = {"head": (layers, heads), "pattern": (layers, heads), "head_token": (layers, tokens, heads)}.get(kind, (layers, tokens))
    scores = torch.empty(shape, dtype=torch.float64)
    for layer in range(layers):
        seen = []
        _hooked(model, clean, kind, layer, lambda a: seen.append(a.clone()) or a)
        source = seen[0]
        for index in itertools.product(*map(range, shape[1:])):
            def swap(a, index=index):
                a = a.clone()
                if kind in ("head", "head_token"):  # [1, N, H, d]: head h's slice
                    view, src = a.unflatten(-1, (heads, -1)), source.unflatten(-1, (heads, -1))
                    if kind == "head":
                        view[0, :, index[0]] = src[0, :, index[0]]
                    else:
                        view[0, index[0], index[1]] = src[0, index[0], index[1]]
                else:  # [1, N, D] at token n, or [1, H, N, N] at head h
                    a[0, index[0]] = source[0, index[0]]
                return a
            scores[(layer, *index)] = (ld(_hooked(model, corrupt, kind, layer, swap)) - ld_corrupted) / (ld_clean - ld_corrupted)
    return scores


# ----------------------------------------------------------------------------- the scores


def test_each_kind_equals_a_forward_per_site_with_a_plain_hook(model):
    clean, corrupt = _images(model)
    p = patch(model, clean, corrupt, where=KINDS)
    assert p.kinds == KINDS and _no_hooks_left(model)
    torch.testing.assert_close(p.clean_logits.double(), _logits(model, clean), rtol=0, atol=1e-6)
    torch.testing.assert_close(p.corrupted_logits.double(), _logits(model, corrupt), rtol=0, atol=1e-6)
    for kind in KINDS:
        want = _reference(model, clean, corrupt, kind, p.target, p.other)
        assert p.maps[kind].dtype == torch.float32 and p.maps[kind].shape == want.shape, kind
        assert (p.maps[kind].double() - want).abs().max() < 1e-6, kind
    tower = _tower(model)
    assert p.forwards == patch_forwards(model, KINDS) == patch_forwards(model, KINDS, tokens=tower.config.num_tokens)
    assert [len(axis) for axis in p.site_names("head_token")] == list(p.maps["head_token"].shape)


def test_patching_nothing_or_the_whole_stream_gives_the_corrupted_or_the_clean_logits(model):
    clean, corrupt = _images(model)
    p = patch(model, clean, corrupt, where="head")
    tower = _tower(model)
    layers, tokens, heads = tower.config.depth, tower.config.num_tokens, tower.config.heads
    assert torch.equal(patched_logits(model, clean, corrupt, []), p.corrupted_logits)
    for layer in range(layers):
        stream = [("resid_pre", layer, n) for n in range(tokens)]
        assert torch.equal(patched_logits(model, clean, corrupt, stream), p.clean_logits), layer
    branches = [(kind, layer, n) for layer in range(layers) for n in range(tokens) for kind in ("attn_out", "mlp_out")]
    assert torch.equal(patched_logits(model, clean, corrupt, [("resid_pre", 0, n) for n in range(tokens)] + branches), p.clean_logits)
    # every head of a layer is its whole attention output; every token of a head is the head
    for layer in range(layers):
        every_head = patched_logits(model, clean, corrupt, [("head", layer, h) for h in range(heads)])
        torch.testing.assert_close(every_head, patched_logits(model, clean, corrupt, [("attn_out", layer, n) for n in range(tokens)]),
                                   rtol=0, atol=1e-6)
        one = patched_logits(model, clean, corrupt, [("head", layer, 1)])
        torch.testing.assert_close(one, patched_logits(model, clean, corrupt, [("head_token", layer, n, 1) for n in range(tokens)]),
                                   rtol=0, atol=1e-6)
    assert _no_hooks_left(model)


def test_one_site_scores_as_patched_logits_has_it(model):
    """A site's score is read off the logits of `patched_logits` with that site alone."""
    clean, corrupt = _images(model)
    p = patch(model, clean, corrupt, where=("head_token", "pattern"))
    for site in [("head_token", 2, 3, 1), ("pattern", 1, 0)]:
        logits = patched_logits(model, clean, corrupt, [site]).double()
        score = (float(logits[p.target] - logits[p.other]) - p.corrupted_diff) / (p.clean_diff - p.corrupted_diff)
        assert abs(float(p.maps[site[0]][site[1:]]) - score) < 1e-5, site


def test_batched_equals_one_site_at_a_time():
    model = _vit(5, register_tokens=1)
    clean, corrupt = _images(model, (3, 4))
    c = model.config
    per_copy = copy_bytes(tokens=c.num_tokens, width=c.width, mlp=c.mlp_dim, heads=c.heads, itemsize=8)
    auto = patch(model, clean, corrupt, where=KINDS)
    alone = patch(model, clean, corrupt, where=KINDS, batch_size=1)
    three = patch(model, clean, corrupt, where=KINDS, memory=3 * per_copy + 1)  # batches of 3, the last of a layer shorter
    assert auto.batch_size == c.num_tokens * c.heads and alone.batch_size == 1 and three.batch_size == 3
    assert auto.forwards == patch_forwards(model, KINDS) == len(KINDS) * c.depth  # each kind's layer in one batch
    sites = 3 * c.num_tokens + 2 * c.heads + c.num_tokens * c.heads  # a layer's, all kinds
    assert alone.forwards == patch_forwards(model, KINDS, batch_size=1) == c.depth * sites
    assert three.forwards == patch_forwards(model, KINDS, memory=3 * per_copy + 1)
    for kind in KINDS:
        assert (auto.maps[kind] - alone.maps[kind]).abs().max() < 1e-6, kind
        assert (three.maps[kind] - alone.maps[kind]).abs().max() < 1e-6, kind


def test_a_float32_model_scores_as_its_float64_copy():
    model = _vit(6)
    clean, corrupt = _images(model)
    want = patch(model, clean, corrupt, where=("resid_pre", "pattern"))
    got = patch(model.float(), clean.float(), corrupt.float(), where=("resid_pre", "pattern"))
    for kind in ("resid_pre", "pattern"):
        assert (got.maps[kind] - want.maps[kind]).abs().max() < 1e-3, kind


# ----------------------------------------------------------------------------- targets


def test_the_target_and_the_other_class():
    model = _vit()
    clean, corrupt = _images(model)
    a, b = _logits(model, clean), _logits(model, corrupt)

    def best_other(logits, t):
        return next(i for i in logits.argsort(descending=True).tolist() if i != t)

    p = patch(model, clean, corrupt, where="head")
    t = int(a.argmax())
    assert (p.target, p.other) == (t, int(b.argmax()) if int(b.argmax()) != t else best_other(b, t))
    assert p.label == f"class {p.target}" and p.categories == model.spec.categories
    assert p.clean_diff == pytest.approx(float(a[p.target] - a[p.other]), abs=1e-6)
    near = clean + 0.05 * corrupt  # the same prediction: against the corrupted run's best other class
    assert int(_logits(model, near).argmax()) == t
    same = patch(model, clean, near, where="head")
    assert (same.target, same.other) == (t, best_other(_logits(model, near), t))
    p = patch(model, clean, corrupt, target="class 3", where="head")
    assert (p.target, p.other) == (3, best_other(b, 3))
    p = patch(model, clean, corrupt, target=(1, "class 4"), where="head")
    assert (p.target, p.other, p.label, p.other_label) == (1, 4, "class 1", "class 4")
    with pytest.raises(ValueError, match="same class"):
        patch(model, clean, corrupt, target=(2, "class 2"))
    with pytest.raises(ValueError, match="not one of this model's classes"):
        patch(model, clean, corrupt, target="class 9")
    with pytest.raises(ValueError, match="outside 0..4"):
        patch(model, clean, corrupt, target=5)


def test_an_image_text_model_follows_its_labels():
    model = _image_text()
    clean, corrupt = _images(model)
    p = patch(model, clean, corrupt, target="green ring", where="head", labels=["green ring", "red star"])
    assert (p.target, p.other, p.label, p.other_label) == (0, 1, "green ring", "red star")
    assert p.categories == ("green ring", "red star") and p.clean_logits.shape == (2,)


# ----------------------------------------------------------------------------- hooks and threads


def test_no_hook_is_left_after_an_error_and_the_patches_act_in_their_thread_only():
    """Stopped in the middle (a step that raises, as a server's time limit does), the hooks go; while
    they are on, a forward in another thread runs unpatched."""
    model = _vit()
    clean, corrupt = _images(model)
    want = _logits(model, corrupt)
    seen, calls, skip = [], [0], [0]

    def elsewhere():
        seen.append(_logits(model, corrupt))

    def stop():
        calls[0] += 1
        if calls[0] <= skip[0]:  # the runs before the patched ones
            return
        assert not _no_hooks_left(model)  # the patches are on
        other = threading.Thread(target=elsewhere)
        other.start()
        other.join()
        raise TimeoutError("time is up")

    depth = model.config.depth
    for kind in KINDS:  # the clean and the corrupted run (and the clean patterns' own) step first
        calls[0], skip[0] = 0, depth * (3 if kind == "pattern" else 2)
        with pytest.raises(TimeoutError), steps.between_steps(stop):
            patch(model, clean, corrupt, where=kind)
        assert _no_hooks_left(model), kind
    calls[0], skip[0] = 0, depth
    with pytest.raises(TimeoutError), steps.between_steps(stop):
        patched_logits(model, clean, corrupt, [("pattern", 0, 1), ("head", 1, 0), ("resid_pre", 2, 3)])
    assert _no_hooks_left(model) and len(seen) == 7
    for logits in seen:
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-12)


def test_patching_a_pattern_takes_the_explicit_attention():
    """A hook on the softmax that is not vitviz's recorder makes `Attention._observed()` true: the
    layer computes its softmax, which the patch replaces (a patched pattern changes the logits)."""
    model = _vit()
    clean, corrupt = _images(model)
    attn = model.blocks[0].attn
    handle = attn.attend.register_forward_hook(lambda m, args, out: None)
    try:
        assert attn._observed()
    finally:
        handle.remove()
    assert not attn._observed()
    nothing = patched_logits(model, clean, corrupt, [])
    assert not torch.equal(patched_logits(model, clean, corrupt, [("pattern", 0, 0)]), nothing)


# ----------------------------------------------------------------------------- errors


def test_what_cannot_be_patched_is_refused_clearly():
    model = _vit()
    clean, corrupt = _images(model)
    with pytest.raises(ValueError, match=r"same shape; got \[3, 32, 32\] and \[3, 48, 48\]"):
        patch(model, clean, torch.zeros(3, 48, 48, dtype=torch.float64))
    with pytest.raises(ValueError, match="resid_pre, attn_out, mlp_out, head, head_token, pattern"):
        patch(model, clean, corrupt, where=("head", "neuron"))
    with pytest.raises(ValueError, match="same logit difference .* patching has nothing to restore"):
        patch(model, clean, clean.clone())
    with pytest.raises(ValueError, match="no classifier"):
        patch(_vit(num_classes=0), clean, corrupt)
    bare = _image_text()
    bare.labels = None
    with pytest.raises(ValueError, match="no label set"):
        patched_logits(bare, clean, corrupt, [])
    with pytest.raises(ValueError, match="outside this model's 3 layers x 17 tokens x 2 heads"):
        patched_logits(model, clean, corrupt, [("head", 0, 1), ("head_token", 1, 17, 0)])
    with pytest.raises(ValueError, match=r"a head site is \('head', layer, head\)"):
        patched_logits(model, clean, corrupt, [("head", 0)])
    with pytest.raises(ValueError, match="first entry is the kind"):
        patched_logits(model, clean, corrupt, [("neuron", 0, 1)])
    with pytest.raises(ValueError, match="batch_size is 1 or more"):
        patch(model, clean, corrupt, batch_size=0)
    from vitviz.swin import Swin, SwinConfig

    swin = Swin(SwinConfig(image_size=16, patch_size=4, embed_dim=8, depths=(1,), num_heads=(2,), window_size=4, num_classes=5))
    with pytest.raises(ValueError, match="ViT towers"):
        patch(swin, torch.zeros(3, 16, 16), torch.ones(3, 16, 16))
    with pytest.raises(ValueError, match="ViT towers"):
        patch_forwards(swin, "head")
    assert _no_hooks_left(model)
