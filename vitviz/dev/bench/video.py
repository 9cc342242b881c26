"""A video transformer's analysis against its plain forward: VideoMAE-B/16 at 16 frames (its
architecture, random weights: 8 x 14 x 14 = 1,568 tokens, joint attention), the Video tab's run (one
forward recording every layer's attention, heads averaged, and the logits, the space-time rollout's row of the
patches' mean, `space_time_rollout_row`, per tubelet), Chefer et al.'s relevance alone (a forward and a
backward), and the tab's relevance run (`attention_and_relevance`: the views' attention and the relevance from
that one forward and backward)."""

from __future__ import annotations

import statistics

import torch

from vitviz.dev.bench.common import _sync_of, measure
from vitviz.video.analysis import attention_and_relevance, frame_maps, space_time_relevance, space_time_rollout_row
from vitviz.video.model import VideoConfig, VideoViT

VIDEOMAE_B = VideoConfig(frames=16, tubelet=2, image_size=224, patch_size=16, width=768, depth=12, heads=12, mlp_dim=3072,
                         attention="joint", class_token=False, positions="sinusoidal", pool="mean", fc_norm=True, num_classes=400)
SMALL = VideoConfig(frames=4, tubelet=2, image_size=32, patch_size=8, width=32, depth=2, heads=2, mlp_dim=64, attention="joint",
                    class_token=False, positions="sinusoidal", pool="mean", fc_norm=True, num_classes=5)  # the dry run's


def video_table(device: torch.device, *, rounds: int, small: bool = False) -> list[tuple[str, float, float]]:
    """(path, median ms, ratio to the plain forward) for one clip of `VIDEOMAE_B` (or `SMALL`)."""
    torch.manual_seed(0)
    c = SMALL if small else VIDEOMAE_B
    model = VideoViT(c).eval().to(device)
    x = torch.randn(c.frames, 3, c.image_size, c.image_size, device=device)
    target = 0

    def forward():
        with torch.inference_mode():
            return model(x[None])

    def analyse():
        attention = model.attention(x, head_fusion="mean")
        return frame_maps(space_time_rollout_row(attention, query="pool"), attention.grid)

    def forward_backward():
        inp = x[None].clone().requires_grad_(True)
        torch.autograd.grad(model(inp)[0, target], inp)

    def relevance():
        return frame_maps(space_time_relevance(model, x, target, query="pool")[0], c.grid)

    def tab_relevance():
        attention, row = attention_and_relevance(model, x, target, query="pool", head_fusion="mean")
        return frame_maps(row, attention.grid)

    times = measure({"forward": forward, "analyse": analyse, "forward_backward": forward_backward, "relevance": relevance,
                     "tab_relevance": tab_relevance},
                    rounds=rounds, warmup=1, sync=_sync_of(device))
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    name = "tiny video ViT" if small else "VideoMAE-B/16, 16 frames"
    n = c.num_tokens
    return [(f"{name}: plain forward ({n:,} tokens)", ms["forward"], 1.0),
            (f"{name}: analyse (attention, rollout, maps)", ms["analyse"], ms["analyse"] / ms["forward"]),
            (f"{name}: plain forward and backward", ms["forward_backward"], ms["forward_backward"] / ms["forward"]),
            (f"{name}: relevance (Chefer et al.)", ms["relevance"], ms["relevance"] / ms["forward"]),
            (f"{name}: the tab's relevance run (attention and relevance, one pass)", ms["tab_relevance"],
             ms["tab_relevance"] / ms["forward"])]
