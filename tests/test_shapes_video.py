"""The generated clips of `vitviz.video.shapes` (their motion, determinism and bounds), the space-time
gradient relevance against an independent per-layer computation, and the embedded video model
`shapes_video`: it loads offline, tells the motion of fresh clips and its maps run. Nothing here trains."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch

import vitviz
from vitviz.analysis import pointing_chance, pointing_game
from vitviz.dev.train_shapes_video import augment, token_labels
from vitviz.sources.embedded import assets_dir
from vitviz.video import VideoConfig, VideoViT, frame_maps, space_time_rollout
from vitviz.video.analysis import space_time_relevance
from vitviz.video.shapes import (
    FRAMES,
    IMAGE_SIZE,
    MOTIONS,
    TRAVEL,
    generate_clips,
    load_shapes_video,
    render_clip,
    shapes_video_config,
    to_videos,
)

SEED = 6161  # never trained on (training: data seed 21, its check 22, the published figures 5000)
AXES = {"left": (0, -1), "right": (0, 1), "up": (1, -1), "down": (1, 1)}  # (axis: 0 x, 1 y; sign)


def _centroids(masks: np.ndarray) -> np.ndarray:
    """(x, y) of each mask's centre of mass: [T, S, S] -> [T, 2]."""
    ys, xs = np.mgrid[0 : masks.shape[1], 0 : masks.shape[2]]
    area = masks.sum(axis=(1, 2))
    return np.stack([(masks * xs).sum(axis=(1, 2)) / area, (masks * ys).sum(axis=(1, 2)) / area], axis=1)


@pytest.fixture(scope="module")
def clips():
    return generate_clips(60, SEED)


def test_a_moving_shape_travels_its_labelled_way_inside_every_frame(clips):
    videos, labels, masks = clips
    assert videos.shape == (60, FRAMES, IMAGE_SIZE, IMAGE_SIZE, 3) and videos.dtype == np.uint8
    assert masks.shape == (60, FRAMES, IMAGE_SIZE, IMAGE_SIZE) and masks.dtype == bool
    assert set(labels.tolist()) == set(range(len(MOTIONS)))
    least = TRAVEL[0] * IMAGE_SIZE - 1.5  # the travel, less the masks' rasterisation
    for label, m in zip(labels, masks):
        assert m.sum(axis=(1, 2)).min() > 50
        assert not (m[:, 0].any() or m[:, -1].any() or m[:, :, 0].any() or m[:, :, -1].any())  # fully inside the frame
        c = _centroids(m)
        motion = MOTIONS[label]
        if motion == "still":
            assert (m == m[0]).all()
            continue
        axis, sign = AXES[motion]
        steps = np.diff(c[:, axis]) * sign
        assert (c[-1, axis] - c[0, axis]) * sign >= least and (steps > 0).all()  # a clear distance, every frame on
        assert np.abs(c[:, 1 - axis] - c[0, 1 - axis]).max() < 1.0  # a straight line along the axis
        assert np.abs(steps - steps.mean()).max() < 1.5  # at a constant speed


def test_frames_differ_but_clips_are_deterministic_in_seed_and_index(clips):
    videos, labels, masks = clips
    again, label, mask = render_clip(seed=SEED, index=7)
    assert (again == videos[7]).all() and label == labels[7] and (mask == masks[7]).all()
    part = generate_clips(3, SEED, start=5)
    assert all((a == b).all() for a, b in zip(part, (videos[5:8], labels[5:8], masks[5:8])))
    assert not (render_clip(seed=SEED + 1, index=7)[0] == videos[7]).all()
    still = videos[labels == MOTIONS.index("still")][0]
    assert not (still[0] == still[1]).all()  # each frame its own noise, though nothing moves


def test_the_training_transformations_move_the_label_as_they_move_the_shape(clips):
    videos, labels, masks = clips
    moving = np.flatnonzero(labels != MOTIONS.index("still"))[:12]
    tokens = token_labels(masks[moving], labels[moving], tubelet=2, patch_size=16)
    assert tokens.shape == (12, 4, 6, 6) and set(np.unique(tokens).tolist()) == set(np.unique(labels[moving]).tolist()) | {5}
    assert (token_labels(masks[:20], labels[:20], tubelet=2, patch_size=16)[labels[:20] == MOTIONS.index("still")] == 5).all()
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        as_video = torch.from_numpy(masks[moving])[..., None].expand(-1, -1, -1, -1, 3).to(torch.uint8)
        moved, new_labels, new_tokens = augment(gen, as_video, torch.from_numpy(labels[moving]), tokens)
        moved_masks = moved[..., 0].bool().numpy()
        assert (new_tokens == token_labels(moved_masks, new_labels.numpy(), tubelet=2, patch_size=16)).all()
        for m, label in zip(moved_masks, new_labels.tolist()):
            axis, sign = AXES[MOTIONS[label]]
            c = _centroids(m)
            assert (c[-1, axis] - c[0, axis]) * sign > 25


def _tiny(seed: int = 0) -> VideoViT:
    torch.manual_seed(seed)
    model = VideoViT(VideoConfig(frames=4, tubelet=2, image_size=16, patch_size=8, width=16, depth=3, heads=2, mlp_dim=32,
                                 class_token=True, positions="learned", pool="cls", num_classes=3))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.2 if "norm" in name else 0.3)
    return model.eval()


def _independent_relevance(model: VideoViT, video: torch.Tensor, target: int) -> torch.Tensor:
    """Chefer et al.'s R for one clip [T, 3, H, W], its forward written out here, each layer's softmax
    output a tensor of its own whose gradient autograd keeps; R built head by head in float64."""
    x = model.tokens(video[None])
    attns = []
    for block in model.blocks:
        a = block.attn
        y = block.norm1(x)
        b, n, d = y.shape
        q, k, v = a.qkv(y).reshape(b, n, 3, a.heads, d // a.heads).permute(2, 0, 3, 1, 4)
        attn = torch.softmax(q @ k.transpose(-2, -1) / (d // a.heads) ** 0.5, dim=-1)
        attn.retain_grad()
        attns.append(attn)
        x = x + a.proj((attn @ v).transpose(1, 2).reshape(b, n, d))
        x = x + block.mlp(block.norm2(x))
    logits = model.head(model.norm(x)[:, 0])
    assert torch.allclose(logits, model(video[None]), atol=1e-5)
    logits[0, target].backward()
    n = x.shape[1]
    r = torch.eye(n, dtype=torch.float64)
    for attn in attns:
        term = torch.zeros(n, n, dtype=torch.float64)
        for h in range(attn.shape[1]):
            term += (attn.grad[0, h].double() * attn[0, h].detach().double()).clamp(min=0)
        r = r + (term / attn.shape[1]) @ r
    return r


def test_space_time_relevance_is_chefers_rule_on_an_independent_forward():
    model = _tiny()
    videos = torch.randn(3, 4, 3, 16, 16)
    got = space_time_relevance(model, videos, torch.tensor([0, 2, 1]))
    assert got.shape == (3, 1 + 2 * 2 * 2, 1 + 2 * 2 * 2)
    for i, target in enumerate([0, 2, 1]):
        want = _independent_relevance(_tiny(), videos[i], target)
        assert torch.allclose(got[i].double(), want, atol=1e-5, rtol=1e-4)
        assert not torch.allclose(want, torch.eye(want.shape[0], dtype=torch.float64))
    predicted = model(videos).argmax(-1)
    assert torch.allclose(space_time_relevance(model, videos), space_time_relevance(model, videos, predicted))
    assert torch.allclose(space_time_relevance(model, videos[1]), space_time_relevance(model, videos[1:2], predicted[1]))
    assert all(p.grad is None for p in model.parameters())  # the parameters' gradients are left as they were
    assert frame_maps(got[0], model.grid).shape == (2, 2, 2)


def test_space_time_relevance_says_what_it_cannot_explain():
    with pytest.raises(ValueError, match="a token index below 9 or 'pool'"):
        space_time_relevance(VideoViT(VideoConfig(frames=2, tubelet=1, image_size=16, patch_size=8, width=16, depth=1, heads=2,
                                                  mlp_dim=32, attention="divided", class_token=True, pool="cls", num_classes=2)),
                             torch.zeros(1, 2, 3, 16, 16), query=9)
    with pytest.raises(ValueError, match="no head"):
        space_time_relevance(VideoViT(VideoConfig(frames=2, tubelet=2, image_size=16, patch_size=8, width=16, depth=1, heads=2,
                                                  mlp_dim=32)), torch.zeros(1, 2, 3, 16, 16))
    with pytest.raises(ValueError, match="0..2"):
        space_time_relevance(_tiny(), torch.zeros(1, 4, 3, 16, 16), 3)


def test_the_embedded_model_loads_offline_and_is_small(tmp_path, monkeypatch):
    def unreachable(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setattr(socket.socket, "connect", unreachable)
    model = load_shapes_video()
    assert isinstance(model, VideoViT) and not model.training and model.config == shapes_video_config()
    spec = model.spec
    assert (spec.name, spec.source, spec.categories, spec.frames, spec.image_size, spec.patch_size) == \
        ("shapes_video", "embedded", MOTIONS, FRAMES, IMAGE_SIZE, 16)
    assert spec.grid == (4, 6, 6) and spec.config.num_tokens == 145 and spec.vlm is None
    assert (assets_dir() / "shapes_video.pt").stat().st_size <= 5e6
    with pytest.raises(ValueError, match="unknown variant"):  # not in the image models' menu
        vitviz.get_spec("shapes_video")
    monkeypatch.setenv("VITVIZ_ASSETS", str(tmp_path))
    with pytest.raises(vitviz.WeightsUnavailableError, match="train_shapes_video"):
        load_shapes_video()


def test_the_embedded_model_tells_the_motion_of_fresh_clips_and_its_maps_run(clips):
    videos, labels, masks = clips
    model = load_shapes_video()
    with torch.no_grad():
        predicted = model(to_videos(videos[:30])).argmax(-1).numpy()
    assert (predicted == labels[:30]).mean() >= 0.9
    moving = np.flatnonzero(labels != MOTIONS.index("still"))[:10]
    x = to_videos(videos[moving[0]])
    rollout = space_time_rollout(model.attention(x))
    assert frame_maps(rollout, model.grid).shape == (4, 6, 6) and torch.allclose(rollout.sum(-1), torch.ones(145), atol=1e-4)
    relevance = space_time_relevance(model, to_videos(videos[moving]))
    assert relevance.shape == (10, 145, 145)
    tubes = torch.from_numpy(masks[moving].reshape(10, 4, 2, IMAGE_SIZE, IMAGE_SIZE).any(axis=2))  # [10, t, S, S]
    for found in ([frame_maps(space_time_rollout(model.attention(to_videos(videos[i]))), model.grid) for i in moving],
                  [frame_maps(r, model.grid) for r in relevance]):
        hits = pointing_game(torch.stack(found).flatten(0, 1), tubes.flatten(0, 1), patch_size=16)
        assert hits.float().mean() >= 0.8  # the moving shape, tubelet by tubelet (measured 0.99 and 0.98 on 1,000 clips)


def test_the_random_maps_hit_rate_is_the_pointing_game_of_every_patch_in_turn(clips):
    _, _, masks = clips
    tubes = torch.from_numpy(masks[:6, :2].any(axis=1))
    eye = torch.eye(36).reshape(36, 6, 6)
    want = torch.stack([pointing_game(eye, m[None].expand(36, -1, -1), patch_size=16).float().mean() for m in tubes])
    assert torch.allclose(pointing_chance(tubes, patch_size=16), want) and (want > 0).all() and (want < 1).all()
