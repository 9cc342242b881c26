"""The Swin Transformer of Liu et al., "Swin Transformer: Hierarchical Vision Transformer using
Shifted Windows" (ICCV 2021), written to be read top to bottom, and its attention made global,
exactly, so that rollout and relevance run through the whole network onto the input's patch grid.

image [B, 3, H, W]
  -> patch embedding (Conv2d, kernel = stride = P), LayerNorm            [B, gh, gw, C]
  -> stage 0: blocks;  stage s > 0: patch merging (2 x 2 -> 1), blocks    [B, gh/2^s, gw/2^s, C 2^s]
       block: x + W-MSA(LN(x)), then x + MLP(LN(x)); W-MSA attends inside M x M windows; every
       second block first rolls the grid by -M/2 (torch.roll), attends inside the windows of the
       rolled grid with an additive mask (-100) between tokens that came from different regions,
       and rolls back; a relative position bias [heads, M², M²] is added to the logits
  -> final LayerNorm, mean over the final tokens, linear head             [B, classes]

The window softmax is its own module (`WindowAttention.attend`, a `vitviz.model.Attention`), so a
forward hook sees each layer's attention `[B * windows, heads, M², M²]`, and `vitviz.record_attention`
records it (`rec.calls[-1][l]`: the shapes differ between stages). When nobody observes it, one
fused `scaled_dot_product_attention` runs instead (tests hold both paths equal).

Attention made global. A layer's window attention is a sparse patch-to-patch matrix of its stage:
`window_to_global` places each entry at (query, key) in raster order of the stage's grid, the shift
undone; pairs in different windows and pairs the mask separates are exactly 0. Patch merging is the
fixed linear map `merge_map(grid)` [N_{s+1}, N_s]: each merged token draws equally on its 2 x 2
children (1/4 each; at the border of an odd grid, equally on those that exist). Through them:

- attention rollout (Abnar & Zuidema 2020): per layer Â = rownorm(fuse_h(A) + I), between stages the
  merge map, R = Â_L ··· M_1 ··· Â_1 [N_last, N_0];
- Chefer et al. 2021's generic rule: R = I, per layer R <- R + mean_h (G ⊙ A)⁺ R, between stages
  R <- M R, with G the gradient of the target logit with respect to the layer's attention (the
  gradient of the global matrix on its support is the gradient of the window entry placed there);
- the pooled classifier's query (no cls token) is the mean of the final tokens: its row of any such
  matrix is the mean of their rows, a map over the finest grid [gh0, gw0].

The products are taken without building a dense N x N matrix per layer (each layer acts window by
window); tests hold them to the dense products of `window_to_global` and `merge_map`.

Padding. A stage whose grid is not a whole number of windows is padded at the bottom and right
(timm: after the shift; Hugging Face: before it, `SwinConfig.pad_before_shift`); the padding tokens
are zeros after the block's norm and take part in the window softmax, as in both libraries. Global
attention is over the real tokens: without padding each row sums to 1; with padding a row sums to 1
minus what its query gives the padding (rollout renormalises its rows, so its rows still sum to 1).

This module holds the model, the maths and the analysis of one image (`analyze_swin` ->
`SwinAnalysis`); `vitviz.analyze` and `vitviz.explain` (with "rollout", "attention", "gradient",
"grad_rollout") hand a Swin to it. Conversions from timm and Hugging Face are in `vitviz.sources.swin`.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from einops import rearrange
from PIL import Image
from torch import nn

from vitviz import steps
from vitviz.analysis import POOL, HeadFusion, fuse_heads
from vitviz.config import VariantSpec
from vitviz.hooks import record_attention
from vitviz.images import ImageSource, load_image
from vitviz.layout import TokenLayout
from vitviz.model import Attention
from vitviz.preprocess import preprocess, to_input

__all__ = [
    "SwinConfig",
    "Swin",
    "SwinBlock",
    "SwinStage",
    "PatchMerging",
    "WindowAttention",
    "WindowGeometry",
    "relative_position_index",
    "SwinAnalysis",
    "SWIN_METHODS",
    "window_to_global",
    "merge_map",
    "swin_rollout",
    "swin_gradient_relevance",
    "swin_gradient_rollout",
    "swin_last_attention",
    "analyze_swin",
    "analyze_swin_crop",
    "swin_relevance",
    "swin_relevance_maps",
]

# the explanation methods a Swin answers (`vitviz.explain`, `vitviz.relevance_maps`)
SWIN_METHODS: tuple[str, ...] = ("attention", "rollout", "gradient", "grad_rollout")

MASK_VALUE = -100.0  # the additive mask between tokens of different regions of a shifted window (timm, Hugging Face)
_PATCH_NORM_EPS = 1e-5  # the patch embedding's and the merges' LayerNorms (nn.LayerNorm's default, in timm and Hugging Face)


@dataclass(frozen=True)
class SwinConfig:
    """The architecture of one Swin Transformer.

    Attributes:
        image_size: the side S the model was built for; its windows and shifts are fixed for that
            size (timm's rule: in a stage whose grid is no larger than the window, the window is the
            grid and nothing shifts). Other multiples of P run, padded to whole windows.
        patch_size: P.
        embed_dim: C, the width of stage 0; stage s is C 2^s wide.
        depths: blocks per stage.
        num_heads: heads per stage.
        window_size: M, one for every stage or one per stage (square windows).
        mlp_ratio: the MLP's hidden width is int(ratio x width).
        num_classes: outputs of the head; 0 for none (the forward returns the pooled features).
        qkv_bias: the qkv projection has a bias.
        act: the MLP's activation: "gelu" or "gelu_tanh".
        eps: the blocks' and the final norm's LayerNorm epsilon (the patch embedding's and the
            merges' norms use 1e-5, as timm and Hugging Face do).
        pad_before_shift: pad a stage's grid to whole windows before rolling it (Hugging Face) rather
            than after (timm, the original code); the same when no padding is needed.
    """

    image_size: int = 224
    patch_size: int = 4
    embed_dim: int = 96
    depths: tuple[int, ...] = (2, 2, 6, 2)
    num_heads: tuple[int, ...] = (3, 6, 12, 24)
    window_size: int | tuple[int, ...] = 7
    mlp_ratio: float = 4.0
    num_classes: int = 1000
    qkv_bias: bool = True
    act: Literal["gelu", "gelu_tanh"] = "gelu"
    eps: float = 1e-5
    pad_before_shift: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "depths", tuple(int(d) for d in self.depths))
        object.__setattr__(self, "num_heads", tuple(int(h) for h in self.num_heads))
        windows = self.window_size
        windows = (int(windows),) * len(self.depths) if isinstance(windows, int) else tuple(int(w) for w in windows)
        object.__setattr__(self, "window_size", windows)
        if not self.depths or len(self.num_heads) != len(self.depths) or len(windows) != len(self.depths):
            raise ValueError(f"depths {self.depths}, num_heads {self.num_heads} and window_size {windows} need one entry per stage")
        if min(self.depths) < 1 or min(windows) < 1:
            raise ValueError(f"every stage needs a block and a window of at least 1, got depths {self.depths}, windows {windows}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        for s, (dim, heads) in enumerate(zip(self.dims, self.num_heads)):
            if dim % heads:
                raise ValueError(f"stage {s}: width {dim} is not divisible by {heads} heads")
        if self.act not in ("gelu", "gelu_tanh"):
            raise ValueError(f'act must be "gelu" or "gelu_tanh", got {self.act!r}')

    @property
    def num_stages(self) -> int:
        return len(self.depths)

    @property
    def dims(self) -> tuple[int, ...]:
        """The width of each stage: C 2^s."""
        return tuple(self.embed_dim * 2**s for s in range(self.num_stages))

    @property
    def grid(self) -> tuple[int, int]:
        """The finest patch grid (stage 0's) at `image_size`."""
        side = self.image_size // self.patch_size
        return side, side

    def stage_grids(self, grid: tuple[int, int] | None = None) -> tuple[tuple[int, int], ...]:
        """Each stage's grid for a finest grid (default `grid`): halved (rounded up) at each merge."""
        gh, gw = grid or self.grid
        out = []
        for _ in range(self.num_stages):
            out.append((gh, gw))
            gh, gw = (gh + 1) // 2, (gw + 1) // 2
        return tuple(out)

    def stage_windows(self) -> tuple[tuple[tuple[int, int], tuple[int, int]], ...]:
        """Each stage's (window, shift of its odd blocks) at `image_size`, each (rows, columns): in a
        dimension where the stage's grid is no larger than M, the window is the grid and the shift 0."""
        out = []
        for (gh, gw), m in zip(self.stage_grids(), self.window_size):
            window = (min(gh, m), min(gw, m))
            shift = (0 if gh <= m else m // 2, 0 if gw <= m else m // 2)
            out.append((window, shift))
        return tuple(out)

    # what the rest of vitviz reads from a spec's config
    @property
    def depth(self) -> int:
        """All blocks, every stage."""
        return sum(self.depths)

    @property
    def heads(self) -> int:
        """The most heads of any stage."""
        return max(self.num_heads)

    @property
    def width(self) -> int:
        """The final width (the head's input)."""
        return self.dims[-1]

    @property
    def mlp_dim(self) -> int:
        """The last stage's MLP hidden width."""
        return int(self.mlp_ratio * self.dims[-1])

    num_prefix_tokens = property(lambda self: 0)
    prefix_names = property(lambda self: ())
    pooled_query = property(lambda self: True)  # the classifier reads the mean of the final tokens
    query_names = property(lambda self: (POOL,))
    class_token = property(lambda self: False)
    pool = property(lambda self: "avg")

    @property
    def num_tokens(self) -> int:
        """Tokens of the finest grid at `image_size`."""
        return self.grid[0] * self.grid[1]

    @property
    def layer_stages(self) -> tuple[int, ...]:
        """The stage of each block, first block first."""
        return tuple(s for s, depth in enumerate(self.depths) for _ in range(depth))

    def geometries(self, grid: tuple[int, int] | None = None) -> list["WindowGeometry"]:
        """How each block cuts its stage's grid into windows for a finest grid (default `grid`): what
        `Swin.geometries` gives for a model of this config, from the config alone (what a request
        will hold is priced from it before a model is touched)."""
        grids, windows = self.stage_grids(grid), self.stage_windows()
        out = []
        for i, s in enumerate(self.layer_stages):
            window, shift = windows[s]
            odd = (i - sum(self.depths[:s])) % 2 == 1
            out.append(WindowGeometry(grid=grids[s], window=window, shift=shift if odd else (0, 0), pad_before_shift=self.pad_before_shift))
        return out

    @property
    def num_params(self) -> int:
        """Parameters of a Swin of this config, counted from the config alone (a test holds it to the
        count of a built `Swin`)."""
        c0 = self.embed_dim
        total = 3 * self.patch_size**2 * c0 + c0 + 2 * c0  # the patch embedding (with its bias) and its norm
        for s, ((wh, ww), _) in enumerate(self.stage_windows()):
            dim, heads, hidden = self.dims[s], self.num_heads[s], int(self.mlp_ratio * self.dims[s])
            if s:  # the merge: a norm over 4C, a linear map 4C -> 2C without bias
                prev = self.dims[s - 1]
                total += 2 * 4 * prev + 4 * prev * 2 * prev
            attention = 3 * dim * dim + (3 * dim if self.qkv_bias else 0) + dim * dim + dim + (2 * wh - 1) * (2 * ww - 1) * heads
            total += self.depths[s] * (2 * 2 * dim + attention + dim * hidden + hidden + hidden * dim + dim)
        classes = self.num_classes
        return total + 2 * self.dims[-1] + (self.dims[-1] * classes + classes if classes else 0)


# ---------------------------------------------------------------------------------------------
# Windows: where each token of a stage sits in a layer's windows


def _partition(x: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """[B, Hp, Wp, C] -> [B * windows, wh * ww, C], windows in raster order, batch first."""
    return rearrange(x, "b (nh wh) (nw ww) c -> (b nh nw) (wh ww) c", wh=window[0], ww=window[1])


def _unpartition(x: torch.Tensor, window: tuple[int, int], padded: tuple[int, int]) -> torch.Tensor:
    """[B * windows, wh * ww, C] -> [B, Hp, Wp, C]."""
    return rearrange(x, "(b nh nw) (wh ww) c -> b (nh wh) (nw ww) c", nh=padded[0] // window[0], nw=padded[1] // window[1], wh=window[0])


@dataclass(frozen=True)
class WindowGeometry:
    """How one layer cuts its stage's grid into windows.

    Attributes:
        grid: the stage's grid (gh, gw) of real tokens.
        window: (wh, ww).
        shift: (sh, sw): the grid is rolled by (-sh, -sw) before it is cut (0, 0: not shifted).
        pad_before_shift: the grid is padded to whole windows before the roll (Hugging Face) or after (timm).
    """

    grid: tuple[int, int]
    window: tuple[int, int]
    shift: tuple[int, int] = (0, 0)
    pad_before_shift: bool = False

    @property
    def padded(self) -> tuple[int, int]:
        """The grid padded (bottom, right) to whole windows (Hp, Wp)."""
        (gh, gw), (wh, ww) = self.grid, self.window
        return math.ceil(gh / wh) * wh, math.ceil(gw / ww) * ww

    @property
    def num_windows(self) -> int:
        hp, wp = self.padded
        return (hp // self.window[0]) * (wp // self.window[1])

    @property
    def area(self) -> int:
        """M²: tokens per window."""
        return self.window[0] * self.window[1]

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def shifted(self) -> bool:
        return any(self.shift)

    def roll_and_pad(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[B, gh, gw, C] -> [B, Hp, Wp, C]: rolled by -shift and padded with `fill`, in this layer's order."""
        pad_h, pad_w = self.padded[0] - self.grid[0], self.padded[1] - self.grid[1]
        if self.pad_before_shift:
            x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h), value=fill)
        if self.shifted:
            x = torch.roll(x, shifts=(-self.shift[0], -self.shift[1]), dims=(1, 2))
        if not self.pad_before_shift:
            x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h), value=fill)
        return x

    def unroll(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of `roll_and_pad`: [B, Hp, Wp, C] -> [B, gh, gw, C]."""
        gh, gw = self.grid
        if not self.pad_before_shift:
            x = x[:, :gh, :gw]
        if self.shifted:
            x = torch.roll(x, shifts=self.shift, dims=(1, 2))
        return x[:, :gh, :gw]

    def regions(self, device=None) -> torch.Tensor:
        """The mask's region of each cell of the rolled, padded grid [Hp, Wp] (timm's `img_mask`):
        along a shifted dimension, [0, P - M), [P - M, P - s) and [P - s, P) (P the padded side)."""
        hp, wp = self.padded

        def along(side: int, window: int, shift: int) -> torch.Tensor:
            i = torch.arange(side, device=device)
            if shift == 0:
                return torch.zeros_like(i)
            return (i >= side - window).long() + (i >= side - shift).long()

        return along(hp, self.window[0], self.shift[0])[:, None] * 3 + along(wp, self.window[1], self.shift[1])[None, :]

    def window_tokens(self, device=None) -> torch.Tensor:
        """The real token (its raster index on the stage's grid) at each place of each window
        [windows, M²]; -1 for padding."""
        ids = torch.arange(self.num_tokens, device=device).reshape(1, *self.grid, 1)
        return _partition(self.roll_and_pad(ids, fill=-1), self.window)[..., 0]

    def window_regions(self, device=None) -> torch.Tensor:
        """The mask's region at each place of each window [windows, M²]."""
        return _partition(self.regions(device)[None, :, :, None], self.window)[..., 0]

    def mask(self, *, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor | None:
        """The additive mask of a shifted layer [windows, M², M²]: -100 between places of different
        regions, 0 elsewhere; None when the layer is not shifted."""
        if not self.shifted:
            return None
        r = self.window_regions(device)
        return torch.zeros(r.shape[0], r.shape[1], r.shape[1], dtype=dtype, device=device).masked_fill(r[:, :, None] != r[:, None, :], MASK_VALUE)

    def support(self, device=None) -> torch.Tensor:
        """bool [windows, M², M²]: the (query, key) places that hold two real tokens the mask does not separate."""
        tokens, regions = self.window_tokens(device), self.window_regions(device)
        real = tokens >= 0
        return real[:, :, None] & real[:, None, :] & (regions[:, :, None] == regions[:, None, :])

    def placement(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each real token sits: (window [N], place in the window [N]), tokens in raster order."""
        flat = self.window_tokens(device).flatten()
        where = torch.nonzero(flat >= 0).flatten()
        window = torch.empty(self.num_tokens, dtype=torch.long, device=device)
        place = torch.empty_like(window)
        window[flat[where]] = where // self.area
        place[flat[where]] = where % self.area
        return window, place

    def token_regions(self, device=None) -> torch.Tensor:
        """The mask's region of each real token [N], raster order."""
        window, place = self.placement(device)
        return self.window_regions(device)[window, place]

    def visible(self, device=None) -> torch.Tensor:
        """bool [N, N]: query i can attend to key j (same window, same region), raster order."""
        window, regions = self.placement(device)[0], self.token_regions(device)
        return (window[:, None] == window[None, :]) & (regions[:, None] == regions[None, :])

    def visible_from(self, token: int, device=None) -> torch.Tensor:
        """bool [N]: the keys the query `token` (raster index) can attend to."""
        window, regions = self.placement(device)[0], self.token_regions(device)
        return (window == window[token]) & (regions == regions[token])


# ---------------------------------------------------------------------------------------------
# The model


def relative_position_index(window: tuple[int, int]) -> torch.Tensor:
    """[M², M²]: the row of the bias table for each (query, key) place of a window: the offset
    (dy, dx) = place(query) - place(key), as (dy + wh - 1) (2 ww - 1) + (dx + ww - 1)."""
    wh, ww = window
    rows, cols = torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")
    dy = rows.flatten()[:, None] - rows.flatten()[None, :]
    dx = cols.flatten()[:, None] - cols.flatten()[None, :]
    return (dy + wh - 1) * (2 * ww - 1) + (dx + ww - 1)


class WindowAttention(Attention):
    """Multi-head self-attention inside windows, with a learned relative position bias:
    softmax(q k^T / sqrt(d) + B + mask), B [heads, M², M²] read from a table of (2wh-1)(2ww-1) rows.

    `attend` (the softmax) sees `[B * windows, heads, M², M²]`."""

    def __init__(self, *, width: int, heads: int, window: tuple[int, int], qkv_bias: bool = True) -> None:
        super().__init__(width=width, heads=heads, qkv_bias=qkv_bias, proj_bias=True)
        self.window = tuple(window)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window[0] - 1) * (2 * window[1] - 1), heads))
        self.register_buffer("relative_position_index", relative_position_index(self.window), persistent=False)

    def relative_position_bias(self) -> torch.Tensor:
        """B [heads, M², M²]."""
        return self.relative_position_bias_table[self.relative_position_index].permute(2, 0, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B * windows, M², C], mask [windows, M², M²] or None -> [B * windows, M², C]."""
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        bias = self.relative_position_bias().to(q.dtype)[None]  # [1, heads, M², M²]
        if mask is not None:  # window w of every image gets mask[w]
            bias = (bias + mask[:, None]).repeat(x.shape[0] // mask.shape[0], 1, 1, 1)  # [B * windows, heads, M², M²]
        if self._observed():
            attn = self.attend((q @ k.transpose(-2, -1)) * self.scale + bias)  # rows sum to 1
            out = attn @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.proj(rearrange(out, "b h n d -> b n (h d)"))


class SwinBlock(nn.Module):
    """x + W-MSA(LN(x)), then x + MLP(LN(x)), on [B, gh, gw, C]; W-MSA rolls the grid by -shift,
    cuts it into windows, attends in each, and puts the tokens back."""

    def __init__(self, *, width: int, heads: int, window: tuple[int, int], shift: tuple[int, int], config: SwinConfig) -> None:
        super().__init__()
        self.window, self.shift, self.pad_before_shift = tuple(window), tuple(shift), config.pad_before_shift
        hidden = int(config.mlp_ratio * width)
        self.norm1 = nn.LayerNorm(width, eps=config.eps)
        self.attn = WindowAttention(width=width, heads=heads, window=self.window, qkv_bias=config.qkv_bias)
        self.norm2 = nn.LayerNorm(width, eps=config.eps)
        act = nn.GELU(approximate="tanh" if config.act == "gelu_tanh" else "none")
        self.mlp = nn.Sequential(nn.Linear(width, hidden), act, nn.Linear(hidden, width))

    def geometry(self, grid: tuple[int, int]) -> WindowGeometry:
        """How this block cuts a grid of real tokens (its stage's) into windows."""
        return WindowGeometry(grid=tuple(grid), window=self.window, shift=self.shift, pad_before_shift=self.pad_before_shift)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, gh, gw, C] -> [B, gh, gw, C]."""
        g = self.geometry((x.shape[1], x.shape[2]))
        windows = _partition(g.roll_and_pad(self.norm1(x)), g.window)  # [B * windows, M², C]
        attended = self.attn(windows, g.mask(dtype=x.dtype, device=x.device))
        x = x + g.unroll(_unpartition(attended, g.window, g.padded))
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """Each 2 x 2 group of tokens -> one: concatenated in the order (0,0), (1,0), (0,1), (1,1)
    (row, column offsets; timm's and Hugging Face's), LayerNorm, a linear map 4C -> 2C without bias.
    An odd grid is padded with zeros at the bottom and right first."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * width, eps=_PATCH_NORM_EPS)
        self.reduction = nn.Linear(4 * width, 2 * width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, gh, gw, C] -> [B, ceil(gh/2), ceil(gw/2), 2C]."""
        x = F.pad(x, (0, 0, 0, x.shape[2] % 2, 0, x.shape[1] % 2))
        x = rearrange(x, "b (h dh) (w dw) c -> b h w (dw dh c)", dh=2, dw=2)  # (dh, dw) = (0,0), (1,0), (0,1), (1,1)
        return self.reduction(self.norm(x))


class SwinStage(nn.Module):
    """Patch merging (stages after the first), then blocks alternating plain and shifted windows."""

    def __init__(self, config: SwinConfig, stage: int) -> None:
        super().__init__()
        c, width = config, config.dims[stage]
        window, shift = c.stage_windows()[stage]
        self.merge = PatchMerging(c.dims[stage - 1]) if stage else None
        self.blocks = nn.ModuleList(
            SwinBlock(width=width, heads=c.num_heads[stage], window=window, shift=shift if i % 2 else (0, 0), config=c)
            for i in range(c.depths[stage])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merge is not None:
            x = self.merge(x)
        for block in self.blocks:
            x = block(x)
            steps.step()
        return x


class Swin(nn.Module):
    """Swin Transformer, built from a `SwinConfig` (or its fields as keywords).

    `vitviz.from_timm` and `vitviz.from_transformers` convert a timm `SwinTransformer` or a Hugging
    Face `SwinModel` / `SwinForImageClassification` into this one (`vitviz.sources.swin`).
    """

    def __init__(self, config: SwinConfig | None = None, **fields_) -> None:
        super().__init__()
        if config is None:
            config = SwinConfig(**fields_)
        elif fields_:
            raise TypeError("pass a SwinConfig or its fields, not both")
        self.config = c = config
        self.patch_embed = nn.Conv2d(3, c.embed_dim, kernel_size=c.patch_size, stride=c.patch_size)
        self.patch_norm = nn.LayerNorm(c.embed_dim, eps=_PATCH_NORM_EPS)
        self.stages = nn.ModuleList(SwinStage(c, s) for s in range(c.num_stages))
        self.norm = nn.LayerNorm(c.dims[-1], eps=c.eps)
        self.head = nn.Linear(c.dims[-1], c.num_classes) if c.num_classes else nn.Identity()
        self.spec: VariantSpec | None = None  # the record of where the model came from, attached by its loader
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, WindowAttention):
                nn.init.trunc_normal_(module.relative_position_bias_table, std=0.02)

    patch_size = property(lambda self: self.config.patch_size)
    image_size = property(lambda self: self.config.image_size)
    num_classes = property(lambda self: self.config.num_classes)

    @property
    def blocks(self) -> list[SwinBlock]:
        """Every block, first stage first."""
        return [block for stage in self.stages for block in stage.blocks]

    @property
    def layer_stages(self) -> tuple[int, ...]:
        """The stage of each block."""
        return tuple(s for s, stage in enumerate(self.stages) for _ in stage.blocks)

    def grid_for(self, height: int, width: int) -> tuple[int, int]:
        """The finest patch grid of an image of height x width pixels (both multiples of P)."""
        p = self.config.patch_size
        if height % p or width % p:
            raise ValueError(f"the image is {height}x{width} px; both sides must be multiples of the patch size {p}")
        return height // p, width // p

    def stage_grids(self, height: int, width: int) -> tuple[tuple[int, int], ...]:
        """Each stage's grid for an image of height x width pixels."""
        return self.config.stage_grids(self.grid_for(height, width))

    def geometries(self, height: int, width: int) -> list[WindowGeometry]:
        """How each block cuts its stage's grid into windows, for an image of height x width pixels."""
        grids = self.stage_grids(height, width)
        return [block.geometry(grids[s]) for s, block in zip(self.layer_stages, self.blocks)]

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """The final tokens after the final norm: [B, 3, H, W] -> [B, N_last, D], raster order."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"expected images of shape [B, 3, {self.image_size}, {self.image_size}], got {list(images.shape)}")
        self.grid_for(images.shape[2], images.shape[3])
        x = self.patch_norm(rearrange(self.patch_embed(images), "b c h w -> b h w c"))  # [B, gh, gw, C]
        for stage in self.stages:
            x = stage(x)
        return self.norm(x).flatten(1, 2)

    def head_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final tokens [B, N_last, D] -> logits [B, classes] (the pooled features without a head)."""
        return self.head(tokens.mean(dim=1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes], or the pooled features [B, D] when the model has no head."""
        return self.head_logits(self.encode(images))


# ---------------------------------------------------------------------------------------------
# Attention made global, and the products through the whole network


def window_to_global(attn: torch.Tensor, geometry: WindowGeometry) -> torch.Tensor:
    """A layer's window attention as its stage's patch-to-patch matrix.

    Args:
        attn: the layer's softmax output [B * windows, heads, M², M²] (windows in raster order of the
            rolled, padded grid, batch first), as `WindowAttention.attend` returns it.
        geometry: the layer's `WindowGeometry`.

    Returns:
        [B, heads, N, N], queries and keys in raster order of the stage's grid (N = gh * gw): entry
        (i, j) is the window entry of the two tokens when they share a window and a region of the
        mask, else exactly 0. Differentiable (a gather).
    """
    w, m = geometry.num_windows, geometry.area
    if attn.ndim != 4 or attn.shape[-2:] != (m, m) or attn.shape[0] % w:
        raise ValueError(f"attn must be [B * {w} windows, heads, {m}, {m}] for this layer, got {list(attn.shape)}")
    a = attn.reshape(attn.shape[0] // w, w, attn.shape[1], m, m)
    window, place = geometry.placement(attn.device)
    # a[b, window(i), h, place(i), place(j)]: the advanced indices [N, N] come first -> [N, N, B, heads]
    full = a[:, window[:, None], :, place[:, None], place[None, :]].permute(2, 3, 0, 1)
    return full * geometry.visible(attn.device).to(full.dtype)


def merge_map(grid: tuple[int, int], *, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Patch merging as a linear map of token mixtures: [N_{s+1}, N_s] for a stage grid (gh, gw).

    Merged token t = (r, c) of the grid (ceil(gh/2), ceil(gw/2)) draws equally on its children
    (2r + dr, 2c + dc), dr, dc in {0, 1}, that exist: 1/4 each inside the grid (rows sum to 1)."""
    gh, gw = grid
    ph, pw = (gh + 1) // 2, (gw + 1) // 2
    rows, cols = torch.meshgrid(torch.arange(gh, device=device), torch.arange(gw, device=device), indexing="ij")
    parent = ((rows // 2) * pw + cols // 2).flatten()  # [N_s]
    m = torch.zeros(ph * pw, gh * gw, dtype=dtype, device=device)
    m[parent, torch.arange(gh * gw, device=device)] = 1.0
    return m / m.sum(dim=1, keepdim=True)


def _merge_right(q: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """q [B, N_{s+1}, R] -> merge_map(grid)^T @ q [B, N_s, R], without the matrix: each child's row
    is its parent's, divided by the parent's children."""
    gh, gw = grid
    pw = (gw + 1) // 2
    rows, cols = torch.meshgrid(torch.arange(gh, device=q.device), torch.arange(gw, device=q.device), indexing="ij")
    parent = ((rows // 2) * pw + cols // 2).flatten()
    children = torch.bincount(parent, minlength=q.shape[1]).to(q.dtype)
    return (q / children[:, None]).index_select(1, parent)


def _window_right(q: torch.Tensor, kernel: torch.Tensor, geometry: WindowGeometry) -> torch.Tensor:
    """K^T @ q [B, N, R] for K [B, N, N] given window by window [B, windows, M², M²] and zero outside
    the support (`WindowGeometry.support`): the product without the N x N matrix. Tokens go to their
    places in their windows as whole rows (one index copy), each window's block is one batched
    matrix product, and the rows come back the same way."""
    b, _, r = q.shape
    window, place = geometry.placement(q.device)
    slot = window * geometry.area + place  # each token's row among the windows' places
    spread = q.new_zeros(b, geometry.num_windows * geometry.area, r)
    spread.index_copy_(1, slot, q)
    out = kernel.transpose(-1, -2) @ spread.view(b, geometry.num_windows, geometry.area, r)  # [B, windows, M², R]
    return out.view(b, -1, r).index_select(1, slot)


def _layer_kernels(attentions: Sequence[torch.Tensor], geometries: Sequence[WindowGeometry]) -> list[torch.Tensor]:
    """Each layer's [B * windows, ...] -> [B, windows, ...], checked against its geometry."""
    if len(attentions) != len(geometries):
        raise ValueError(f"{len(attentions)} layers of attention for {len(geometries)} geometries")
    out = []
    for l, (a, g) in enumerate(zip(attentions, geometries)):
        if a.ndim != 4 or a.shape[-1] != g.area or a.shape[0] % g.num_windows:
            raise ValueError(f"layer {l}: expected [B * {g.num_windows}, heads, {g.area}, {g.area}], got {list(a.shape)}")
        out.append(a.reshape(a.shape[0] // g.num_windows, g.num_windows, *a.shape[1:]))
    return out


SLICE_ELEMENTS = 2**22  # a slice of Q's columns holds about this many elements on the finest grid


def _through_network(
    kernels: Sequence[torch.Tensor], geometries: Sequence[WindowGeometry], stages: Sequence[int], *, rule: Literal["rollout", "add"]
) -> torch.Tensor:
    """The product of every layer's matrix and the merges between stages, onto the finest grid.

    Layer l's matrix is B_l = rownorm(K_l + I) ("rollout") or I + K_l ("add"), K_l given window by
    window [B, windows, M², M²] (fused over heads, support only). Returns
    R = B_L ··· M ··· B_1 [B, N_last, N_0], taken from the last layer down and held transposed,
    Q = R^T (Q <- B_l^T Q, Q <- M_s^T Q), so that only [B, N_s, columns] is ever held and every
    step moves whole rows. Q's columns are independent: they go through the layers a slice at a
    time (`SLICE_ELEMENTS` on the finest grid), a step (`vitviz.steps`) after each layer of each."""
    if not (len(kernels) == len(geometries) == len(stages)):
        raise ValueError("one kernel, geometry and stage per layer")
    batch = kernels[0].shape[0]
    n_last, n_first = geometries[-1].num_tokens, geometries[0].num_tokens
    layers = []  # each layer's support-masked kernel, and its rows' sums + 1 for the rollout rule
    for k, g in zip(kernels, geometries):
        k = k * g.support(k.device).to(k.dtype)
        window, place = g.placement(k.device)
        layers.append((k, k.sum(dim=-1)[:, window, place] + 1.0 if rule == "rollout" else None))
    out = torch.empty(batch, n_last, n_first, dtype=kernels[0].dtype, device=kernels[0].device)
    width = max(1, SLICE_ELEMENTS // max(1, n_first))
    for start in range(0, n_last, width):
        cols = min(width, n_last - start)
        q = torch.zeros(batch, n_last, cols, dtype=out.dtype, device=out.device)
        q[:, start:start + cols].copy_(torch.eye(cols, dtype=out.dtype, device=out.device).expand(batch, cols, cols))
        for l in range(len(kernels) - 1, -1, -1):
            (k, rows), g = layers[l], geometries[l]
            if rule == "rollout":
                scaled = q / rows[:, :, None]
                q = _window_right(scaled, k, g) + scaled
            else:
                q = q + _window_right(q, k, g)
            if l > 0 and stages[l - 1] != stages[l]:
                q = _merge_right(q, geometries[l - 1].grid)
            steps.step()
        out[:, start:start + cols] = q.transpose(1, 2)
    return out


def swin_rollout(
    attentions: Sequence[torch.Tensor], geometries: Sequence[WindowGeometry], stages: Sequence[int], *, head_fusion: HeadFusion = "mean"
) -> torch.Tensor:
    """Attention rollout through a Swin: R [B, N_last, N_0] (rows sum to 1).

    Per layer Â = rownorm(fuse_h(A) + I) on its stage's grid (A the global attention), between
    stages the merge map; R = Â_L ··· M_1 ··· Â_1. The pooled query's map is the mean of R's rows.

    Args:
        attentions: each layer's window attention [B * windows, heads, M², M²].
        geometries: each layer's `WindowGeometry`; stages: each layer's stage index.
    """
    fused = [fuse_heads(a, head_fusion, dim=2) for a in _layer_kernels(attentions, geometries)]
    return _through_network(fused, geometries, stages, rule="rollout")


def swin_gradient_relevance(
    attentions: Sequence[torch.Tensor], gradients: Sequence[torch.Tensor], geometries: Sequence[WindowGeometry], stages: Sequence[int]
) -> torch.Tensor:
    """Chefer et al. 2021's generic rule through a Swin: R [B, N_last, N_0]. R = I; per layer, first
    first, R <- R + mean_h (G ⊙ A)⁺ R on the layer's stage grid; between stages R <- M R.

    Args:
        gradients: layer l's entry is d(target) / d(layer l's window attention), the same shape.
    """
    a, g = _layer_kernels(attentions, geometries), _layer_kernels(gradients, geometries)
    cams = [(gl * al).clamp(min=0).mean(dim=2) for al, gl in zip(a, g)]
    return _through_network(cams, geometries, stages, rule="add")


def swin_gradient_rollout(
    attentions: Sequence[torch.Tensor], gradients: Sequence[torch.Tensor], geometries: Sequence[WindowGeometry], stages: Sequence[int],
    *, head_fusion: HeadFusion = "mean",
) -> torch.Tensor:
    """Gradient rollout through a Swin: A'_l = fuse_h(G_l ⊙ A_l)⁺, then rolled out as `swin_rollout`."""
    a, g = _layer_kernels(attentions, geometries), _layer_kernels(gradients, geometries)
    fused = [fuse_heads(gl * al, head_fusion, dim=2).clamp(min=0) for al, gl in zip(a, g)]
    return _through_network(fused, geometries, stages, rule="rollout")


def swin_last_attention(
    attentions: Sequence[torch.Tensor], geometries: Sequence[WindowGeometry], stages: Sequence[int], *, head_fusion: HeadFusion = "mean"
) -> torch.Tensor:
    """The last layer's attention of the pooled query (the mean of the final tokens' rows, heads
    fused), carried onto the finest grid by the merges (each key's weight shared equally among the
    patches it merged): [B, N_0]."""
    k = fuse_heads(_layer_kernels(attentions[-1:], geometries[-1:])[0], head_fusion, dim=2)
    g = geometries[-1]
    k = k * g.support(k.device).to(k.dtype)
    q = torch.full((k.shape[0], g.num_tokens, 1), 1.0 / g.num_tokens, dtype=k.dtype, device=k.device)  # the row, held as a column
    q = _window_right(q, k, g)
    for l in range(len(geometries) - 1, 0, -1):
        if stages[l - 1] != stages[l]:
            q = _merge_right(q, geometries[l - 1].grid)
    return q[:, :, 0]


# ---------------------------------------------------------------------------------------------
# One image: the analysis


def _spec_of(model: Swin) -> VariantSpec:
    if getattr(model, "spec", None) is None:
        raise ValueError("this Swin has no VariantSpec; load it with vitviz.load_model or convert it with vitviz.from_timm or "
                         "vitviz.from_transformers")
    return model.spec


@dataclass
class SwinAnalysis:
    """What one Swin did with one image, on the CPU.

    Attributes:
        variant: the model's variant name.
        image: the S x S crop the model saw.
        probabilities: softmax over the classes [C], or None for a model without a head.
        categories: class names, or None.
        attentions: each layer's window attention [windows, heads_l, M², M²] (`geometries[l]` says
            where each place is on the stage's grid).
        geometries: each layer's `WindowGeometry` (grid, window, shift).
        stages: each layer's stage.
        biases: each layer's relative position bias [heads_l, M², M²] (added to the logits).
        tokens: the final tokens after the final norm [N_last, D].
        patch_size: P, the finest grid's patch side; stage s's tokens cover P 2^s pixels.
        device: where the model ran; model_seconds: time of the recorded forward.
        layout: the tokens and what the model offers: windowed attention, each stage's grid, a
            pooled query, no cls token, no position embeddings.
    """

    variant: str
    image: Image.Image = field(repr=False)
    probabilities: torch.Tensor | None = field(repr=False)
    categories: tuple[str, ...] | None = field(repr=False)
    attentions: list[torch.Tensor] = field(repr=False)
    geometries: list[WindowGeometry] = field(repr=False)
    stages: tuple[int, ...]
    biases: list[torch.Tensor] = field(repr=False)
    tokens: torch.Tensor = field(repr=False)
    patch_size: int
    device: str
    model_seconds: float
    layout: TokenLayout | None = None

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = TokenLayout(prefix_names=(), grids=self.stage_grids, attention="windowed", pooled_query=True,
                                      classifier=self.probabilities is not None, position_embeddings=False)

    prefix_names = property(lambda self: ())
    num_prefix_tokens = property(lambda self: 0)
    pooled_query = property(lambda self: True)
    query_names = property(lambda self: (POOL,))
    default_query = property(lambda self: POOL)

    @property
    def num_layers(self) -> int:
        return len(self.attentions)

    @property
    def stage_grids(self) -> tuple[tuple[int, int], ...]:
        """Each stage's grid, finest first."""
        return tuple(g.grid for i, g in enumerate(self.geometries) if i == 0 or self.stages[i] != self.stages[i - 1])

    @property
    def grid(self) -> tuple[int, int]:
        """The finest grid (gh0, gw0): where the maps are."""
        return self.geometries[0].grid

    @property
    def window_sizes(self) -> tuple[tuple[int, int], ...]:
        """Each layer's window (wh, ww)."""
        return tuple(g.window for g in self.geometries)

    @property
    def shifts(self) -> tuple[tuple[int, int], ...]:
        """Each layer's shift (sh, sw); (0, 0) for a layer that is not shifted."""
        return tuple(g.shift for g in self.geometries)

    def heads(self, layer: int) -> int:
        return self.attentions[layer].shape[1]

    def stage_patch_size(self, layer: int) -> int:
        """The pixels one token of the layer's stage covers per side: P 2^s."""
        return self.patch_size * 2 ** self.stages[layer]

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors and the crop."""
        tensors = [*self.attentions, *self.biases, self.tokens] + ([self.probabilities] if self.probabilities is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors) + 3 * self.image.size[0] * self.image.size[1]

    def predictions(self, k: int = 5) -> list[tuple[str, float]]:
        """The top-k (label, probability), most likely first; empty for a model without a head."""
        if self.probabilities is None or self.categories is None:
            return []
        top = self.probabilities.topk(min(k, self.probabilities.numel()))
        return [(self.categories[i], float(v)) for v, i in zip(top.values.tolist(), top.indices.tolist())]

    def global_attention(self, layer: int) -> torch.Tensor:
        """The layer's patch-to-patch attention on its stage's grid [heads, N_s, N_s] (`window_to_global`)."""
        return window_to_global(self.attentions[layer], self.geometries[layer])[0]

    def rollout(self, *, head_fusion: HeadFusion = "mean") -> torch.Tensor:
        """Attention rollout through the network [N_last, N_0] (rows sum to 1)."""
        return swin_rollout(self.attentions, self.geometries, self.stages, head_fusion=head_fusion)[0]

    def cls_map(self, *, head_fusion: HeadFusion = "mean") -> torch.Tensor:
        """The pooled query's rollout on the finest grid [gh0, gw0]: the mean of the final tokens' rows."""
        return self.rollout(head_fusion=head_fusion).mean(dim=0).reshape(self.grid)

    def distances(self, *, renormalize: bool = True) -> list[torch.Tensor]:
        """Mean attention distance in input pixels per layer and head: one [heads_l] per layer (the
        stages have different head counts). Each layer on its own stage's grid, a token there
        covering P 2^s pixels: MAD = mean_i sum_j A_ij d(i, j) over real tokens, each row
        renormalised to sum to 1 unless `renormalize=False`."""
        out = []
        for layer, (a, g) in enumerate(zip(self.attentions, self.geometries)):
            tokens = g.window_tokens(a.device)  # [windows, M²]
            coords = torch.stack([tokens // g.grid[1], tokens % g.grid[1]], dim=-1).to(a.dtype)
            d = torch.cdist(coords, coords) * self.stage_patch_size(layer)  # [windows, M², M²]
            kept = a * g.support(a.device).to(a.dtype)[:, None]  # [windows, heads, M², M²]
            per_query = (kept * d[:, None]).sum(dim=-1)  # [windows, heads, M²]
            if renormalize:
                per_query = per_query / kept.sum(dim=-1).clamp_min(torch.finfo(a.dtype).tiny)
            real = (tokens >= 0)[:, None, :].expand_as(per_query)
            out.append((per_query * real).sum(dim=(0, 2)) / (tokens >= 0).sum())
        return out

    def window_of(self, layer: int, row: int, col: int) -> torch.Tensor:
        """The cells of the layer's stage grid that the query at (row, col) of that grid attends to
        (its window, the shift undone, less what the mask separates): bool [gh_s, gw_s]."""
        g = self.geometries[layer]
        if not (0 <= row < g.grid[0] and 0 <= col < g.grid[1]):
            raise ValueError(f"({row}, {col}) is outside layer {layer}'s grid {g.grid}")
        return g.visible_from(row * g.grid[1] + col).reshape(g.grid)

    def relative_position_bias(self, layer: int) -> torch.Tensor:
        """The layer's relative position bias [heads, M², M²] (query place, key place in the window)."""
        return self.biases[layer]


def analyze_swin(model: Swin, image: ImageSource) -> SwinAnalysis:
    """Runs a Swin once on `image` (anything `vitviz.load_image` accepts), recording its window
    attention; the image is prepared by the spec's own preprocessing."""
    x, cropped = preprocess(load_image(image), _spec_of(model).preprocessing)
    return _analyze_input(model, x, cropped)


def analyze_swin_crop(model: Swin, cropped: Image.Image) -> SwinAnalysis:
    """`analyze_swin` for an image already cropped to the model's input (`SwinAnalysis.image`)."""
    return _analyze_input(model, to_input(cropped, _spec_of(model).preprocessing), cropped)


def _analyze_input(model: Swin, x: torch.Tensor, cropped: Image.Image) -> SwinAnalysis:
    spec = _spec_of(model)
    param = next(model.parameters())
    x = x.unsqueeze(0).to(device=param.device, dtype=param.dtype)
    with torch.inference_mode():
        start = time.perf_counter()
        with record_attention(model, reduce=lambda a: a.float().cpu()) as rec:
            tokens = model.encode(x)
            logits = model.head_logits(tokens) if spec.has_head else None
        if param.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        biases = [b.attn.relative_position_bias().float().cpu() for b in model.blocks]
    geometries = model.geometries(x.shape[2], x.shape[3])
    return SwinAnalysis(
        variant=spec.name,
        image=cropped,
        probabilities=logits[0].float().softmax(-1).cpu() if logits is not None else None,
        categories=spec.categories,
        attentions=list(rec.calls[-1]),
        geometries=geometries,
        stages=model.layer_stages,
        biases=biases,
        tokens=tokens[0].float().cpu(),
        patch_size=model.config.patch_size,
        device=str(param.device),
        model_seconds=seconds,
        layout=TokenLayout(prefix_names=(), grids=model.stage_grids(x.shape[2], x.shape[3]), attention="windowed", pooled_query=True,
                           classifier=spec.has_head, position_embeddings=False),
    )


# ---------------------------------------------------------------------------------------------
# Maps for a class: relevance, rollout, attention


def _target_index(target: int | str | None, categories: Sequence[str] | None, probabilities: torch.Tensor) -> int:
    """A class index from an index, a class name or None (the top-1)."""
    if categories is None:
        raise ValueError("this model has no classifier: there is no class to explain")
    if target is None:
        return int(probabilities.argmax())
    if isinstance(target, str):
        if target not in categories:
            raise ValueError(f"unknown class {target!r}; the model's classes are in model.spec.categories")
        return list(categories).index(target)
    if not 0 <= int(target) < len(categories):
        raise ValueError(f"class index {int(target)} is outside 0..{len(categories) - 1}")
    return int(target)


def swin_relevance_maps(
    model: Swin,
    x: torch.Tensor,
    *,
    methods: Sequence[str] = SWIN_METHODS,
    targets: Sequence[int | str | None] | torch.Tensor | None = None,
    text=None,
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """Maps of several methods for a batch, from one forward (and one backward for gradient
    methods), as `vitviz.relevance_maps` returns them for a ViT.

    Args:
        x: preprocessed images [B, 3, S, S].
        methods: of `SWIN_METHODS`: "rollout" and "attention" (no target), "gradient" and
            "grad_rollout" (the target class's logit).
        targets: per sample a class index, a class name or None (top-1); None for all top-1.

    Returns:
        ({method: maps [B, gh0, gw0]}, targets [B] (None without a classifier), probabilities [B, C] or None).
    """
    if text is not None:
        raise ValueError("a Swin has no text tower: text= needs an image–text model; explain a class with target=")
    unknown = [m for m in methods if m not in SWIN_METHODS]
    if unknown:
        raise ValueError(f"{unknown[0]!r} cannot run on a Swin (windowed attention); it offers {', '.join(SWIN_METHODS)}")
    if discard_ratio:
        raise ValueError("discard_ratio is not defined for windowed attention (most of each row is outside the window); use 0")
    spec = _spec_of(model)
    gradients = any(m in ("gradient", "grad_rollout") for m in methods)
    if gradients and not spec.has_head:
        raise ValueError(f"{spec.name} has no classifier: gradient methods need a class logit; use 'attention' or 'rollout'")
    param = next(model.parameters())
    chosen = probs = None
    with contextlib.ExitStack() as modes:
        if gradients:  # autograd on, also when the caller is in inference mode; a fresh leaf, so frozen weights do not matter
            modes.enter_context(torch.inference_mode(False))
            modes.enter_context(torch.enable_grad())
            x = x.to(device=param.device, dtype=param.dtype).detach().clone().requires_grad_(True)
        else:
            modes.enter_context(torch.inference_mode())
            x = x.to(device=param.device, dtype=param.dtype)
        with record_attention(model, gradients=gradients) as rec:
            logits = model(x) if spec.has_head else None
            if logits is not None:
                probs = logits.detach().float().softmax(-1)
                wanted = [None] * x.shape[0] if targets is None else list(targets)
                if len(wanted) != x.shape[0]:
                    raise ValueError(f"{len(wanted)} targets for {x.shape[0]} images")
                chosen = torch.tensor([_target_index(t, spec.categories, probs[i]) for i, t in enumerate(wanted)], device=logits.device)
                if gradients:
                    logits.gather(1, chosen[:, None]).sum().backward()
        attn = [a.detach().float() for a in rec.calls[-1]]
        grads = [g.float() for g in rec.grad_calls[-1]] if gradients else None
    geometries, stages = model.geometries(x.shape[2], x.shape[3]), model.layer_stages
    grid = geometries[0].grid
    maps: dict[str, torch.Tensor] = {}
    for m in methods:
        if m == "attention":
            flat = swin_last_attention(attn, geometries, stages, head_fusion=head_fusion)
        else:
            if m == "rollout":
                r = swin_rollout(attn, geometries, stages, head_fusion=head_fusion)
            elif m == "gradient":
                r = swin_gradient_relevance(attn, grads, geometries, stages)
            else:
                r = swin_gradient_rollout(attn, grads, geometries, stages, head_fusion=head_fusion)
            flat = r.mean(dim=1)  # the pooled query: the mean of the final tokens' rows
        maps[m] = flat.reshape(-1, *grid).detach().float().cpu()
    return maps, (chosen.cpu() if chosen is not None else None), (probs.cpu() if probs is not None else None)


def swin_relevance(model: Swin, image_or_x: ImageSource | torch.Tensor, target: int | str | None = None) -> torch.Tensor:
    """Chefer et al.'s gradient relevance of the pooled query for `target` (default: the top-1
    class), through every layer and merge, on the finest grid [gh0, gw0].

    Args:
        image_or_x: an image (anything `vitviz.load_image` accepts; the spec's preprocessing is
            applied) or a preprocessed tensor [3, S, S] / [1, 3, S, S].
    """
    if isinstance(image_or_x, torch.Tensor):
        x = image_or_x if image_or_x.ndim == 4 else image_or_x.unsqueeze(0)
        if x.ndim != 4 or x.shape[0] != 1:
            raise ValueError(f"expected one preprocessed image [3, S, S] or [1, 3, S, S], got {list(image_or_x.shape)}")
    else:
        x = preprocess(load_image(image_or_x), _spec_of(model).preprocessing)[0].unsqueeze(0)
    maps, _, _ = swin_relevance_maps(model, x, methods=["gradient"], targets=[target])
    return maps["gradient"][0]
