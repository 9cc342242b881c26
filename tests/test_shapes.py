"""The generated dataset and the embedded shapes ViTs: offline, and measured on fresh images."""

import math
import socket

import numpy as np
import pytest
import torch

import vitviz
from vitviz import shapes
from vitviz.dev.train_shapes import generate_pool, to_batch

FRESH_SEED = 2024  # never used in training (training: 0, validation: 1)


def test_generation_is_deterministic_and_chunkable():
    a = shapes.generate(12, seed=3)
    b = shapes.generate(12, seed=3)
    c = shapes.generate(12, seed=4)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[0], c[0])
    head = shapes.generate(5, seed=3)
    tail = shapes.generate(7, seed=3, start=5)
    np.testing.assert_array_equal(np.concatenate([head[0], tail[0]]), a[0])
    np.testing.assert_array_equal(np.concatenate([head[1], tail[1]]), a[1])


def test_the_training_pools_made_in_parts_by_two_processes_are_the_generators_own():
    from vitviz.dev.train_shapes_clip import generate_scene_pool

    for pool, whole in ((generate_pool(23, seed=3, workers=2, chunk=5), shapes.generate(23, seed=3)),
                        (generate_scene_pool(11, seed=4, workers=2, chunk=4), shapes.generate_scenes(11, seed=4))):
        np.testing.assert_array_equal(pool[0], whole[0])
        if isinstance(whole[1], np.ndarray):
            np.testing.assert_array_equal(pool[1], whole[1])
            np.testing.assert_array_equal(pool[2], whole[2])
        else:  # scenes: each one's objects and masks
            assert pool[1] == whole[1] and len(pool[2]) == len(whole[2]) == 11
            assert all(np.array_equal(a, b) for a, b in zip(pool[2], whole[2]))


def test_samples_have_balanced_labels_and_real_masks():
    images, labels, masks = shapes.generate(400, seed=11)
    assert images.shape == (400, 96, 96, 3) and images.dtype == np.uint8
    assert masks.shape == (400, 96, 96) and masks.dtype == bool
    counts = np.bincount(labels, minlength=len(shapes.CLASSES))
    assert len(shapes.CLASSES) >= 8 and counts.min() >= 25
    cover = masks.mean(axis=(1, 2))
    assert cover.min() > 0.01 and cover.max() < 0.4
    # the object differs from its surroundings: mean colour inside vs a ring outside the mask
    inside = np.array([images[i][masks[i]].mean(0) for i in range(50)])
    outside = np.array([images[i][~masks[i]].mean(0) for i in range(50)])
    assert np.median(np.abs(inside - outside).sum(1)) > 60
    with pytest.raises(ValueError, match="unknown shape"):
        shapes._draw_shape(None, "blob", 0, 0, 1, 0)


def test_embedded_variants_load_with_no_network_and_an_empty_torch_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    monkeypatch.delenv("VITVIZ_OFFLINE", raising=False)

    def unreachable(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(socket.socket, "connect", unreachable)
    for name in ("shapes_p8", "shapes_p16"):
        model = vitviz.load_model(name, device="cpu")
        assert model.spec.categories == shapes.CLASSES and vitviz.weights_status(name) == "embedded"
    name, reason = vitviz.default_variant()
    assert name == "shapes_p16" and "cannot be downloaded" in reason
    assert not list((tmp_path / "empty").rglob("*.pth"))


def test_the_two_variants_differ_only_in_patch_size():
    p8, p16 = vitviz.get_spec("shapes_p8"), vitviz.get_spec("shapes_p16")
    assert (p8.patch_size, p16.patch_size) == (8, 16)
    for field in ("image_size", "width", "depth", "heads", "mlp_dim", "mean", "std", "categories"):
        assert getattr(p8, field) == getattr(p16, field)
    folder = vitviz.sources.assets_dir()
    assert (folder / p8.filename).stat().st_size + (folder / p16.filename).stat().st_size < 10e6


@pytest.fixture(scope="module")
def fresh():
    return generate_pool(1000, seed=FRESH_SEED, workers=1)


# Measured on 1,000 fresh images (seed 2024) with the shipped weights; these floors guard against
# regressions (the goal is 95 % top-1). An untrained model already hits 81-89 % in the pointing
# game, so "at least twice as good" is asserted on misses: the trained model misses at most half
# as often as the untrained one.
FLOORS = {"shapes_p16": 0.96, "shapes_p8": 0.98}  # measured: 96.8 % and 99.2 %


@pytest.mark.slow
@pytest.mark.parametrize("name", ["shapes_p16", "shapes_p8"])
def test_accuracy_and_pointing_game_on_fresh_images(name, fresh):
    from vitviz.dev.train_shapes import evaluate, pointing

    trained = vitviz.load_model(name, device="cpu")
    torch.manual_seed(0)
    untrained = vitviz.get_spec(name).build().eval()
    images, labels, masks = fresh
    acc, point = evaluate(trained, images, labels), pointing(trained, images, masks)
    point_untrained = pointing(untrained, images, masks)
    print(
        f"\n{name}: top-1 {acc:.1%}; pointing game {point:.1%} (untrained, same shape: {point_untrained:.1%}); "
        f"misses {1 - point:.1%} against {1 - point_untrained:.1%}"
    )
    assert acc >= FLOORS[name]
    assert point >= 0.9
    assert 1 - point <= 0.5 * (1 - point_untrained)


def test_shapes_drawn_in_their_box_match_a_full_canvas_drawing():
    from PIL import Image, ImageDraw

    k = shapes._SUPERSAMPLE
    for label, name in enumerate(shapes.CLASSES):
        cx, cy, r, angle = 40.3 + label, 51.7, 17.2 + label, 0.3 * label
        alpha, (rows, cols) = shapes._shape_alpha(96, name, cx, cy, r, angle)
        canvas = Image.new("L", (96 * k, 96 * k), 0)
        shapes._draw_shape(ImageDraw.Draw(canvas), name, cx * k, cy * k, r * k, angle)
        full = np.asarray(canvas, dtype=np.float32).reshape(96, k, 96, k).mean(axis=(1, 3)) / 255.0
        inside = np.zeros((96, 96), dtype=np.float32)
        inside[rows, cols] = alpha
        np.testing.assert_allclose(inside, full, atol=1e-6, err_msg=name)
        assert full.sum() > 0.5 * r * r  # every shape has a real area


def test_shape_areas_match_their_geometry():
    # areas in units of r^2, worked out from each outline
    def lens(R, q, d):  # area shared by circles of radii R and q whose centres are d apart
        a = R * R * math.acos((d * d + R * R - q * q) / (2 * d * R))
        b = q * q * math.acos((d * d + q * q - R * R) / (2 * d * q))
        return a + b - 0.5 * math.sqrt((-d + R + q) * (d + R - q) * (d - R + q) * (d + R + q))

    w = 0.32
    expected = {
        "circle": math.pi,
        "square": 2.0,  # four right triangles with legs r
        "triangle": 3 * math.sqrt(3) / 4,
        "star": 5 * 0.42 * math.sin(math.pi / 5),  # ten triangles with sides r and 0.42 r, 36 degrees apart
        "cross": 2 * (2 * 2 * w) - (2 * w) ** 2,  # two bars less their shared square
        "ring": math.pi * (1 - 0.58**2),
        "arrow": 1.15 * 0.36 + 0.5 * 1.2 * 0.85,  # shaft and head
        "crescent": math.pi - lens(1.0, 0.9, 0.5),
    }
    assert set(expected) == set(shapes.CLASSES)
    r = 30.0
    for name, area in expected.items():
        alpha, _ = shapes._shape_alpha(96, name, 48.0, 48.0, r, 0.7)
        # PIL also fills the pixels that an outline touches, about half a supersampled pixel along
        # the edge (+0.7 to +1.5 % here; the crescent's cut-out loses as much: -0.9 %)
        assert alpha.sum() == pytest.approx(area * r * r, rel=0.02), name


def test_example_images_one_per_class(tmp_path):
    paths = shapes.write_examples(tmp_path)
    assert [p.rsplit("/", 1)[-1] for p in paths] == [f"{c}.png" for c in shapes.CLASSES]
    from PIL import Image

    assert Image.open(paths[0]).size == (192, 192)


def test_sincos_codes_by_hand():
    from vitviz.dev.train_shapes import sincos_2d

    codes = sincos_2d((2, 3), 10, temperature=100.0)  # quarter = 2 channels: frequencies 1 and 1/100
    assert codes.shape == (6, 10)
    row, col = 1, 2  # token 5
    w = torch.tensor([1.0, 0.01])
    expected = torch.cat([(row * w).sin(), (row * w).cos(), (col * w).sin(), (col * w).cos(), torch.zeros(2)])
    torch.testing.assert_close(codes[row * 3 + col], expected)
    assert len({tuple(c.tolist()) for c in codes}) == 6  # every position distinct


def test_token_labels_by_hand():
    from vitviz.dev.train_shapes import token_labels

    masks = np.zeros((1, 16, 16), dtype=bool)
    masks[0, 0:8, 0:8] = True  # patch (0, 0) fully covered
    masks[0, 8:10, 8:16] = True  # patch (1, 1) covered by 16/64 = 25 %
    masks[0, 0:1, 8:16] = True  # patch (0, 1) covered by 8/64 = 12.5 %
    t = token_labels(masks, np.array([3]), 8)
    bg = len(shapes.CLASSES)
    assert t.tolist() == [[[3, bg], [bg, 3]]]


@pytest.mark.parametrize("patch", [16, 8])
def test_patch_whitening_against_an_svd_of_the_patches(patch):
    import torch.nn.functional as F

    from vitviz.dev.train_shapes import patch_whitening

    images = shapes.generate(40, seed=9)[0]
    width, eps = 24, 0.1
    weight, bias = patch_whitening(images, patch, width, samples=10**9, eps=eps)
    assert weight.shape == (width, 3, patch, patch) and bias.shape == (width,)
    # independently: cut the patches with numpy, channel-major like a conv filter, and take an SVD
    x = (images.astype(np.float64) / 255.0 - 0.5) / 0.5
    g = 96 // patch
    cut = x.reshape(40, g, patch, g, patch, 3).transpose(0, 1, 3, 5, 2, 4).reshape(-1, 3 * patch * patch)
    centred = cut - cut.mean(0)
    _, s, vt = np.linalg.svd(centred, full_matrices=False)
    lam = s[:width] ** 2 / len(cut)
    # channel k is principal component k, centred, with variance lam / (lam + eps * mean(lam))
    feats = F.conv2d(to_batch(images).double(), weight.double(), bias.double(), stride=patch)
    feats = feats.flatten(2).transpose(1, 2).reshape(-1, width).numpy()
    np.testing.assert_allclose(feats.mean(0), 0, atol=1e-4)
    cov = feats.T @ feats / len(feats)
    np.testing.assert_allclose(np.diag(cov), lam / (lam + eps * lam.mean()), rtol=1e-3)
    np.testing.assert_allclose(cov - np.diag(np.diag(cov)), 0, atol=1e-4)
    w = weight.reshape(width, -1).double().numpy()
    cosine = np.abs((w / np.linalg.norm(w, axis=1, keepdims=True) * vt[:width]).sum(1))
    distinct = np.r_[True, lam[1:] < 0.99 * lam[:-1]] & np.r_[lam[:-1] > 1.01 * lam[1:], True]
    np.testing.assert_allclose(cosine[distinct], 1, atol=1e-3)
    with pytest.raises(ValueError, match="exceeds"):
        patch_whitening(images, 2, 13)


def _orth_by_svd(m: np.ndarray, steps: int = 5) -> np.ndarray:
    """What Muon's five Newton-Schulz steps give, from an SVD: iterating X <- aX + b(XX^T)X + c(XX^T)^2 X
    maps each singular value of m/|m|_F through the scalar quintic and leaves the singular vectors alone."""
    u, s, vt = np.linalg.svd(m, full_matrices=False)
    x = s / np.linalg.norm(m)
    for _ in range(steps):
        x = 3.4445 * x - 4.7750 * x**3 + 2.0315 * x**5
    return u @ np.diag(x) @ vt


@pytest.mark.parametrize("shape", [(5, 3), (3, 8)])
def test_muon_steps_by_hand(shape):
    """The recipe's Muon (torch's, configured by `muon`): two steps against a hand computation with
    the update scaled to `scale` x lr in root mean square and weight decay lr x weight_decay."""
    from vitviz.dev.train_shapes import muon

    gen = torch.Generator().manual_seed(4)
    w0 = torch.randn(*shape, generator=gen)
    g1, g2 = torch.randn(2, *shape, generator=gen)
    p = torch.nn.Parameter(w0.clone())
    opt = muon([p], lr=0.1, weight_decay=0.5, scale=0.8)

    w, buf = w0.double().numpy(), np.zeros(shape)
    for g in (g1, g2):
        p.grad = g.clone()
        opt.step()
        g = g.double().numpy()
        buf = 0.95 * buf + g  # the direction only matters: torch keeps (1 - 0.95) x this
        step = 0.1 * 0.8 * math.sqrt(max(shape)) * _orth_by_svd(g + 0.95 * buf)
        w = w * (1 - 0.1 * 0.5) - step
        # torch orthogonalises in bfloat16: within 5 % of the step's size
        np.testing.assert_allclose(p.detach().double().numpy(), w, atol=0.05 * np.abs(step).max())
        sv = np.linalg.svd(step / (0.1 * 0.8 * math.sqrt(max(shape))), compute_uv=False)
        assert sv.min() > 0.6 and sv.max() < 1.2  # every direction moves about alike


def test_dihedral_moves_images_and_token_labels_together():
    from vitviz.dev.train_shapes import _dihedral

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 9, (64, 4, 4), generator=gen, dtype=torch.uint8)
    images = tokens.float().repeat_interleave(8, 1).repeat_interleave(8, 2).unsqueeze(1)  # each patch filled with its label
    out_images, out_tokens = _dihedral(gen, images, tokens)
    torch.testing.assert_close(out_images[:, 0, ::8, ::8], out_tokens.float())
    assert not torch.equal(out_tokens, tokens)
    # every output is one of the 8 symmetries of its input
    for a, b in zip(tokens, out_tokens):
        variants = [torch.rot90(a, k, (0, 1)) for k in range(4)]
        variants += [v.flip(-1) for v in variants]
        assert any(torch.equal(v, b) for v in variants)


@pytest.mark.parametrize("whiten,optimizer", [(False, "muon"), (False, "adamw"), (True, "muon")])
def test_training_learns_a_small_pool(whiten, optimizer):
    from vitviz.dev.train_shapes import evaluate, train_variant

    pool = shapes.generate(64, seed=5)
    model = train_variant(
        "shapes_p16", pool, pool, steps=60, batch_size=32, lr=2e-3, weight_decay=0.0, warmup=0.1, seed=0,
        device=torch.device("cpu"), whiten=whiten, optimizer=optimizer, log_every=1000, eval_every=1000,
    )
    assert not model.training and next(model.parameters()).device.type == "cpu"
    assert evaluate(model, pool[0], pool[1]) >= 0.5  # memorised well beyond chance (12.5 %)
    if whiten:  # with a learning rate of 0 the patch embedding stays what patch_whitening gave it
        from vitviz.dev.train_shapes import patch_whitening

        still = train_variant(
            "shapes_p16", pool, pool, steps=1, batch_size=32, lr=0.0, weight_decay=0.0, warmup=0.1, seed=0,
            device=torch.device("cpu"), whiten=True, log_every=1000, eval_every=1000,
        )
        weight, bias = patch_whitening(pool[0], 16, still.width, seed=0)
        torch.testing.assert_close(still.patch_embed.proj.weight, weight)
        torch.testing.assert_close(still.patch_embed.proj.bias, bias)


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_muon_moves_the_encoder_matrices_in_every_direction_alike(optimizer):
    from vitviz.dev.train_shapes import train_variant

    pool = shapes.generate(32, seed=6)
    torch.manual_seed(0)
    before = vitviz.get_spec("shapes_p16").build().state_dict()
    after = train_variant(
        "shapes_p16", pool, pool, steps=1, batch_size=32, lr=1e-3, weight_decay=0.0, warmup=0.0, seed=0,
        device=torch.device("cpu"), optimizer=optimizer, log_every=1000, eval_every=1000,
    ).state_dict()
    # the first step of AdamW is lr * sign(grad), dominated by one direction (the gradient is nearly
    # rank one); Muon's is orthogonalised: its leading singular values are lifted to about the same
    # size (only directions with almost no gradient stay small)
    for key in ("blocks.0.attn.qkv.weight", "blocks.2.mlp.0.weight", "blocks.5.mlp.2.weight"):
        s = torch.linalg.svdvals(after[key] - before[key])
        assert (s[4] / s[0] > 0.6) == (optimizer == "muon"), (key, s[:8] / s[0])
    # the patch embedding is AdamW's either way: lr * sign(grad), except where the gradient is ~0
    delta = (after["patch_embed.proj.weight"] - before["patch_embed.proj.weight"]).abs()
    assert ((delta - 1e-3).abs() < 1e-6).float().mean() > 0.95
    with pytest.raises(ValueError, match="muon' or 'adamw"):
        train_variant("shapes_p16", pool, pool, steps=1, batch_size=32, lr=1e-3, weight_decay=0.0, warmup=0.0,
                      seed=0, device=torch.device("cpu"), optimizer="sgd")


def test_training_is_reproducible_from_its_seed():
    from vitviz.dev.train_shapes import train_variant

    pool = shapes.generate(48, seed=8)

    def run(seed):
        return train_variant(
            "shapes_p16", pool, pool, steps=6, batch_size=16, lr=1e-3, weight_decay=0.05, warmup=0.2, seed=seed,
            device=torch.device("cpu"), log_every=1000, eval_every=1000,
        ).state_dict()

    a, b, c = run(0), run(0), run(1)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key  # bit for bit, not merely close
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])
