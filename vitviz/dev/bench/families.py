"""The models people study now against their own library's forward, at 512 px: DINOv3 ViT-B/16 (timm;
rotary positions, four registers) and SigLIP 2 B/16 NaFlex (Hugging Face; its image tower over 32 x 32
patches, attention pooling). Random weights (nothing downloaded): the times are the architectures'."""

from __future__ import annotations

import dataclasses
import statistics

import numpy as np
import torch
from PIL import Image

import vitviz
from vitviz.dev.bench.common import _sync_of, measure

SIDE = 512


def _dinov3(device: torch.device):
    """(timm's DINOv3 B/16 at SIDE px, vitviz's conversion fed SIDE px squares, the timm call)."""
    import timm

    theirs = timm.create_model("vit_base_patch16_dinov3", pretrained=False, img_size=SIDE).eval().to(device)
    ours = vitviz.from_timm(theirs).eval()
    ours.spec = ours.spec.at(SIDE)
    x = torch.randn(1, 3, SIDE, SIDE, device=device)
    return theirs, ours, x, lambda: theirs(x)


def _siglip2(device: torch.device):
    """(Hugging Face's SigLIP 2 B/16 NaFlex, vitviz's, its image tower's call on SIDE / 16 squared patches)."""
    import transformers

    from vitviz.config import Preprocessing

    # B/16 NaFlex's two towers, as transformers' defaults make them (the text tower is not timed)
    config = transformers.Siglip2Config(text_config=dict(bos_token_id=None, eos_token_id=1, pad_token_id=1))
    config.vision_config._attn_implementation = "sdpa"
    theirs = transformers.Siglip2Model(config).eval().to(device)
    ours = vitviz.from_transformers(theirs).eval()
    p = config.vision_config.patch_size
    g = SIDE // p
    pre = ours.spec.preprocessing
    ours.spec = dataclasses.replace(ours.spec, preprocessing=Preprocessing(
        image_size=SIDE, mode="fit", patch_size=p, max_patches=g * g, mean=pre.mean, std=pre.std, interpolation=pre.interpolation))
    x = torch.randn(1, 3, SIDE, SIDE, device=device)
    pixels = x.reshape(1, 3, g, p, g, p).permute(0, 2, 4, 3, 5, 1).reshape(1, g * g, -1)
    mask = torch.ones(1, g * g, dtype=torch.long, device=device)
    shapes = torch.tensor([[g, g]], device=device)
    return theirs, ours, x, lambda: theirs.vision_model(pixel_values=pixels, pixel_attention_mask=mask, spatial_shapes=shapes)


def families_table(device: torch.device, *, rounds: int) -> list[tuple[str, float, float]]:
    """(name, median ms, ratio to the library's own forward) for each model's paths on `device`."""
    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8))
    rows = []
    for title, build in (("DINOv3 B/16 (timm)", _dinov3), ("SigLIP 2 B/16 NaFlex (Hugging Face)", _siglip2)):
        torch.manual_seed(0)
        theirs, ours, x, library = build(device)
        ours = ours.to(device)
        tower = vitviz.pipeline.image_tower(ours)

        def library_forward(library=library):
            with torch.inference_mode():
                return library()

        def ours_plain(tower=tower, x=x):
            with torch.inference_mode():
                return tower.encode(x)

        def ours_recording(tower=tower, x=x):
            with torch.inference_mode(), vitviz.record_attention(tower) as rec:
                tower.encode(x)
            return rec.attentions

        def ours_analyze(ours=ours):
            return vitviz.analyze(ours, photo)

        times = measure({f"{title}: library forward": library_forward, f"{title}: vitviz forward (fused)": ours_plain,
                         f"{title}: vitviz forward recording attention": ours_recording,
                         f"{title}: vitviz.analyze (image in, CPU tensors out)": ours_analyze},
                        rounds=rounds, sync=_sync_of(device))
        base = statistics.median(times[f"{title}: library forward"])
        rows += [(k, statistics.median(v) * 1e3, statistics.median(v) / base) for k, v in times.items()]
        del theirs, ours, tower
    return rows
