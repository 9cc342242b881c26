"""Browsing a sparse autoencoder's concepts (`vitviz.concepts.browse`): a folder read back as it was
written, its examples the atlas' cells, the concept map the SAE's own encoding of the kept layer,
the direct logit effect the head's rows through the final norm's γ, feature ablation equal to a
hook written by hand (and no change at all when no feature changes), the folders a process knows,
and clear errors."""

import pytest
import torch
from PIL import Image

import vitviz
from vitviz.concepts.browse import ConceptMap, Concepts, concept_folders, concept_map, load_concepts
from vitviz.concepts.sae import TopKSAE
from vitviz.concepts.store import ConceptsFolderError, save_concepts
from vitviz.inside import ablate
from vitviz.inside.stream import _unembed
from vitviz.pipeline import analyze_crop

LAYER, FEATURES, K, TOP_N, THUMB = 3, 64, 4, 4, 8


def concepts_folder(path, *, model: str = "shapes_p16", layer: int = LAYER, d_in: int = 96, classes=None, seed: int = 0):
    """A small SAE folder as `vitviz.concepts.train` writes it: a random TopKSAE (its pre-bias moved off
    0), a made-up index (feature 5's last example missing) and an atlas whose cell (f, j) is painted
    (f, 40 j, 200)."""
    g = torch.Generator().manual_seed(seed)
    sae = TopKSAE(d_in, FEATURES, K)
    sae.reset_parameters(generator=g)
    with torch.no_grad():
        sae.b_dec.copy_(torch.randn(d_in, generator=g) * 0.1)
        sae.b_enc.copy_(torch.randn(FEATURES, generator=g) * 0.1)
    images = [f"{c}/{i}.png" for c in ("star", "ring", "arrow") for i in range(2)]
    top_images = torch.randint(0, len(images), (FEATURES, TOP_N), generator=g)
    top_images[5, -1] = -1
    index = {
        "top_values": torch.rand(FEATURES, TOP_N, generator=g).sort(dim=1, descending=True).values,
        "top_images": top_images,
        "top_tokens": torch.randint(0, 37, (FEATURES, TOP_N), generator=g),
        "frequency": torch.rand(FEATURES, generator=g) / 10,
    }
    if classes is not None:
        index["class_means"] = torch.rand(FEATURES, len(classes), generator=g)
    atlas = Image.new("RGB", (TOP_N * THUMB, FEATURES * THUMB))
    for f in range(FEATURES):
        for j in range(TOP_N):
            atlas.paste((f, 40 * j, 200), (j * THUMB, f * THUMB, (j + 1) * THUMB, (f + 1) * THUMB))
    metrics = {"explained_variance": 0.5, "mean_l0": float(K), "dead_features": 3, "accuracy_clean": 0.9, "accuracy_spliced": 0.8}
    card = {"model": model, "layer": layer, "tokens": "patches", "d_in": d_in, "features": FEATURES, "k": K, "seed": seed,
            "data": {"folder": "shapes"}, "metrics": metrics, "top_n": TOP_N, "classes": classes, "images": images,
            "thumb": THUMB, "steps": 0, "tokens_seen": 0, "seconds": 0.0, "command": "test"}
    save_concepts(path, sae, card, index, atlas)
    return path


@pytest.fixture(scope="module")
def model():
    return vitviz.load_model("shapes_p16")


@pytest.fixture(scope="module")
def concepts(tmp_path_factory, model):
    path = concepts_folder(tmp_path_factory.mktemp("concepts") / "shapes_p16-l3", classes=list(model.spec.categories))
    return load_concepts(path)


@pytest.fixture(scope="module")
def star():
    return vitviz.sources.assets_dir() / "examples" / "star.png"


def _input(model, star):
    return vitviz.preprocess(vitviz.load_image(star), model.spec.preprocessing)[0]


def test_a_folder_reads_back_as_it_was_written(tmp_path, concepts):
    again = load_concepts(concepts.path)
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        assert torch.equal(getattr(again.sae, name), getattr(concepts.sae, name))
    assert again.card == concepts.card and set(again.index) == {"top_values", "top_images", "top_tokens", "frequency", "class_means"}
    assert (again.layer, again.model_name, again.features, again.k, again.tokens, again.top_n, again.thumb) == \
        (LAYER, "shapes_p16", FEATURES, K, "patches", TOP_N, THUMB)
    assert again.atlas.size == (TOP_N * THUMB, FEATURES * THUMB)
    assert again.class_means.shape == (FEATURES, 8) and again.frequency.shape == (FEATURES,)
    assert again.nbytes > sum(p.numel() * 4 for p in again.sae.parameters()) + TOP_N * THUMB * FEATURES * THUMB * 3 - 1
    no_classes = load_concepts(concepts_folder(tmp_path / "plain"))
    assert no_classes.class_means is None and no_classes.top_class(3) is None


def test_examples_are_the_atlas_cells_strongest_first(concepts):
    got = concepts.examples(7)
    assert [e.value for e in got] == concepts.index["top_values"][7].tolist()
    assert [e.image for e in got] == [concepts.card["images"][i] for i in concepts.index["top_images"][7].tolist()]
    assert [e.token for e in got] == concepts.index["top_tokens"][7].tolist()
    for j, e in enumerate(got):
        assert e.thumbnail.size == (THUMB, THUMB) and e.thumbnail.getpixel((3, 3)) == (7, 40 * j, 200)
    assert len(concepts.examples(5)) == TOP_N - 1  # its last example is missing
    assert concepts.atlas_row(7).size == (TOP_N * THUMB, THUMB)
    assert concepts.top_class(7) == concepts.classes[int(concepts.class_means[7].argmax())]


def test_the_concept_map_is_the_sae_on_the_kept_layer(model, concepts, star):
    a = vitviz.analyze(model, star, concepts=concepts)
    layers = []
    with torch.inference_mode(), vitviz.record_attention(model):  # (the analysis' explicit attention, not the fused one)
        model.encode(vitviz.preprocess(a.image, model.spec.preprocessing)[0][None], layers=layers)
    x = a.layer_tokens[LAYER]
    assert set(a.layer_tokens) == {LAYER} and torch.equal(x, layers[LAYER][0])
    plain = vitviz.analyze(model, star)
    assert a.nbytes - plain.nbytes == 37 * 96 * 4  # the kept stream is counted
    m = a.concepts(concepts)
    with torch.inference_mode():
        z = concepts.sae.encode(x)
        error = (x - concepts.sae.decode(z)).norm(dim=-1)
    assert isinstance(m, ConceptMap) and torch.equal(m.z, z) and torch.equal(m.error, error)
    assert m.indices.shape == (37, K) and ((m.z != 0).sum(dim=-1) <= K).all()
    row = z[1 + 2 * 6 + 3]
    want = sorted(((int(f), float(row[f])) for f in row.nonzero()[:, 0]), key=lambda p: -p[1])
    assert m.top((2, 3), k=K) == want and m.top(1 + 2 * 6 + 3, k=2) == want[:2]
    f = want[0][0]
    assert torch.equal(m.feature_map(f), z[1:, f].reshape(6, 6))
    direct = concept_map(model, a.image, concepts)  # the model run to the layer only (its fused attention)
    torch.testing.assert_close(direct.z, m.z, atol=1e-4, rtol=1e-4)
    assert torch.equal(direct.indices.sort(dim=-1).values, m.indices.sort(dim=-1).values)


def test_keep_layers_keeps_those_blocks_and_a_bare_sae_names_its_layer(model, concepts, star):
    a = vitviz.analyze(model, star, keep_layers=[1, 4])
    assert sorted(a.layer_tokens) == [1, 4]
    with pytest.raises(ValueError, match="does not know its layer"):
        a.concepts(concepts.sae)
    m = a.concepts(concepts.sae, layer=4)
    with torch.inference_mode():
        assert torch.equal(m.z, concepts.sae.encode(a.layer_tokens[4]))
    with pytest.raises(ValueError, match=r"kept no stream after block 3 \(kept: 1, 4\).*keep_layers=\[3\]"):
        a.concepts(concepts)
    one = vitviz.analyze(model, star, keep_layers=[2])
    assert one.concepts(concepts.sae).layer == 2  # the one layer kept
    crop = analyze_crop(model, a.image, keep_layers=[4])
    assert torch.equal(crop.layer_tokens[4], a.layer_tokens[4])


def test_the_logit_effect_is_the_heads_rows_through_the_final_norm(model, concepts, star):
    """By hand: the decoder column centred, times the final LayerNorm's γ, through the head's rows;
    with an analysis, divided by the cls token's σ in that forward."""
    w = concepts.sae.W_dec.detach()
    d = w - w.mean(dim=0, keepdim=True)
    hand = (d.T * model.norm.weight.detach()) @ model.head.weight.detach().T  # [F, C]
    torch.testing.assert_close(concepts.logit_effect(model), hand, atol=1e-5, rtol=1e-5)
    a = vitviz.analyze(model, star)
    sigma = float(a.inside.sigma[0])
    torch.testing.assert_close(concepts.logit_effect(model, features=[9, 2], analysis=a), hand[[9, 2]] / sigma, atol=1e-5, rtol=1e-5)


def test_an_image_text_models_logit_effect_is_unembed_directions_linearisation(tmp_path, star):
    clip = vitviz.load_model("shapes_clip")
    width = clip.image.config.width
    concepts = load_concepts(concepts_folder(tmp_path / "clip", model="shapes_clip", d_in=width, layer=1))
    a = vitviz.analyze(clip, star)
    effect = concepts.logit_effect(clip, features=[0, 11], analysis=a)
    unembed = _unembed(clip, a.categories, None)
    norm = clip.image.norm
    for row, f in enumerate((0, 11)):
        d = concepts.sae.W_dec.detach()[:, f].double()
        d = (d - d.mean()) * norm.weight.detach().double() / a.inside.sigma.double()[0]
        for t in (0, 3):
            r, _ = unembed.direction(t, a.inside.normed[-1])  # [Q, D]
            assert float(effect[row, t]) == pytest.approx(float((r * d).sum()), rel=1e-4, abs=1e-6)


def test_no_feature_changed_leaves_the_logits_exactly_as_they_were(model, concepts, star):
    x = _input(model, star)
    unchanged = ablate(model, x, features=[3, 5], concepts=concepts, scale=1.0)
    assert torch.equal(unchanged.probabilities, unchanged.before) and unchanged.change == 0.0
    none = ablate(model, x, features=[], concepts=concepts)
    assert torch.equal(none.probabilities, none.before) and none.features == () and none.feature_layer == LAYER
    plain = ablate(model, x, [(2, 1)])  # the heads' own ablation: as before
    assert plain.features == () and plain.feature_layer is None


def test_switching_a_feature_off_is_a_hand_written_hook(model, concepts, star):
    """At the output of block 3, on the patches (the tokens this SAE was trained on): x − z_f W_dec[:, f]
    for each feature f switched off, z = encode(x); the SAE's error stays."""
    x = _input(model, star)
    picked = [11, 4]
    sae = concepts.sae

    def hook(module, args, out):
        z = sae.encode(out[:, 1:])
        out = out.clone()
        out[:, 1:] -= z[..., picked] @ sae.W_dec[:, picked].T
        return out

    handle = model.blocks[LAYER].register_forward_hook(hook)
    try:
        with torch.inference_mode():
            want = model(x[None])[0].softmax(-1)
    finally:
        handle.remove()
    got = ablate(model, x, features=picked + [11], concepts=concepts)
    torch.testing.assert_close(got.probabilities, want, atol=1e-6, rtol=1e-5)
    assert got.features == (11, 4) and got.feature_layer == LAYER and got.scale == 0.0 and not got.change == 0.0
    assert not model.blocks[LAYER]._forward_hooks  # nothing left behind
    # a bare TopKSAE reads every token, at the layer it is given; doubled, not switched off
    handle = model.blocks[1].register_forward_hook(lambda m, a, out: out + sae.encode(out)[..., [7]] @ sae.W_dec[:, [7]].T)
    try:
        with torch.inference_mode():
            want = model(x[None])[0].softmax(-1)
    finally:
        handle.remove()
    torch.testing.assert_close(ablate(model, x, features=[7], concepts=sae, layer=1, scale=2.0).probabilities, want, atol=1e-6, rtol=1e-5)


def test_the_folders_a_process_knows(tmp_path, monkeypatch):
    one = concepts_folder(tmp_path / "a" / "shapes_p16-l3")
    concepts_folder(tmp_path / "b" / "shapes_p16-l3", layer=1)  # the same folder name elsewhere
    concepts_folder(tmp_path / "b" / "p8", model="shapes_p8", d_in=96)
    (tmp_path / "b" / "broken").mkdir()
    (tmp_path / "b" / "broken" / "card.json").write_text("{not json")
    assets = tmp_path / "assets"
    concepts_folder(assets / "concepts" / "embedded", layer=2)
    monkeypatch.setenv("VITVIZ_ASSETS", str(assets))
    monkeypatch.setenv("VITVIZ_CONCEPTS", f"{one}{__import__('os').pathsep}{tmp_path / 'b'}{__import__('os').pathsep}{tmp_path / 'none'}")
    found = concept_folders("shapes_p16")
    assert [(f.name, f.layer) for f in found] == [("embedded", 2), ("shapes_p16-l3", 3), ("shapes_p16-l3-2", 1)]
    assert found[1].path == one and "after block 4, 64 features, 4 active per token" in found[1].describe()
    assert [f.name for f in concept_folders("shapes_p16@192")] == [f.name for f in found]
    assert [f.name for f in concept_folders("shapes_p8")] == ["p8"] and concept_folders("vit_b_16") == []
    monkeypatch.delenv("VITVIZ_CONCEPTS")
    assert [f.name for f in concept_folders()] == ["embedded"]


def test_errors_say_what_is_wrong(tmp_path, model, concepts, star):
    x = _input(model, star)
    wide = load_concepts(concepts_folder(tmp_path / "wide", d_in=128))
    with pytest.raises(ValueError, match="reads a stream 128 wide; shapes_p16 is 96 wide"):
        wide.check(model)
    with pytest.raises(ValueError, match="128 wide"):
        vitviz.analyze(model, star, concepts=wide)
    deep = load_concepts(concepts_folder(tmp_path / "deep", layer=6))
    with pytest.raises(ValueError, match="has blocks 0..5"):
        ablate(model, x, features=[1], concepts=deep)
    with pytest.raises(ValueError, match="outside 0..63"):
        ablate(model, x, features=[64], concepts=concepts)
    with pytest.raises(TypeError, match="whole number"):
        concepts.examples(1.5)
    with pytest.raises(ValueError, match="pass concepts="):
        ablate(model, x, features=[1])
    with pytest.raises(ValueError, match="does not know its layer"):
        ablate(model, x, features=[1], concepts=concepts.sae)
    with pytest.raises(ValueError, match="finite number"):
        ablate(model, x, features=[1], concepts=concepts, scale=float("nan"))
    with pytest.raises(TypeError, match="a bare TopKSAE does not know its layer"):
        vitviz.analyze(model, star, concepts=concepts.sae)
    with pytest.raises(ValueError, match="blocks 0..5 of this model"):
        vitviz.analyze(model, star, keep_layers=[6])
    with pytest.raises(ValueError, match="keep_layers=\\[3\\]"):
        vitviz.analyze(model, star).concepts(concepts)
    with pytest.raises(ValueError, match="windowed"):
        vitviz.analyze(vitviz.load_model("shapes_swin"), star, keep_layers=[1])
    with pytest.raises(ValueError, match="outside the 6x6 grid"):
        vitviz.analyze(model, star, concepts=concepts).concepts(concepts).top((6, 0))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConceptsFolderError, match="no card.json"):
        load_concepts(tmp_path / "empty")
    with pytest.raises(ValueError, match="the card's tokens"):
        Concepts(concepts.sae, {**concepts.card, "tokens": "some"}, concepts.index, concepts.atlas)
