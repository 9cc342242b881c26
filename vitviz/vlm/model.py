"""`shapes_vlm`: a small vision–language model of vitviz's own, embedded and offline.

A vision tower (a vitviz `ViT`), a connector that merges r x r neighbouring patches (a pixel
shuffle, as Idefics3's, then a two-layer MLP, as LLaVA's projector), and a causal language decoder
over a vocabulary of the shapes scenes' words (`VOCABULARY`). The prompt is

    <bos> <image> x M  what colour is the star ?

with the M image tokens replaced by the connector's outputs (row-major over the merged grid); the
answer follows, ended by <end>. It answers "what colour is the <shape> ?", "where is the <colour>
<shape> ?" (top or bottom, left or right) and "how many shapes are there ?" (`vitviz.vlm.scenes`).
`python -m vitviz.dev.train_shapes_vlm` makes its weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from einops import rearrange
from torch import nn

from vitviz.config import ViTConfig
from vitviz.imagetext import TextAttention
from vitviz.model import ViT
from vitviz.shapes import CLASSES, COLORS
from vitviz.vlm.protocol import VLM, AskShape, Prompt
from vitviz.vlm.towers import TowerInfo

__all__ = ["VOCABULARY", "ShapesVLMConfig", "ShapesVLM", "ShapesVLMRunner", "VLMWords", "pixel_shuffle", "shapes_vlm_config"]

PAD, BOS, IMAGE, END, UNKNOWN = "<pad>", "<bos>", "<image>", "<end>", "<unknown>"
_WORDS = ("what", "colour", "color", "is", "the", "where", "how", "many", "shapes", "are", "there", "?",
          "top", "bottom", "left", "right", "one", "two", "three", "four")
VOCABULARY: tuple[str, ...] = (PAD, BOS, IMAGE, END, UNKNOWN, *_WORDS, *COLORS, *CLASSES)
_TOKEN = re.compile(r"[a-z]+|\?")


class VLMWords:
    """Questions and answers <-> ids over `VOCABULARY` (words lower-cased; "?" a word of its own;
    anything else separates words; an unknown word is `<unknown>`)."""

    vocabulary = VOCABULARY

    def __init__(self) -> None:
        self._ids = {w: i for i, w in enumerate(self.vocabulary)}
        self.pad_id, self.bos_id, self.image_id, self.end_id, self.unknown_id = (self._ids[w] for w in (PAD, BOS, IMAGE, END, UNKNOWN))

    def __len__(self) -> int:
        return len(self.vocabulary)

    def words(self, text: str) -> list[str]:
        return _TOKEN.findall(text.lower())

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(w, self.unknown_id) for w in self.words(text)]

    def question(self, text: str, image_tokens: int) -> list[int]:
        """The prompt's ids: <bos>, the image tokens, the question (with a "?" at its end)."""
        ids = self.encode(text)
        if not ids or ids[-1] != self._ids["?"]:
            ids.append(self._ids["?"])
        return [self.bos_id, *([self.image_id] * image_tokens), *ids]

    def piece(self, token_id: int) -> str:
        word = self.vocabulary[token_id] if 0 <= token_id < len(self.vocabulary) else UNKNOWN
        return word if word.startswith("<") else " " + word


@dataclass(frozen=True)
class ShapesVLMConfig:
    """The architecture of a `ShapesVLM`.

    Attributes:
        vision: the vision tower's config (no head).
        merge: r: the connector merges r x r patches into one language-model token.
        feature_layer: the tower's block whose output the connector reads (0-based; -1: the last,
            after the tower's final norm; an earlier block's output is read before any norm).
        width, depth, heads, mlp_dim: the decoder's.
        max_len: the longest sequence (prompt and answer) the decoder takes.
    """

    vision: ViTConfig = field(default_factory=lambda: ViTConfig(image_size=96, patch_size=8, width=96, depth=6, heads=3,
                                                                 mlp_dim=192, num_classes=0))
    merge: int = 2
    feature_layer: int = -1
    width: int = 128
    depth: int = 3
    heads: int = 4
    mlp_dim: int = 256
    max_len: int = 64

    def __post_init__(self) -> None:
        gh, gw = self.vision.grid
        if gh % self.merge or gw % self.merge:
            raise ValueError(f"the tower's {gh} x {gw} grid is not a whole number of {self.merge} x {self.merge} merges")
        if self.vision.num_classes:
            raise ValueError("the vision tower of a VLM has no classification head")
        if not -1 <= self.feature_layer < self.vision.depth:
            raise ValueError(f"feature_layer {self.feature_layer} is not one of the tower's blocks 0..{self.vision.depth - 1} (or -1)")

    @property
    def reads(self) -> tuple[int, bool]:
        """(the block whose output the connector reads, whether after the final norm)."""
        last = self.feature_layer in (-1, self.vision.depth - 1)
        return (self.vision.depth - 1 if self.feature_layer == -1 else self.feature_layer), self.feature_layer == -1 and last

    @property
    def token_grid(self) -> tuple[int, int]:
        gh, gw = self.vision.grid
        return gh // self.merge, gw // self.merge

    @property
    def image_tokens(self) -> int:
        return self.token_grid[0] * self.token_grid[1]


def shapes_vlm_config(feature_layer: int = 3) -> ShapesVLMConfig:
    """The architecture of the embedded `shapes_vlm`: `shapes_clip`'s image tower (patch 16 at 96 px,
    a 6 x 6 grid) read after its block 3 (`feature_layer`, of 0-5: tokens still local, before the
    last blocks mix the scene into every token), one language-model token a patch (merge 1), a
    decoder of 3 blocks, 128 wide, 4 heads, sequences of at most 64 tokens."""
    vision = ViTConfig(image_size=96, patch_size=16, width=96, depth=6, heads=3, mlp_dim=192, num_classes=0)  # shapes_clip's
    return ShapesVLMConfig(vision=vision, merge=1, feature_layer=feature_layer, width=128, depth=3, heads=4, mlp_dim=256, max_len=64)


def pixel_shuffle(tokens: torch.Tensor, grid: tuple[int, int], r: int) -> torch.Tensor:
    """Patch tokens [B, gh*gw, D] (row-major) -> [B, (gh/r)*(gw/r), r*r*D]: each r x r block of
    neighbouring patches one token (row-major over the merged grid; the block's patches
    concatenated row by row)."""
    gh, gw = grid
    return rearrange(tokens, "b (h r1 w r2) d -> b (h w) (r1 r2 d)", h=gh // r, r1=r, w=gw // r, r2=r)


class _DecoderBlock(nn.Module):
    def __init__(self, c: ShapesVLMConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(c.width)
        self.attn = TextAttention(width=c.width, heads=c.heads)
        self.norm2 = nn.LayerNorm(c.width)
        self.mlp = nn.Sequential(nn.Linear(c.width, c.mlp_dim), nn.GELU(), nn.Linear(c.mlp_dim, c.width))

    def forward(self, x: torch.Tensor, keep: list[torch.Tensor] | None) -> torch.Tensor:
        n = x.shape[1]
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        causal = torch.zeros(n, n, dtype=x.dtype, device=x.device).masked_fill(future, torch.finfo(x.dtype).min)
        if keep is None:
            x = x + self.attn(self.norm1(x), causal)
        else:  # the softmax's output, the tensor the values are multiplied with (in the autograd graph)
            hook = self.attn.attend.register_forward_hook(lambda _m, _i, out: keep.append(out))
            try:
                x = x + self.attn(self.norm1(x), causal)
            finally:
                hook.remove()
        return x + self.mlp(self.norm2(x))


class ShapesVLM(nn.Module):
    """The vision tower, the connector and the decoder (module docstring).

    Attributes:
        tower: the vision tower, a `ViT` with `tower_info` (what the connector reads).
        words: the `VLMWords` of its vocabulary.
    """

    def __init__(self, config: ShapesVLMConfig | None = None) -> None:
        super().__init__()
        self.config = c = config or ShapesVLMConfig()
        self.tower = ViT(c.vision)
        layer, normed = c.reads
        self.tower.tower_info = TowerInfo(family="shapes_vlm", feature_layer=layer, final_norm=normed, drop_prefix=True, merge=c.merge)
        self.words = VLMWords()
        self.connector = nn.Sequential(nn.Linear(c.vision.width * c.merge**2, c.width), nn.GELU(), nn.Linear(c.width, c.width))
        self.embed = nn.Embedding(len(self.words), c.width)
        nn.init.normal_(self.embed.weight, std=0.02)  # tied to the output: logits of a few units at the start
        self.pos = nn.Parameter(torch.zeros(c.max_len, c.width).normal_(std=0.02))
        self.blocks = nn.ModuleList(_DecoderBlock(c) for _ in range(c.depth))
        self.norm = nn.LayerNorm(c.width)
        self.spec = None

    def image_tokens(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] -> the language model's image tokens [B, M, width]."""
        layer, normed = self.config.reads
        tokens = self.tower.encode(images) if normed else self.tower.stream_after(images, layer)
        tokens = tokens[:, self.tower.config.num_prefix_tokens :]
        return self.connector(pixel_shuffle(tokens, self.config.vision.grid, self.config.merge))

    def forward(self, images: torch.Tensor, ids: torch.Tensor, *, keep: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [B, T, V] for prompts `ids` [B, T] whose `<image>` tokens are the images'
        (M of them each, in order); `keep`: when a list, each layer's attention [B, H, T, T] is
        appended to it."""
        return self.decode(ids, self.image_tokens(images), keep=keep)

    def decode(self, ids: torch.Tensor, image_tokens: torch.Tensor, *, keep: list[torch.Tensor] | None = None) -> torch.Tensor:
        """`forward` from the image tokens [B, M, width] (`image_tokens`) on."""
        b, t = ids.shape
        if t > self.config.max_len:
            raise ValueError(f"the sequence is {t} tokens; shapes_vlm takes at most {self.config.max_len}")
        x = self.embed(ids)
        where = ids == self.words.image_id
        m = self.config.image_tokens
        if not torch.equal(where.sum(1), torch.full((b,), m, device=ids.device)):
            raise ValueError(f"each prompt must hold {m} image tokens")
        x = x.masked_scatter(where[..., None], image_tokens.to(x.dtype))
        x = x + self.pos[:t]
        for block in self.blocks:
            x = block(x, keep)
        return self.norm(x) @ self.embed.weight.T


class ShapesVLMRunner(VLM):
    """A `ShapesVLM` as `vitviz.ask` uses it (`vitviz.vlm.ask.VLM`)."""

    def __init__(self, model: ShapesVLM) -> None:
        self.model = model
        self.tower = model.tower
        self.name = model.spec.name if model.spec is not None else "shapes_vlm"
        self.layers = model.config.depth
        self.heads = model.config.heads
        self.eos_ids = (model.words.end_id,)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def prompt(self, image: Any, question: str) -> Prompt:
        from PIL import Image

        from vitviz.images import load_image
        from vitviz.preprocess import preprocess

        param = next(self.tower.parameters())
        self.model.to(device=param.device, dtype=param.dtype)  # the tower may have been moved alone (`load_model`)
        pre = _preprocessing(self.model.config)  # its own size, whatever size the tower is analysed at
        pil = image if isinstance(image, Image.Image) else (Image.fromarray(image) if isinstance(image, np.ndarray) else load_image(image))
        x, seen = preprocess(pil.convert("RGB"), pre)
        c = self.model.config
        ids = torch.tensor(self.model.words.question(question, c.image_tokens), device=self._device())
        if ids.numel() >= c.max_len:
            raise ValueError(f"the question is {ids.numel() - c.image_tokens - 1} words; shapes_vlm takes at most "
                             f"{c.max_len - c.image_tokens - 2}")
        positions = (ids == self.model.words.image_id).nonzero().flatten()
        images = x[None].to(self._device(), param.dtype)
        with torch.no_grad():  # the tower and the connector once; the answer and its relevance run the decoder
            image_tokens = self.model.image_tokens(images)
        return Prompt(ids=ids, inputs={"images": images, "image_tokens": image_tokens},
                      image_positions=positions, token_grid=c.token_grid, merge=c.merge, image=np.asarray(seen.convert("RGB")))

    def forward(self, prompt: Prompt, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        keep: list[torch.Tensor] = []
        return self.model.decode(ids, prompt.inputs["image_tokens"], keep=keep), keep

    def generate(self, prompt: Prompt, max_new_tokens: int) -> list[int]:
        ids = prompt.ids[None]
        image_tokens = prompt.inputs["image_tokens"]
        out: list[int] = []
        room = self.model.config.max_len - ids.shape[1]
        for _ in range(min(max_new_tokens, room)):
            nxt = int(self.model.decode(ids, image_tokens)[0, -1].argmax())
            out.append(nxt)
            if nxt == self.model.words.end_id:
                break
            ids = torch.cat([ids, ids.new_tensor([[nxt]])], dim=1)
        return out

    def piece(self, token_id: int) -> str:
        return self.model.words.piece(token_id)

    def ask_shape(self, question: str, max_new_tokens: int) -> AskShape:
        c = self.model.config
        prompt = len(self.model.words.question(question, c.image_tokens))
        blocks = sum(p.numel() for p in self.model.blocks.parameters())
        return AskShape(layers=c.depth, heads=c.heads, width=c.width, mlp=c.mlp_dim, vocab=len(self.model.words),
                        params=blocks + c.width * len(self.model.words), image_tokens=c.image_tokens, prompt_tokens=prompt,
                        new_tokens=min(max_new_tokens, max(0, c.max_len - prompt)), cache=False)


def _preprocessing(config: ShapesVLMConfig):
    from vitviz.config import Preprocessing

    s = config.vision.image_size
    return Preprocessing(image_size=s, resize_size=s, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
