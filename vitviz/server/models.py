"""Loaded models for a server: a bounded cache, and what each model shows whatever the image."""

from __future__ import annotations

import shutil
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vitviz import plots, steps
from vitviz.analysis import embedding_filter_components, position_embedding_similarity, uniform_attention_distance
from vitviz.offsets import rotary_offsets
from vitviz.architectures import architecture_of
from vitviz.imagetext import ImageTextModel
from vitviz.model import ViT
from vitviz.pipeline import image_tower
from vitviz.sources import VariantSpec, list_variants, load_model, source_of
from vitviz.summary import summary
from vitviz.video.load import VIDEO_MENU
from vitviz.video.model import VideoViT

__all__ = ["ModelFacts", "ModelCache", "TooLarge", "prune_hub_cache"]


class TooLarge(RuntimeError):
    """A loaded model with more parameters than the server loads; the message says how many, and the bound."""


def _repo(spec: VariantSpec) -> str:
    """The Hugging Face repository a variant's weights come from ("" for sources outside the hub)."""
    return source_of(spec).hub_repo(spec)


def _folder_bytes(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        try:
            st = path.lstat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total


def prune_hub_cache(repos: "OrderedDict[str, None]", *, max_bytes: int, keep: str | None = None, cache: str | Path | None = None) -> int:
    """Removes the Hugging Face cache folders of `repos` (oldest first, never `keep`) until those left
    take at most `max_bytes`; removed repos leave `repos`. Returns the bytes left."""
    if cache is None:
        from huggingface_hub.constants import HF_HUB_CACHE

        cache = HF_HUB_CACHE
    folders = {r: Path(cache) / f"models--{r.replace('/', '--')}" for r in repos}
    sizes = {r: _folder_bytes(f) if f.is_dir() else 0 for r, f in folders.items()}
    total = sum(sizes.values())
    for repo in list(repos):
        if total <= max_bytes:
            break
        if repo == keep:
            continue
        shutil.rmtree(folders[repo], ignore_errors=True)
        total -= sizes[repo]
        del repos[repo]
    return total


def count_params(module: torch.nn.Module) -> int:
    """The model's parameters; for a vision–language model's tower (holding its VLM as `vlm`), the
    whole VLM's, its language model's included."""
    whole = module.__dict__.get("vlm")
    whole = getattr(whole, "model", whole)
    if isinstance(whole, torch.nn.Module):
        module = whole
    return sum(p.numel() for p in module.parameters())


@dataclass(frozen=True)
class ModelFacts:
    """What a variant shows independently of the image, computed once per loaded model. A Swin has
    no position embeddings (`similarity` None) and no one distance chart (`distance_chart` None: its
    stages differ in heads and pixels per token); a model with rotary positions has its rotary
    product by offset (`rotary`, `vitviz.offsets.rotary_offsets`), one with a relative position
    bias over the grid (BEiT's) its tables by offset (`bias`), and no similarity without a learned
    table."""

    spec: VariantSpec
    similarity: torch.Tensor | None  # [gh, gw, gh, gw] at the trained grid
    components: torch.Tensor | None  # [28, 3, P, P]; None for a hybrid (a convolutional stem before the patches: no filters over pixels)
    explained: torch.Tensor | None  # [28]
    summary_rows: list[list[str]]
    total_params: int
    uniform_distance: float | None
    distance_chart: plots.DistanceChart | None = field(repr=False, compare=False)
    rotary: torch.Tensor | None = None  # [L, H, 2gh - 1, 2gw - 1] at the trained grid
    bias: torch.Tensor | None = None  # a relative position bias (BEiT's) by offset: [L, H, 2gh - 1, 2gw - 1]
    drawn: dict = field(default_factory=dict, repr=False, compare=False)  # pictures of these facts, drawn once

    @classmethod
    def of(cls, model) -> "ModelFacts":
        """The facts of a ViT, or of an image–text model's image tower (what the views show), or of a
        model of its own architecture (`vitviz.architectures`: its filters and its stage table)."""
        own = architecture_of(model)
        if own is not None:
            with torch.no_grad():
                comps, explained = embedding_filter_components(own.patch_filters(model).detach().cpu(), k=28)
            total = count_params(model)
            return cls(spec=model.spec, similarity=None, components=comps, explained=explained,
                       summary_rows=own.summary_rows(model) + [["Total", "", "", f"{total:,}"]], total_params=total,
                       uniform_distance=None, distance_chart=None)
        spec: VariantSpec = model.spec
        tower = image_tower(model)
        c = tower.config
        with torch.no_grad():
            sim = None
            if tower.pos_embed is not None:
                patch_pos = tower.pos_embed[:, c.pos_embed_prefix :].detach().cpu()
                sim = position_embedding_similarity(patch_pos, grid=c.grid, num_prefix_tokens=0)
            rotary = rotary_offsets(tower) if c.rope else None
            bias = torch.stack([b.attn.rel_pos.offsets().detach().float().cpu() for b in tower.blocks]) if c.rel_pos_bias else None
            comps, explained = (None, None) if c.stem else embedding_filter_components(tower.patch_embed.proj.weight.cpu(), k=28)
        s = summary(tower)
        uniform = uniform_attention_distance(spec.grid, patch_size=spec.patch_size)
        return cls(spec=spec, similarity=sim, components=comps, explained=explained,
                   summary_rows=s.table() + [["Total", "", "", f"{s.total_params:,}"]], total_params=s.total_params,
                   uniform_distance=uniform,
                   distance_chart=plots.DistanceChart(uniform=uniform, title=f"{spec.name}: mean attention distance per head"),
                   rotary=rotary, bias=bias)


class ModelCache:
    """Loaded models, least recently used evicted first.

    At most `max_models` models and at most `max_bytes` of parameters are kept; the model just
    asked for always stays. Loads are serialised per variant, so two sessions asking for the same
    variant load it once. With `max_params`, a loaded model of more parameters (every tower counted)
    is refused (`TooLarge`) and not kept: the bound holds also where a name could not be counted
    before loading (`WeightsSource.num_params` counts what the spec says). On a CUDA device a model of
    more than `HALF_ABOVE` parameters is kept in bfloat16 (its attention still computed in float32).
    """

    HALF_ABOVE = 300_000_000

    def __init__(self, *, max_models: int = 3, max_bytes: int = 3 * 1024**3, device: str | torch.device | None = None,
                 hub_bytes: int | None = None, keep_repos: set[str] | None = None, max_params: int | None = None) -> None:
        self.max_models = max_models
        self.max_bytes = max_bytes
        self.max_params = max_params
        self.device = device
        self.hub_bytes = hub_bytes
        # the hub repositories of the menu's models: never removed, whoever named them
        if keep_repos is None:  # the image menu's and the Video tab's (`vitviz.video.load.VIDEO_MENU`)
            keep_repos = {_repo(s) for s in list_variants() if _repo(s)} | {n.removeprefix("hf:") for n in VIDEO_MENU if n.startswith("hf:")}
        self.menu_repos = set(keep_repos)
        self._models: OrderedDict[str, tuple[ViT, ModelFacts]] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}
        self._hub_repos: OrderedDict[str, None] = OrderedDict()  # repos fetched for names outside the menu, oldest first

    @staticmethod
    def _bytes(model: ViT) -> int:
        """The weights the model holds: a VLM's tower's and its whole VLM's (each tensor once; a Hugging
        Face VLM's tower is a converted copy beside the model's own)."""
        whole = model.__dict__.get("vlm")
        whole = getattr(whole, "model", whole)
        held = {id(p): p for p in model.parameters()}
        if isinstance(whole, torch.nn.Module):
            held.update((id(p), p) for p in whole.parameters())
        return sum(p.numel() * p.element_size() for p in held.values())

    def loaded(self) -> list[str]:
        with self._lock:
            return list(self._models)

    def get(self, name: str, *, load: Callable[..., torch.nn.Module] | None = None) -> tuple[ViT, ModelFacts | None]:
        """The model and its facts, loading (and maybe downloading) on first use.

        Args:
            load: how `name` is loaded, `load(name, device=...)`; default `vitviz.load_model`. A model
                that is no image model (a `vitviz.video.VideoViT`) is kept without facts (None).
        """
        with self._lock:
            if name in self._models:
                self._models.move_to_end(name)
                return self._models[name]
            load_lock = self._loading.setdefault(name, threading.Lock())
        with load_lock, steps.without_steps():  # (others may wait for this lock: the load is not set aside halfway)
            with self._lock:
                if name in self._models:
                    self._models.move_to_end(name)
                    return self._models[name]
            model = (load or load_model)(name, device=self.device)
            repo = _repo(model.spec)
            count = count_params(model)
            if self.max_params is not None and count > self.max_params:
                del model
                self._fetched(repo, keep=None)  # its files count within the hub's budget, oldest first
                raise TooLarge(f"{name} has {count:,} parameters, all its towers together; this server loads models of up "
                               f"to {self.max_params:,} (VITVIZ_MAX_PARAMS).")
            if next(model.parameters()).device.type == "cuda" and count > self.HALF_ABOVE:
                model = model.to(torch.bfloat16)  # half the memory and the time; attention and its records in float32
            if isinstance(model, ImageTextModel) and model.labels is not None:
                model.label_embeddings(model.labels)  # zero-shot labels encoded with the load, not inside a request
            entry = (model, None if isinstance(model, VideoViT) else ModelFacts.of(model))
            with self._lock:
                self._models[name] = entry
                self._evict(keep=name)
            self._fetched(repo, keep=repo)
            return entry

    def _fetched(self, repo: str, *, keep: str | None) -> None:
        """A hub repository fetched for a name outside the menu: the newest, and the cache of such
        repositories pruned within `hub_bytes`, oldest first (never `keep`; files removed outside the lock)."""
        if not repo or repo in self.menu_repos or self.hub_bytes is None:
            return
        with self._lock:
            self._hub_repos[repo] = None
            self._hub_repos.move_to_end(repo)
            repos = OrderedDict(self._hub_repos)
        prune_hub_cache(repos, max_bytes=self.hub_bytes, keep=keep)
        with self._lock:
            for gone in set(self._hub_repos) - set(repos):
                self._hub_repos.pop(gone, None)

    def _evict(self, *, keep: str) -> None:
        def total() -> int:
            return sum(self._bytes(m) for m, _ in self._models.values())

        while len(self._models) > 1 and (len(self._models) > self.max_models or total() > self.max_bytes):
            oldest = next(k for k in self._models if k != keep)
            del self._models[oldest]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
