"""What a vision–language model's language side reads from its vision tower.

A VLM's vision tower is a ViT; the connector after it reads one of its layers (LLaVA the second
to last block's output, without the cls token; Idefics3/SmolVLM the last, after the final norm),
and merges r x r neighbouring patches into one language-model token (Idefics3's pixel shuffle,
Qwen2.5-VL's 2 x 2 `PatchMerger`; LLaVA keeps one token per patch). A tower converted for vitviz
carries a `TowerInfo` as its `tower_info` attribute, so that the analyses of the whole VLM
(`vitviz.ask`) can map the language model's image tokens back onto the tower's patch grid.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TowerInfo"]


@dataclass(frozen=True)
class TowerInfo:
    """Facts about a VLM's vision tower that the model's own config states.

    Attributes:
        family: the VLM's model type ("idefics3", "smolvlm", "llava", "llava_onevision", "qwen2_5_vl",
            "shapes_vlm", ...).
        feature_layer: the 0-based index of the block whose output the connector reads
            (LLaVA's `vision_feature_layer` -2 on a 24-block tower is 22).
        final_norm: the connector reads that output after the tower's final norm.
        drop_prefix: the connector drops the prefix tokens (LLaVA's "default" feature select).
        merge: each language-model image token covers merge x merge neighbouring patches.
    """

    family: str
    feature_layer: int
    final_norm: bool = False
    drop_prefix: bool = True
    merge: int = 1

    def __post_init__(self) -> None:
        if self.merge < 1:
            raise ValueError(f"merge must be at least 1, got {self.merge}")
