"""A video model by name: the embedded `shapes_video`, or an `hf:` TimeSformer, VideoMAE, ViViT or
V-JEPA 2 through `vitviz.load_model`."""

from __future__ import annotations

import torch

from vitviz.video.model import VideoSpec, VideoViT

__all__ = ["EMBEDDED_VIDEO_MODELS", "VIDEO_MENU", "video_spec", "is_video_model", "load_video_model"]

EMBEDDED_VIDEO_MODELS = ("shapes_video",)
VIDEO_MENU: tuple[str, ...] = (  # the app's Video tab: the embedded model, then Hugging Face video classifiers
    "shapes_video",
    "hf:MCG-NJU/videomae-base-finetuned-kinetics",
    "hf:facebook/timesformer-base-finetuned-k400",
)


def video_spec(name: str) -> VideoSpec:
    """The record of the video model `name`, without its weights (an `hf:` model's config from the
    hub's cache, or fetched).

    Raises:
        ValueError: `name` is not a video model (or not a model).
        WeightsUnavailableError: its config is neither at hand nor downloadable.
    """
    if name == "shapes_video":
        from vitviz.video.shapes import shapes_video_spec

        return shapes_video_spec()
    from vitviz.sources import get_spec

    spec = get_spec(name)
    if not isinstance(spec, VideoSpec):
        raise ValueError(f"{name} is not a video model")
    return spec


def is_video_model(name: str) -> bool:
    """Whether `name` names a video model (`video_spec` reads one): whatever stops it reading a record
    (an image model, an unknown name, a config out of reach) is said by the image path in its own words."""
    try:
        video_spec(name)
    except Exception:  # noqa: BLE001
        return False
    return True


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
