"""A video model by name: the embedded `shapes_video`, or an `hf:` TimeSformer, VideoMAE, ViViT or
V-JEPA 2 through `vitviz.load_model`."""

from __future__ import annotations

import torch

from vitviz.video.model import VideoViT

__all__ = ["EMBEDDED_VIDEO_MODELS", "load_video_model"]

EMBEDDED_VIDEO_MODELS = ("shapes_video",)


def load_video_model(name: str, *, device: str | torch.device | None = None) -> VideoViT:
    """The video model `name` in eval mode on `device` (default: CUDA if available, as `vitviz.load_model`).

    Raises:
        ValueError: `name` loads a model that is not a video model.
        WeightsUnavailableError: its weights are neither at hand nor downloadable.
    """
    from vitviz.sources import default_device, load_model

    if name == "shapes_video":
        from vitviz.video.shapes import load_shapes_video

        return load_shapes_video(device=device if device is not None else default_device())

    model = load_model(name, device=device)
    if not isinstance(model, VideoViT):
        raise ValueError(f"{name} is not a video model")
    return model
