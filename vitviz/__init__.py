"""vitviz: look inside Vision Transformers — attention, rollout, attention distance, position
embeddings and patch filters — from Python or in the browser (`app.py`).

    import vitviz
    model = vitviz.load_model("shapes_p16")          # embedded, offline; or "vit_b_16", "timm:...", "hf:..."
    result = vitviz.analyze(model, "photo.jpg")
    result.predictions(), result.cls_map(), result.distances()

    clip = vitviz.load_model("hf:openai/clip-vit-base-patch32")   # an ImageTextModel: a ViT image tower and a text tower
    clip(images, *clip.tokenize(["a cat", "a dog"]))               # logits_per_image [B, 2]
    vitviz.explain(clip, "photo.jpg", method="legrad", text=["a cat", "a dog"])  # one map per phrase
"""

from vitviz.explanations import METHODS, Explanation, explain, relevance_maps
from vitviz.explainers import Method, methods, register_method
from vitviz.analysis import (
    attention_received,
    attention_rollout,
    cls_map,
    embedding_filter_components,
    mean_attention_distance,
    pointing_game,
    position_embedding_similarity,
    query_attention,
    uniform_attention_distance,
)
from vitviz.hooks import AttentionRecord, record_attention
from vitviz.images import ImageError, load_image
from vitviz.imagetext import ImageTextModel
from vitviz.model import ViT, ViTConfig
from vitviz import stems  # noqa: F401  (registers the hybrids' convolutional stems with vitviz.model)
from vitviz.pipeline import Analysis, analyze
from vitviz.preprocess import Preprocessing, preprocess
from vitviz.sources import (
    VariantSpec,
    WeightsSource,
    WeightsUnavailableError,
    default_device,
    default_variant,
    from_timm,
    from_torchvision,
    from_open_clip,
    from_transformers,
    get_spec,
    list_variants,
    load_model,
    register_source,
    weights_status,
)
from vitviz.summary import Summary, summary

__all__ = [
    "Analysis",
    "Explanation",
    "METHODS",
    "Method",
    "AttentionRecord",
    "ImageError",
    "ImageTextModel",
    "Preprocessing",
    "Summary",
    "VariantSpec",
    "ViT",
    "ViTConfig",
    "WeightsSource",
    "WeightsUnavailableError",
    "analyze",
    "Ablation", "Attribution", "ablate", "head_importance",
    "Patching", "patch", "patched_logits",
    "RegisterNeurons", "register_neurons", "with_test_time_register",
    "Concepts", "ConceptMap", "load_concepts", "concept_map",
    "Answer", "ask",
    "Clip", "VideoError", "load_video",
    "attention_received",
    "attention_rollout",
    "cls_map",
    "default_device",
    "default_variant",
    "embedding_filter_components",
    "explain",
    "from_timm",
    "from_torchvision",
    "from_open_clip",
    "from_transformers",
    "get_spec",
    "list_variants",
    "methods",
    "register_method",
    "register_source",
    "load_image",
    "load_model",
    "mean_attention_distance",
    "pointing_game",
    "position_embedding_similarity",
    "preprocess",
    "query_attention",
    "record_attention",
    "relevance_maps",
    "summary",
    "uniform_attention_distance",
    "weights_status",
]


def __getattr__(name: str):
    """Submodules on first use (`vitviz.shapes`, `vitviz.sources`, ...), so that `python -m vitviz.<module>`
    runs a module the package has not imported yet."""
    import importlib

    if name in {"shapes", "sources", "server", "relevance", "faithfulness", "evaluate", "plots", "analysis", "hooks", "model",
                "pipeline", "preprocess", "images", "imagetext", "summary", "explanations", "explainers", "layout", "dev", "config", "words",
                "inside", "registers", "patching", "concepts", "vlm", "clips"}:
        return importlib.import_module(f"vitviz.{name}")
    if name in {"Ablation", "Attribution", "ablate", "head_importance"}:  # vitviz.inside's, on first use as well
        return getattr(importlib.import_module("vitviz.inside"), name)
    if name in {"Patching", "patch", "patched_logits"}:  # vitviz.patching's, on first use
        return getattr(importlib.import_module("vitviz.patching"), name)
    if name in {"RegisterNeurons", "register_neurons", "with_test_time_register"}:  # vitviz.registers'
        return getattr(importlib.import_module("vitviz.registers"), name)
    if name in {"Concepts", "ConceptMap", "load_concepts", "concept_map"}:  # vitviz.concepts' (training is not imported)
        return getattr(importlib.import_module("vitviz.concepts.browse"), name)
    if name in {"Answer", "ask"}:  # vitviz.vlm.ask's
        return getattr(importlib.import_module("vitviz.vlm.ask"), name)
    if name in {"Clip", "VideoError", "load_video"}:  # vitviz.clips' (PyAV is imported only for MP4 and WebM)
        return getattr(importlib.import_module("vitviz.clips"), name)
    if name.startswith("from_"):  # a plugin family's conversion, `from_<its library>` (`vitviz.sources` answers)
        try:
            return getattr(importlib.import_module("vitviz.sources"), name)
        except AttributeError:
            pass
    raise AttributeError(f"module 'vitviz' has no attribute {name!r}")
