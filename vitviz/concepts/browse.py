"""Browsing a sparse autoencoder's features: what a trained top-k SAE (Gao et al. 2024, "Scaling and
evaluating sparse autoencoders"; `vitviz.concepts.sae`) finds in one image, the strongest examples
each feature has in its training data, its direct effect on the logits, and where to find the SAEs
trained for a model. Bricken et al. 2023 ("Towards Monosemanticity") browse features so: a feature's
activation over the input, its top examples, and the logits it pushes up.

    concepts = load_concepts("runs/shapes_p16-l3")            # a folder `vitviz.concepts.train` wrote
    result = vitviz.analyze(model, "photo.png", concepts=concepts)
    features = result.concepts(concepts)                      # a `ConceptMap`: z [N, F] at the SAE's layer
    features.top((2, 3))                                      # [(feature, activation)] of patch row 2, column 3
    features.feature_map(17)                                  # [gh, gw]
    concepts.examples(17)                                     # [(thumbnail, image, token, value)]
    concepts.logit_effect(model)                              # [F, C]
    vitviz.ablate(model, "photo.png", features=[17], concepts=concepts)   # feature 17 switched off

The layer of an SAE is the residual stream after block `layer` (0-based: `ViT.encode`'s
`layers[layer]`), before the final norm. Folders are found by `concept_folders`: the embedded ones
(`assets/concepts/<name>/`) and those listed in $VITVIZ_CONCEPTS (the operator's, never a client's).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from PIL import Image
from torch import nn

from vitviz.imagetext import ImageTextModel
from vitviz.inside.stream import _as_input, _classes, _labels, _tower, _unembed, readout_of
from vitviz.model import ViT
from vitviz.sources import assets_dir

__all__ = ["ConceptFolder", "ConceptMap", "Concepts", "Example", "ENV", "TOKENS", "concept_folders", "concept_map",
           "load_concepts", "sae_site"]

ENV = "VITVIZ_CONCEPTS"  # folders of concepts beside the embedded ones, os.pathsep-separated (the operator's)
TOKENS = ("patches", "all")  # the tokens an SAE was trained on (card["tokens"])

LOG = logging.getLogger("vitviz.concepts")


class Example(NamedTuple):
    """One of a feature's strongest examples in the SAE's data."""

    thumbnail: Image.Image  # the atlas' cell
    image: str  # the image's path, as the card lists it (relative to the data's folder)
    token: int  # the token that fired (prefix tokens, then the patches row by row)
    value: float  # the feature's activation there


def _feature(f: object, features: int) -> int:
    if isinstance(f, bool) or not isinstance(f, (int, torch.Tensor)) or (isinstance(f, torch.Tensor) and f.numel() != 1):
        raise TypeError(f"a feature is a whole number, got {type(f).__name__}")
    f = int(f)
    if not 0 <= f < features:
        raise ValueError(f"feature {f} is outside 0..{features - 1}")
    return f


def _shape(t: torch.Tensor, want: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != want:
        raise ValueError(f"{what} is {list(t.shape)}; the card says {list(want)}")


@dataclass
class Concepts:
    """A trained SAE with what was recorded of its features (`vitviz.concepts.store`'s folder, read).

    Attributes:
        sae: the `TopKSAE` (W_dec [D, F]).
        card: the card (model, layer, tokens, d_in, features, k, metrics, classes, images, thumb, ...).
        index: "top_values" [F, n], "top_images" [F, n] (into card["images"], -1 where fewer),
            "top_tokens" [F, n], "frequency" [F], and "class_means" [F, C] when the data had classes.
        atlas: row f, column j: the j-th strongest example of feature f (thumb x thumb px).
        path: the folder it was read from, or None.
    """

    sae: nn.Module
    card: dict[str, Any] = field(repr=False)
    index: dict[str, torch.Tensor] = field(repr=False)
    atlas: Image.Image = field(repr=False)
    path: Path | None = None

    def __post_init__(self) -> None:
        w = getattr(self.sae, "W_dec", None)
        if not isinstance(w, torch.Tensor) or w.ndim != 2 or not callable(getattr(self.sae, "encode", None)):
            raise TypeError(f"expected a TopKSAE (W_dec [D, F] and encode), got {type(self.sae).__name__}")
        card = self.card
        if not isinstance(card.get("model"), str) or isinstance(card.get("layer"), bool) or not isinstance(card.get("layer"), int) \
                or card["layer"] < 0:
            raise ValueError("the card names the model (a string) and its layer (a block index, 0 or more)")
        d, f = w.shape
        for key, value in (("d_in", d), ("features", f)):
            if key in card and card[key] != value:
                raise ValueError(f"the card's {key} is {card[key]}; its SAE's is {value}")
        if self.tokens not in TOKENS:
            raise ValueError(f'the card\'s tokens are {self.tokens!r}; they are "patches" or "all"')
        top = self.index.get("top_values")
        if top is None or top.ndim != 2 or top.shape[0] != f:
            raise ValueError(f"the index's top_values are [F, n] with F = {f} features")
        for key in ("top_images", "top_tokens"):
            _shape(self.index[key], tuple(top.shape), f"the index's {key}")
        _shape(self.index["frequency"], (f,), "the index's frequency")
        means, classes = self.index.get("class_means"), self.classes
        if means is not None and (means.ndim != 2 or means.shape[0] != f or (classes is not None and means.shape[1] != len(classes))):
            raise ValueError(f"the index's class_means are {list(means.shape)}; [F, C] with F = {f} and C the card's classes")
        t = self.thumb
        if self.atlas.width < top.shape[1] * t or self.atlas.height < f * t:
            raise ValueError(f"the atlas is {self.atlas.width}x{self.atlas.height} px; {top.shape[1]} examples of {f} features of "
                             f"{t} px need {top.shape[1] * t}x{f * t}")

    @property
    def layer(self) -> int:
        """The block after which the SAE reads the stream (0-based)."""
        return int(self.card["layer"])

    @property
    def model_name(self) -> str:
        return str(self.card["model"])

    @property
    def features(self) -> int:
        return int(self.sae.W_dec.shape[1])

    @property
    def d_in(self) -> int:
        return int(self.sae.W_dec.shape[0])

    @property
    def k(self) -> int:
        return int(getattr(self.sae, "k", self.card.get("k", 0)))

    @property
    def tokens(self) -> str:
        """The tokens it was trained on: "patches" or "all" (prefix tokens too)."""
        return str(self.card.get("tokens", "all"))

    @property
    def thumb(self) -> int:
        return int(self.card.get("thumb", 0) or 1)

    @property
    def top_n(self) -> int:
        return int(self.index["top_values"].shape[1])

    @property
    def classes(self) -> list[str] | None:
        c = self.card.get("classes")
        return None if c is None else [str(v) for v in c]

    @property
    def class_means(self) -> torch.Tensor | None:
        """Each feature's mean activation over each class's images [F, C], or None."""
        return self.index.get("class_means")

    @property
    def frequency(self) -> torch.Tensor:
        """The share of the data's tokens on which each feature fires [F]."""
        return self.index["frequency"]

    @property
    def nbytes(self) -> int:
        """Bytes it holds: the SAE's weights, the index and the atlas' pixels."""
        tensors = [*self.sae.parameters(), *self.index.values()]
        return sum(t.numel() * t.element_size() for t in tensors) + self.atlas.width * self.atlas.height * len(self.atlas.getbands())

    def to(self, device: torch.device | str) -> Concepts:
        """The SAE moved to `device` (it encodes where its weights are); returns itself."""
        self.sae.to(device)
        return self

    def top_class(self, feature: int) -> str | None:
        """The class whose images the feature fires on most (card["classes"] and class_means), or None."""
        f = _feature(feature, self.features)
        means, classes = self.class_means, self.classes
        if means is None or classes is None or not len(classes):
            return None
        return classes[int(means[f].argmax())]

    def examples(self, feature: int) -> list[Example]:
        """The feature's strongest examples, strongest first (fewer where it fired on fewer tokens)."""
        f = _feature(feature, self.features)
        images, t = self.card.get("images") or [], self.thumb
        out = []
        for j, (v, i, tok) in enumerate(zip(self.index["top_values"][f].tolist(), self.index["top_images"][f].tolist(),
                                            self.index["top_tokens"][f].tolist())):
            if i < 0:
                continue
            thumb = self.atlas.crop((j * t, f * t, (j + 1) * t, (f + 1) * t))
            out.append(Example(thumb, str(images[i]) if i < len(images) else "", int(tok), float(v)))
        return out

    def atlas_row(self, feature: int) -> Image.Image:
        """The atlas' row of the feature: its strongest examples side by side (top_n x thumb px wide)."""
        f, t = _feature(feature, self.features), self.thumb
        return self.atlas.crop((0, f * t, self.top_n * t, (f + 1) * t)).convert("RGB")

    def check(self, model: ViT | ImageTextModel) -> None:
        """Raises a clear ValueError unless the SAE reads a stream of this model: its width, a block it has."""
        check_fits(_tower(model), self.sae, self.layer)

    def logit_effect(
        self, model: ViT | ImageTextModel, *, features: Sequence[int] | None = None, analysis: Any = None,
        labels: Sequence[str] | None = None, template: str | None = None,
    ) -> torch.Tensor:
        """Each feature's direct effect on the logits [F, C] (or [len(features), C]): its decoder
        direction d_f (one unit of the feature) added to every token the classifier reads (the cls
        token; every patch for a mean-pooled model), read through the final norm's γ with the norm's
        mean taken off (a LayerNorm; an RMSNorm is not centred) and its σ held constant, then through
        the head: a classifier's rows, or an image–text model's projection and label embeddings
        linearised as `vitviz.inside.Unembed.direction` does (exp(s) Pᵀ text / ||P z||).

            effect[f, c] = Σ_q (1 / σ_q) r_{c,q} · (γ ⊙ centre(d_f))        (no bias: a direction's effect)

        The σ convention: with `analysis` (an `Analysis` of this model, with its recorded stream
        `inside`), σ_q is the final norm's σ of the readout token q in that forward (for a model that
        normalises each patch before the mean, the mean of 1/σ over the patches) and ||P z|| the
        image–text embedding's norm there: the effect at that image, as `attribution_of` freezes them.
        Without it, σ = 1 and ||P z|| = 1: the effect in units of the stream's own scale, the same for
        every image (rank features by it; multiply by 1/σ of an image to read it in logits).

        Raises:
            ValueError: the model reads its stream through attention pooling (SigLIP's MAP head: not
                linear), the SAE does not fit it, or `analysis` is of another model.
        """
        tower = _tower(model)
        self.check(model)
        readout, q, norm = readout_of(tower)
        if readout == "attention pool":
            raise ValueError("this model reads its stream by attention pool (SigLIP's MAP head), which is not linear: a direction "
                             "has no one effect on the logits")
        picked = range(self.features) if features is None else [_feature(f, self.features) for f in features]
        with torch.no_grad():
            d = self.sae.W_dec.detach().float().cpu()[:, list(picked)].T  # [F', D]
            if isinstance(norm, nn.LayerNorm):
                d = d - d.mean(dim=-1, keepdim=True)
            gamma = getattr(norm, "weight", None)
            if gamma is not None:
                d = d * gamma.detach().float().cpu()
            inverse, embed_norm = self._inverse_sigma(readout, q, analysis)
            labels = _labels(model, labels, template)
            _classes(model, labels, template)  # (a clear error where there is nothing to score)
            unembed = _unembed(model, labels, template)
            if unembed.image_text:
                row = d if unembed.projection is None else d @ unembed.projection.T  # [F', E]
                return (unembed.logit_scale / embed_norm) * float(inverse.mean()) * (row @ unembed.weight[0].T)
            w = unembed.weight  # [Q, C, D]
            return torch.einsum("fd,qcd,q->fc", d, w, inverse) / w.shape[0]

    def _inverse_sigma(self, readout: str, q: int, analysis: Any) -> tuple[torch.Tensor, float]:
        """(1/σ per readout query [Q], ||P z||) from `analysis`' recorded stream, or ones."""
        stream = getattr(analysis, "inside", None) if analysis is not None else None
        if analysis is not None and (stream is None or stream.sigma is None):
            raise ValueError("the analysis has no recorded stream with the final norm's σ (a model without a head or labels, "
                             "or one whose logit does not split)")
        if stream is None:
            return torch.ones(q), 1.0
        inverse = 1.0 / stream.sigma.float()
        if readout == "normed mean":
            inverse = inverse.mean().reshape(1)
        if inverse.numel() != q:
            raise ValueError(f"the analysis reads {inverse.numel()} queries, this model {q}: it is of another model")
        embed = stream.unembed._embed(stream.normed[-1].double()) if stream.unembed.image_text else None
        return inverse, float(embed.norm()) if embed is not None else 1.0


def check_fits(tower: ViT, sae: nn.Module, layer: int) -> None:
    """Raises a clear ValueError unless `sae` reads `tower`'s stream after block `layer`."""
    if not isinstance(tower, ViT):
        raise TypeError(f"a sparse autoencoder reads a vitviz ViT's residual stream; got {type(tower).__name__}")
    d, depth = tower.config.width, len(tower.blocks)
    width = int(sae.W_dec.shape[0])
    name = getattr(getattr(tower, "spec", None), "name", "this model")
    if width != d:
        raise ValueError(f"this sparse autoencoder reads a stream {width} wide; {name} is {d} wide")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < depth:
        raise ValueError(f"this sparse autoencoder reads the stream after block {layer}; {name} has blocks 0..{depth - 1}")


def sae_site(concepts: Concepts | nn.Module, layer: int | None = None) -> tuple[nn.Module, int, str]:
    """(the SAE, its layer, the tokens it reads: "patches" or "all") of a `Concepts` (its own layer)
    or of a bare `TopKSAE` read at `layer` (on every token)."""
    if isinstance(concepts, Concepts):
        if layer is not None and layer != concepts.layer:
            raise ValueError(f"these concepts are of the stream after block {concepts.layer}, not {layer}")
        return concepts.sae, concepts.layer, concepts.tokens
    if not isinstance(getattr(concepts, "W_dec", None), torch.Tensor) or not callable(getattr(concepts, "encode", None)):
        raise TypeError(f"expected Concepts or a TopKSAE, got {type(concepts).__name__}")
    if layer is None:
        raise ValueError("a bare TopKSAE does not know its layer: pass layer=L (or the Concepts that load_concepts reads)")
    return concepts, layer, "all"


@dataclass
class ConceptMap:
    """An SAE's features on every token of one image, at one layer, on the CPU.

    Attributes:
        layer: the block after which the stream was read.
        features: F.
        indices, values: each token's non-zero features and their activations [N, k] (top-k: at
            most k of F per token; `z` is the dense [N, F]).
        error: each token's reconstruction error ||x − x̂|| [N] (x̂ = decode(encode(x))).
        norm: each token's ||x|| [N] (error / norm: the share of the token left unexplained).
        grid: the patch grid (gh, gw); num_prefix_tokens: the tokens before the patches.
    """

    layer: int
    features: int
    indices: torch.Tensor = field(repr=False)
    values: torch.Tensor = field(repr=False)
    error: torch.Tensor = field(repr=False)
    norm: torch.Tensor = field(repr=False)
    grid: tuple[int, int]
    num_prefix_tokens: int

    @classmethod
    def of(cls, x: torch.Tensor, sae: nn.Module, *, layer: int, grid: tuple[int, int], num_prefix_tokens: int) -> ConceptMap:
        """The map of the stream x [N, D] (prefix tokens, then the patches row by row), encoded where the SAE's weights are."""
        n = num_prefix_tokens + grid[0] * grid[1]
        if x.ndim != 2 or x.shape[0] != n:
            raise ValueError(f"expected the stream of {n} tokens [N, D], got {list(x.shape)}")
        p = next(sae.parameters())
        with torch.inference_mode():
            xs = x.to(device=p.device, dtype=p.dtype)
            z = sae.encode(xs)
            error = (xs - sae.decode(z)).norm(dim=-1).float().cpu()
            z = z.float().cpu()
        kept = max(1, int((z != 0).sum(dim=-1).max()))
        indices = z.abs().topk(kept, dim=-1).indices
        return cls(layer=layer, features=int(z.shape[-1]), indices=indices, values=z.gather(-1, indices), error=error,
                   norm=xs.norm(dim=-1).float().cpu(), grid=tuple(grid), num_prefix_tokens=num_prefix_tokens)

    @property
    def num_tokens(self) -> int:
        return self.indices.shape[0]

    @property
    def z(self) -> torch.Tensor:
        """The features of every token [N, F] (float32, all but the top-k zero)."""
        return torch.zeros(self.num_tokens, self.features).scatter(-1, self.indices, self.values)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.indices, self.values, self.error, self.norm))

    def token(self, at: int | tuple[int, int]) -> int:
        """A token index (prefix tokens, then the patches row by row), or a patch (row, col) -> its token index."""
        if isinstance(at, tuple) and len(at) == 2:
            (r, c), (gh, gw) = (int(v) for v in at), self.grid
            if not (0 <= r < gh and 0 <= c < gw):
                raise ValueError(f"patch ({r}, {c}) is outside the {gh}x{gw} grid")
            return self.num_prefix_tokens + r * gw + c
        if isinstance(at, bool) or not isinstance(at, int):
            raise TypeError(f"a token is an index or a patch (row, col), got {at!r}")
        if not 0 <= at < self.num_tokens:
            raise ValueError(f"token {at} is outside 0..{self.num_tokens - 1}")
        return at

    def top(self, at: int | tuple[int, int], k: int = 5) -> list[tuple[int, float]]:
        """The k strongest features of a token (index) or patch ((row, col)): [(feature, activation)], largest first."""
        t = self.token(at)
        pairs = [(int(f), float(v)) for f, v in zip(self.indices[t].tolist(), self.values[t].tolist()) if v != 0]
        return sorted(pairs, key=lambda p: -p[1])[: max(0, int(k))]

    def feature_map(self, feature: int) -> torch.Tensor:
        """Feature `feature`'s activation over the patches [gh, gw] (0 where it is not among a patch's top-k)."""
        f = _feature(feature, self.features)
        p = self.num_prefix_tokens
        hits = (self.indices[p:] == f) * self.values[p:]
        return hits.sum(dim=-1).reshape(self.grid)


def concept_map(model: ViT | ImageTextModel, image: Any, concepts: Concepts | nn.Module, *, layer: int | None = None) -> ConceptMap:
    """The SAE's features on `image` (anything `vitviz.load_image` takes, through the model's own
    preprocessing, or a prepared [3, S, S]): the model run up to the SAE's layer only, then encoded.
    A bare TopKSAE is read at `layer`."""
    sae, layer, _ = sae_site(concepts, layer)
    tower = _tower(model)
    check_fits(tower, sae, layer)
    x = _as_input(model, image)[:1]
    grid = tower.grid_for(x.shape[2], x.shape[3])
    with torch.inference_mode():
        s = tower.stream_after(x, layer)
    return ConceptMap.of(s[0], sae, layer=layer, grid=grid, num_prefix_tokens=tower.config.num_prefix_tokens)


def load_concepts(path: str | os.PathLike) -> Concepts:
    """The folder `vitviz.concepts.train` wrote (`vitviz.concepts.store.read_concepts`), as `Concepts`."""
    from vitviz.concepts.store import read_concepts

    sae, card, index, atlas = read_concepts(path)
    sae.eval()
    return Concepts(sae=sae, card=card, index=index, atlas=atlas, path=Path(path))


# ----------------------------------------------------------------------------- the folders a server knows


@dataclass(frozen=True)
class ConceptFolder:
    """A folder of concepts found by `concept_folders`: where, its name (unique among those found), and its card."""

    path: Path
    name: str
    card: dict = field(repr=False, compare=False)

    @property
    def model(self) -> str:
        return str(self.card.get("model", ""))

    @property
    def layer(self) -> int:
        return int(self.card.get("layer", -1))

    @property
    def features(self) -> int:
        return int(self.card.get("features", 0))

    def describe(self) -> str:
        """One line: its name, layer (1-based, as the page counts blocks), features and k."""
        k = self.card.get("k")
        return (f"{self.name}: after block {self.layer + 1}, {self.features:,} features"
                + (f", {k} active per token" if k else ""))


def _card(folder: Path) -> dict | None:
    try:
        card = json.loads((folder / "card.json").read_text())
    except (OSError, ValueError) as exc:
        LOG.warning("skipped the concepts in %s: %s", folder, exc)
        return None
    return card if isinstance(card, dict) and isinstance(card.get("model"), str) and isinstance(card.get("layer"), int) else None


def _candidates() -> list[Path]:
    """The embedded folders (assets/concepts/*), then $VITVIZ_CONCEPTS' (each a folder of concepts, or
    a folder of such folders)."""
    embedded = assets_dir() / "concepts"
    found = sorted(p for p in embedded.iterdir() if p.is_dir()) if embedded.is_dir() else []
    for entry in (os.environ.get(ENV) or "").split(os.pathsep):
        folder = Path(entry.strip()).expanduser() if entry.strip() else None
        if folder is None or not folder.is_dir():
            continue
        found += [folder] if (folder / "card.json").is_file() else sorted(p for p in folder.iterdir() if (p / "card.json").is_file())
    return found


def concept_folders(model: str | None = None) -> list[ConceptFolder]:
    """The concept folders this process knows: embedded ones first, then $VITVIZ_CONCEPTS' (read each
    call); with `model`, those whose card names it (or the variant it is a size of: "shapes_p16" for
    "shapes_p16@192"). Names are the folders' own, made unique with "-2", "-3", ..."""
    out: list[ConceptFolder] = []
    names: set[str] = set()
    seen: set[Path] = set()
    for folder in _candidates():
        where = folder.resolve()
        card = _card(folder) if where not in seen else None
        seen.add(where)
        if card is None:
            continue
        name, n = folder.name, 1
        while name in names:
            n += 1
            name = f"{folder.name}-{n}"
        names.add(name)
        out.append(ConceptFolder(path=folder, name=name, card=card))
    if model is not None:
        base = model.rpartition("@")[0] or model
        out = [c for c in out if c.model in (model, base)]
    return out
