"""Video transformers in vitviz: `VideoViT` (one model for TimeSformer, VideoMAE, ViViT and V-JEPA 2's
encoder and classifier, its attention recordable), their conversion from Hugging Face
(`video_from_transformers`; `vitviz.from_transformers` and `vitviz.load_model("hf:...")` hand these models
over to it) and the space-time analyses of their attention (`vitviz.video.analysis`).

    model = vitviz.load_model("hf:MCG-NJU/videomae-base-finetuned-kinetics")   # a VideoViT
    attention = model.attention(clip)                 # clip [T, 3, H, W], prepared as model.spec says
    rollout = space_time_rollout(attention)          # [N, N]
    maps = frame_maps(rollout, attention.grid)       # [t, h, w]: the cls token's (or token 0's) row
"""

from vitviz.video.analysis import (
    attention_and_relevance,
    attention_across_frames,
    attention_across_frames_all,
    divided_step_matrices,
    frame_maps,
    mean_attention_distance_space_time,
    space_time_relevance,
    space_time_rollout,
    space_time_rollout_row,
    token_coordinates,
)
from vitviz.video.hf import VIDEO_TYPES, video_from_transformers
from vitviz.video.model import VideoAttention, VideoConfig, VideoSpec, VideoViT

__all__ = [
    "VideoViT",
    "VideoConfig",
    "VideoSpec",
    "VideoAttention",
    "VIDEO_TYPES",
    "video_from_transformers",
    "space_time_rollout",
    "space_time_rollout_row",
    "space_time_relevance",
    "attention_and_relevance",
    "divided_step_matrices",
    "frame_maps",
    "attention_across_frames",
    "attention_across_frames_all",
    "mean_attention_distance_space_time",
    "token_coordinates",
]
