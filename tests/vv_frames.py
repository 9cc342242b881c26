"""A token layout of a user's own, outside vitviz: a ViT that sees two frames of one image (the image,
then its mirror), its patch tokens indexed (t, h, w) after the cls token. One module registers all it
takes: the model family ("frames:tiny"), its `Architecture` (how it is analysed and explained) and
its drawer (how the app draws it, `vitviz.server.pictures.drawers.PROTOCOL`).

Every map over the tokens is shown two ways: over both frames side by side (a query's attention,
the heads of a layer), or over the image, the second frame's patches mirrored back onto the image
and added to the first's (the rollout, the explanations).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from PIL import Image

import vitviz
from vitviz import Preprocessing, VariantSpec, ViTConfig, WeightsSource, plots
from vitviz.analysis import attention_received, attention_rollout, fuse_heads
from vitviz.hooks import record_attention
from vitviz.images import load_image
from vitviz.layout import Architecture, TokenLayout, register_architecture
from vitviz.model import ViT
from vitviz.preprocess import preprocess, to_input
from vitviz.relevance import feature_components, feature_similarity, keep_mass
from vitviz.sources.base import split_size

ATTENTION = "frames"
FRAMES = 2


@dataclass(frozen=True)
class FramesConfig(ViTConfig):
    """A ViT's config whose blocks see every patch once a frame: what each price reads before the model is built."""

    def tokens_of(self, patches: int) -> int:
        return self.num_prefix_tokens + FRAMES * patches


CONFIG = FramesConfig(image_size=32, patch_size=8, width=32, depth=2, heads=2, mlp_dim=64, num_classes=3)


# ------------------------------------------------------------------------------------------------
# The model and its family

class FramesViT(ViT):
    """A ViT over two frames: [cls, the image's patches, its mirror's patches], the second frame's
    patches shifted by a learned frame embedding."""

    def __init__(self, config: FramesConfig) -> None:
        super().__init__(config)
        self.frame_embed = torch.nn.Parameter(torch.randn(1, 1, config.width) * 0.5)

    def tokens(self, images: torch.Tensor) -> torch.Tensor:
        first = super().tokens(images)
        second = super().tokens(images.flip(-1))[:, self.config.num_prefix_tokens :]
        return torch.cat([first, second + self.frame_embed], dim=1)


@vitviz.register_source
class FramesSource(WeightsSource):
    name = "frames"
    prefix = "frames:"

    def _spec(self, name: str) -> VariantSpec:
        return VariantSpec(name=name, config=CONFIG, preprocessing=Preprocessing(image_size=32, resize_size=32),
                           categories=("red", "green", "blue"), source=self.name, weights="random", description="a ViT over two frames")

    def specs(self):
        return [self._spec("frames:tiny")]

    def resolve(self, name, *, weights_path=None):
        _, size = split_size(name)
        return self._spec(name).at(size) if size else self._spec(name)

    def status(self, spec):
        return "embedded"

    def load(self, spec, *, weights_path=None, progress=True):
        torch.manual_seed(3)
        model = FramesViT(spec.config)
        model.spec = spec
        return model


# ------------------------------------------------------------------------------------------------
# Its analysis, explanations and description

@dataclass
class FramesAnalysis:
    variant: str
    image: Image.Image
    patch_size: int
    grid: tuple[int, int]
    attentions: torch.Tensor  # [L, H, N, N], N = 1 + FRAMES * gh * gw
    probabilities: torch.Tensor | None
    categories: tuple[str, ...] | None
    model_seconds: float
    layout: TokenLayout
    tokens: torch.Tensor  # the final tokens [N, D]
    token_norms: torch.Tensor  # each block's output norms [L, N]
    device: str = "cpu"

    prefix_names = property(lambda self: ("cls",))
    query_names = property(lambda self: ("cls",))
    default_query = 0
    num_layers = property(lambda self: self.attentions.shape[0])

    @property
    def nbytes(self) -> int:
        return self.attentions.numel() * 4 + 3 * self.image.size[0] * self.image.size[1]

    def predictions(self, k: int = 5):
        if self.probabilities is None:
            return []
        top = self.probabilities.topk(min(k, self.probabilities.numel()))
        return [(self.categories[i], float(v)) for v, i in zip(top.values.tolist(), top.indices.tolist())]

    def frames_of(self, row: torch.Tensor) -> torch.Tensor:
        """A row over the tokens [N] -> its patches by frame [FRAMES, gh, gw]."""
        return row[1:].reshape(FRAMES, *self.grid)

    def on_image(self, frames: torch.Tensor) -> torch.Tensor:
        """[FRAMES, gh, gw] -> [gh, gw]: the second frame's patches mirrored back onto the image."""
        return frames[0] + frames[1].flip(-1)

    def rollout(self, *, head_fusion: str = "mean", discard_ratio: float = 0.0) -> torch.Tensor:
        return attention_rollout(self.attentions, head_fusion=head_fusion, discard_ratio=discard_ratio, num_prefix_tokens=1)

    def cls_map(self, *, head_fusion: str = "mean", discard_ratio: float = 0.0) -> torch.Tensor:
        return self.on_image(self.frames_of(self.rollout(head_fusion=head_fusion, discard_ratio=discard_ratio)[0]))

    def places(self) -> torch.Tensor:
        """Each patch token's centre on the image in pixels [FRAMES * gh * gw, 2] (row, column)."""
        gh, gw = self.grid
        r, c = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        rows = torch.cat([r.flatten(), r.flatten()])
        cols = torch.cat([c.flatten(), (gw - 1 - c).flatten()])  # the second frame is the mirror
        return (torch.stack([rows, cols], dim=1).float() + 0.5) * self.patch_size

    def distances(self) -> torch.Tensor:
        """Mean attention distance per layer and head [L, H] in input pixels: over the patch queries,
        the patch keys' distance on the image weighted by the query's attention (renormalised)."""
        where = self.places()
        far = torch.cdist(where, where)  # [P, P]
        patches = self.attentions[:, :, 1:, 1:]
        weights = patches / patches.sum(-1, keepdim=True)
        return (weights * far).sum(-1).mean(-1)


def _analyze_input(model: FramesViT, x: torch.Tensor, cropped: Image.Image) -> FramesAnalysis:
    spec = model.spec
    start = time.perf_counter()
    layers: list[torch.Tensor] = []
    with torch.inference_mode(), record_attention(model) as rec:
        tokens = model.encode(x[None], layers=layers)
        logits = model.head_logits(tokens)
    seconds = time.perf_counter() - start
    grid = spec.grid
    layout = TokenLayout(prefix_names=("cls",), grids=(grid,), attention=ATTENTION, classifier=True)
    return FramesAnalysis(variant=spec.name, image=cropped, patch_size=spec.patch_size, grid=grid, attentions=rec.attentions[:, 0].float(),
                          probabilities=logits[0].softmax(-1), categories=spec.categories, model_seconds=seconds, layout=layout,
                          tokens=tokens[0].float(), token_norms=torch.stack([h[0].norm(dim=-1) for h in layers]).float())


def analyze(model: FramesViT, image) -> FramesAnalysis:
    x, cropped = preprocess(load_image(image), model.spec.preprocessing)
    return _analyze_input(model, x, cropped)


def analyze_crop(model: FramesViT, cropped: Image.Image) -> FramesAnalysis:
    return _analyze_input(model, to_input(cropped, model.spec.preprocessing), cropped)


METHODS = ("attention", "rollout")


def relevance_maps(model: FramesViT, x: torch.Tensor, *, methods=METHODS, targets=None, text=None, head_fusion="mean", discard_ratio=0.0):
    """The cls token's last-layer attention and its rollout, over the image: [B, gh, gw] each."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown or text is not None:
        raise ValueError(f"{model.spec.name} offers {', '.join(METHODS)}")
    maps = {m: [] for m in methods}
    probabilities = []
    for one in x:
        cropped = Image.new("RGB", (x.shape[-1], x.shape[-2]))
        a = _analyze_input(model, one, cropped)
        probabilities.append(a.probabilities)
        if "attention" in maps:
            maps["attention"].append(a.on_image(a.frames_of(fuse_heads(a.attentions[-1], head_fusion, dim=0)[0])))
        if "rollout" in maps:
            maps["rollout"].append(a.cls_map(head_fusion=head_fusion, discard_ratio=discard_ratio))
    return {m: torch.stack(v) for m, v in maps.items()}, None, torch.stack(probabilities)


def summary_rows(model: FramesViT) -> list[list[str]]:
    c = model.config
    gh, gw = model.spec.grid
    n = c.tokens_of(gh * gw)
    return [["Two frames", "the image and its mirror", f"[B, {FRAMES}, 3, {c.image_size}, {c.image_size}]", "--"],
            ["Encoder", f"{c.depth} blocks over (t, h, w)", f"[B, {n}, {c.width}]", f"{sum(p.numel() for p in model.blocks.parameters()):,}"]]


register_architecture(FramesViT, Architecture(attention=ATTENTION, analyze=analyze, analyze_crop=analyze_crop, relevance_maps=relevance_maps,
                                              methods=METHODS, summary_rows=summary_rows,
                                              patch_filters=lambda model: model.patch_embed.proj.weight))


# ------------------------------------------------------------------------------------------------
# Its drawer: the functions of `vitviz.server.pictures.drawers.PROTOCOL`

DISCARD_RATIO = True
EXPLORER_WIDGET = None  # no browser widget: the server draws its explorer


def _side_by_side(exp) -> Image.Image:
    shown = exp.display_image
    both = Image.new("RGB", (2 * shown.size[0], shown.size[1]))
    both.paste(shown, (0, 0))
    both.paste(shown.transpose(Image.FLIP_LEFT_RIGHT), (shown.size[0], 0))
    return both


def _over_frames(exp, row: torch.Tensor, *, label: str) -> Image.Image:
    frames = exp.analysis.frames_of(row)
    heat = torch.cat(list(frames), dim=1)  # [gh, FRAMES * gw], as the frames lie side by side
    img = plots.overlay(_side_by_side(exp), heat)
    lo, hi = img.info["vitviz_range"]
    return plots.with_colorbar(img, vmin=lo, vmax=hi, label=label)


def _head_row(a: FramesAnalysis, layer: int, head: str, query: int) -> torch.Tensor:
    attn = a.attentions[layer - 1]
    if head.startswith("head "):
        return attn[int(head.split()[1]) - 1, query]
    return fuse_heads(attn[None], head, dim=1)[0, query]


def render_rollout(exp, *, head_fusion="mean", discard_ratio=0.0, token=None):
    if token is not None:
        raise ValueError("the rollout of this layout is its cls token's")
    heat = exp.analysis.cls_map(head_fusion=head_fusion, discard_ratio=discard_ratio)
    img = plots.overlay(exp.display_image, heat)
    lo, hi = img.info["vitviz_range"]
    return plots.with_colorbar(img, vmin=lo, vmax=hi, label="rollout")


def rollout_note(exp):
    return "**Two frames.** The cls token's rollout over both frames, the mirror's patches mirrored back onto the image."


def render_distance(exp):
    return plots.DistanceChart(uniform=None, title=f"{exp.analysis.variant}: mean attention distance").render(exp.analysis.distances())


def render_query(exp, *, layer, head, query, scale="layer"):
    return _over_frames(exp, _head_row(exp.analysis, layer, head, query), label="attention")


def render_head_mosaic(exp, *, layer, query, scale="layer"):
    a = exp.analysis
    tiles = [_over_frames(exp, a.attentions[layer - 1, h, query], label="") for h in range(a.attentions.shape[1])]
    return plots.mosaic(tiles, labels=[f"head {h + 1}" for h in range(len(tiles))])


def patch_at(exp, x, y):
    a = exp.analysis
    gh, gw = a.grid
    px = a.patch_size * exp.scale
    c = min(FRAMES * gw - 1, max(0, int(x // px)))
    r = min(gh - 1, max(0, int(y // px)))
    t, c = divmod(c, gw)
    return 1 + t * gh * gw + r * gw + c


def describe_query(exp, query, layer=None):
    if query == 0:
        return "query: the cls token"
    gh, gw = exp.analysis.grid
    t, rest = divmod(query - 1, gh * gw)
    r, c = divmod(rest, gw)
    return f"query: patch row {r + 1}, column {c + 1} of frame {t + 1}"


def explorer_bounds(exp, layer=None):
    a = exp.analysis
    return a.attentions.shape[0], a.attentions.shape[1], a.attentions.shape[-1]


def scale_refusal(scale):
    return None


def explorer_mode(exp):
    return "server"


def write_explorer(exp, *, key, folder):
    return {"id": key, "mode": "server"}


def maps_note(exp, missing):
    return f"Not for two frames: {', '.join(missing)}." if missing else ""


def render_positions(exp):
    from vitviz.server.pictures.views import render_filters

    return None, render_filters(exp)


def render_bias(exp, *, layer):
    raise ValueError("two frames have no relative position bias")


def render_offsets(exp, *, layer):
    raise ValueError("two frames have no one grid of offsets")


def render_stages(exp):
    return None


def render_received(exp):
    a = exp.analysis
    return plots.figure_to_image(plots.received_figure(attention_received(a.attentions).mean(dim=1), prefix_names=a.prefix_names))


def render_token_norms(exp):
    a = exp.analysis
    chart = plots.figure_to_image(plots.norms_figure(a.token_norms, prefix_names=a.prefix_names))
    return chart, _over_frames(exp, a.token_norms[-1], label="norm")


def render_outliers(exp, *, layer):
    from vitviz.registers import outliers

    a = exp.analysis
    o = outliers(a.token_norms, a.attentions, grid=(FRAMES * a.grid[0], a.grid[1]), num_prefix_tokens=1)  # the frames one above the other
    count = o.counts[layer - 1]
    shown = torch.cat([torch.zeros(1), o.norms[layer - 1].flatten()])
    return _over_frames(exp, shown, label="norm"), f"{count} high-norm tokens after block {layer}, both frames together."


def render_dino_heads(exp, *, share=0.6):
    a = exp.analysis
    rows = a.attentions[-1, :, 0]  # [H, N]: the cls token's row per head
    kept = keep_mass(rows[:, 1:], share)
    tiles = [_over_frames(exp, row * torch.cat([torch.ones(1), k.float()]), label="") for row, k in zip(rows, kept)]
    return plots.mosaic(tiles, labels=[f"head {h + 1}: {int(k.sum())} patches" for h, k in enumerate(kept)])


def _frames_grid(a, values: torch.Tensor) -> torch.Tensor:
    """Patch values in token order [FRAMES * gh * gw, k] -> [gh * FRAMES * gw, k], the frames side by side."""
    gh, gw = a.grid
    return values.reshape(FRAMES, gh, gw, -1).permute(1, 0, 2, 3).reshape(gh * FRAMES * gw, -1)


def render_features(exp):
    a = exp.analysis
    scores, explained = feature_components(a.tokens[1:], k=3)
    img = plots.features_image(_frames_grid(a, scores), (a.grid[0], FRAMES * a.grid[1]), size=exp.display_image.size[0])
    return img, f"Both frames' patch features: {100 * float(explained.sum()):.1f} % of their variance."


def write_npz(exp, path, *, attentions=True):
    import numpy as np

    a = exp.analysis
    extra = {"attentions": a.attentions.numpy()} if attentions else {}
    with open(path, "wb") as f:
        np.savez(f, **extra, rollout=a.rollout().numpy(), cls_map=a.cls_map().numpy(), frames=FRAMES, grid=np.array(a.grid), variant=a.variant)
    return path


def render_feature_similarity(exp, *, query):
    a = exp.analysis
    if query == 0:
        raise ValueError("pick a patch, not the cls token")
    return _over_frames(exp, torch.cat([torch.zeros(1), feature_similarity(a.tokens[1:], query - 1)]), label="cosine")


from vitviz.server.pictures.drawers import register_drawer  # noqa: E402  (the app's side of the plugin)

register_drawer(ATTENTION, __import__(__name__))
