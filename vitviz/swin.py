"""The Swin Transformer of Liu et al., "Swin Transformer: Hierarchical Vision Transformer using
Shifted Windows" (ICCV 2021), and its second version, Liu et al., "Swin Transformer V2: Scaling Up
Capacity and Resolution" (CVPR 2022), written to be read top to bottom: the model alone. Its attention
made global, rollout and relevance through the merges and the analysis of one image are in
`vitviz.swin_analysis`; conversions from timm and Hugging Face in `vitviz.sources.swin`.

image [B, 3, H, W]
  -> patch embedding (Conv2d, kernel = stride = P), LayerNorm            [B, gh, gw, C]
  -> stage 0: blocks;  stage s > 0: patch merging (2 x 2 -> 1), blocks    [B, gh/2^s, gw/2^s, C 2^s]
       block: x + W-MSA(LN(x)), then x + MLP(LN(x)); W-MSA attends inside M x M windows; every
       second block first rolls the grid by -M/2 (torch.roll), attends inside the windows of the
       rolled grid with an additive mask (-100) between tokens that came from different regions,
       and rolls back; a relative position bias [heads, M², M²] is added to the logits
  -> final LayerNorm, mean over the final tokens, linear head             [B, classes]

Swin V2 (`SwinConfig.version = 2`) changes three things and keeps the windows, shifts and masks:
  res-post-norm   x + LN(W-MSA(x)), then x + LN(MLP(x)); a merge maps 4C -> 2C, then normalises
  scaled cosine   logits cos(q, k) / τ: q and k L2-normalised, 1/τ = exp(min(logit_scale, log 100))
                  per head; q and v have a bias, k none
  continuous bias B = 16 sigmoid(cpb_mlp(coordinates)): a 2 -> 512 -> heads MLP (ReLU) of each
                  offset (dy, dx) / (M_pre - 1) x 8, log-spaced as sign(t) log2(1 + |t|) / log2(8)
                  (M_pre: the window the model was pretrained with, `pretrained_window_size`, or M)

The window softmax is its own module (`WindowAttention.attend`, a `vitviz.model.Attention`), so a
forward hook sees each layer's attention `[B * windows, heads, M², M²]`, and `vitviz.record_attention`
records it (`rec.calls[-1][l]`: the shapes differ between stages). When nobody observes it, one
fused `scaled_dot_product_attention` runs instead (tests hold both paths equal).

Padding. A stage whose grid is not a whole number of windows is padded at the bottom and right
(timm: after the shift; Hugging Face: before it, `SwinConfig.pad_before_shift`); the padding tokens
are zeros (after the block's norm; V2 has none before the attention) and take part in the window
softmax, as in both libraries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from vitviz import steps
from vitviz.analysis import POOL
from vitviz.config import VariantSpec
from vitviz.model import Attention

__all__ = [
    "SwinConfig",
    "log_spaced_coordinates",
    "Swin",
    "SwinBlock",
    "SwinStage",
    "PatchMerging",
    "WindowAttention",
    "WindowGeometry",
    "relative_position_index",
]

MASK_VALUE = -100.0  # the additive mask between tokens of different regions of a shifted window (timm, Hugging Face)
LOGIT_SCALE_MAX = math.log(1 / 0.01)  # Swin V2: the cosine attention's log scale is clamped here (1/τ at most 100)
CPB_HIDDEN = 512  # Swin V2: the hidden width of the continuous position bias's MLP
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
        version: 1, or 2 for Swin V2 (res-post-norm, scaled cosine attention, continuous position
            bias, merges that normalise after the reduction; the module's docstring).
        pretrained_window_size: Swin V2: M_pre, the window whose offsets the continuous position bias
            was trained on, one for every stage or one per stage; 0 for the stage's own window.
        mask_value: the additive mask between regions of a shifted window: -100 (timm, the original
            code); -200 for Hugging Face's Swin V2, which adds its mask twice.
    """

    attention: ClassVar[str] = "windowed"  # how its tokens attend (`vitviz.layout.TokenLayout.attention`): within windows

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
    version: Literal[1, 2] = 1
    pretrained_window_size: int | tuple[int, ...] = 0
    mask_value: float = MASK_VALUE

    def __post_init__(self) -> None:
        object.__setattr__(self, "depths", tuple(int(d) for d in self.depths))
        object.__setattr__(self, "num_heads", tuple(int(h) for h in self.num_heads))
        windows = self.window_size
        windows = (int(windows),) * len(self.depths) if isinstance(windows, int) else tuple(int(w) for w in windows)
        object.__setattr__(self, "window_size", windows)
        pretrained = self.pretrained_window_size
        pretrained = (int(pretrained),) * len(self.depths) if isinstance(pretrained, int) else tuple(int(p) for p in pretrained)
        object.__setattr__(self, "pretrained_window_size", pretrained)
        if self.version not in (1, 2):
            raise ValueError(f"version must be 1 or 2, got {self.version!r}")
        if len(pretrained) != len(self.depths) or min(pretrained) < 0:
            raise ValueError(f"pretrained_window_size {pretrained} needs one entry of at least 0 per stage")
        if self.version == 1 and any(pretrained):
            raise ValueError(f"pretrained_window_size {pretrained} is Swin V2's (version=2): Swin V1's bias is a table, not a function of offsets")
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
        return self.tokens_of(self.grid[0] * self.grid[1])

    def tokens_of(self, patches: int) -> int:
        """The first stage's tokens for `patches` patches: a token a patch (`ViTConfig.tokens_of`)."""
        return patches

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
            if s:  # the merge: a linear map 4C -> 2C without bias and a norm (V1: over 4C, before it; V2: over 2C, after it)
                prev = self.dims[s - 1]
                total += 2 * (4 if self.version == 1 else 2) * prev + 4 * prev * 2 * prev
            if self.version == 1:  # qkv (with its bias), the output projection, the bias table
                attention = 3 * dim * dim + (3 * dim if self.qkv_bias else 0) + dim * dim + dim + (2 * wh - 1) * (2 * ww - 1) * heads
            else:  # qkv (q and v biases), the output projection, logit_scale, the bias's MLP
                attention = 3 * dim * dim + (2 * dim if self.qkv_bias else 0) + dim * dim + dim + heads + 3 * CPB_HIDDEN + CPB_HIDDEN * heads
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

    def mask(self, *, dtype: torch.dtype = torch.float32, device=None, value: float = MASK_VALUE) -> torch.Tensor | None:
        """The additive mask of a shifted layer [windows, M², M²]: `value` (-100) between places of
        different regions, 0 elsewhere; None when the layer is not shifted."""
        if not self.shifted:
            return None
        r = self.window_regions(device)
        return torch.zeros(r.shape[0], r.shape[1], r.shape[1], dtype=dtype, device=device).masked_fill(r[:, :, None] != r[:, None, :], value)

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


def log_spaced_coordinates(window: tuple[int, int], pretrained_window: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Swin V2's input to the continuous position bias: each offset (dy, dx) of a window, in the rows
    of `relative_position_index`'s table [(2wh - 1)(2ww - 1), 2], float32.

    t = offset / (M_pre - 1) x 8 along each axis (M_pre the pretrained window, or the window itself
    when 0; at least 1), then sign(t) log2(1 + |t|) / log2(8): in [-1, 1] at the pretrained window,
    beyond it (log-spaced) for a larger one."""
    dy, dx = torch.meshgrid(torch.arange(-(window[0] - 1), window[0], dtype=torch.float32),
                            torch.arange(-(window[1] - 1), window[1], dtype=torch.float32), indexing="ij")
    reference = pretrained_window if pretrained_window[0] > 0 else window
    t = torch.stack([dy / max(reference[0] - 1, 1), dx / max(reference[1] - 1, 1)], dim=-1) * 8
    return (torch.sign(t) * torch.log2(t.abs() + 1.0) / math.log2(8)).reshape(-1, 2)


class WindowAttention(Attention):
    """Multi-head self-attention inside windows, with a relative position bias B [heads, M², M²]
    added to the logits, and the mask of a shifted layer.

    Swin V1: softmax(q k^T / sqrt(d) + B + mask), B read from a learned table of (2wh-1)(2ww-1) rows.
    Swin V2: softmax(cos(q, k) exp(min(logit_scale, log 100)) + B + mask), B = 16 sigmoid(cpb_mlp(·))
    of the window's `log_spaced_coordinates`; q and v have a bias, k none.

    `attend` (the softmax) sees `[B * windows, heads, M², M²]`."""

    def __init__(self, *, width: int, heads: int, window: tuple[int, int], qkv_bias: bool = True, version: int = 1,
                 pretrained_window: tuple[int, int] = (0, 0)) -> None:
        super().__init__(width=width, heads=heads, qkv_bias=qkv_bias and version == 1, proj_bias=True)
        self.window, self.version = tuple(window), version
        self.register_buffer("relative_position_index", relative_position_index(self.window), persistent=False)
        if version == 1:
            self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window[0] - 1) * (2 * window[1] - 1), heads))
            return
        self.logit_scale = nn.Parameter(torch.full((heads, 1, 1), math.log(10)))
        self.cpb_mlp = nn.Sequential(nn.Linear(2, CPB_HIDDEN), nn.ReLU(), nn.Linear(CPB_HIDDEN, heads, bias=False))
        self.register_buffer("relative_coords_table", log_spaced_coordinates(self.window, tuple(pretrained_window)), persistent=False)
        self.q_bias = nn.Parameter(torch.zeros(width)) if qkv_bias else None
        self.v_bias = nn.Parameter(torch.zeros(width)) if qkv_bias else None

    def relative_position_bias(self) -> torch.Tensor:
        """B [heads, M², M²]: what is added to the logits of each (query place, key place)."""
        if self.version == 1:
            return self.relative_position_bias_table[self.relative_position_index].permute(2, 0, 1)
        table = self.cpb_mlp(self.relative_coords_table)  # [(2wh-1)(2ww-1), heads]
        # the sigmoid on [heads, M², M²] in memory, as timm and Hugging Face take it: the same rounding of each entry
        return 16 * torch.sigmoid(table[self.relative_position_index].permute(2, 0, 1).contiguous())

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N, C] -> [B, N, 3C]; Swin V2's bias is (q_bias, 0, v_bias)."""
        if self.version == 1 or self.q_bias is None:
            return self.qkv(x)
        return F.linear(x, self.qkv.weight, torch.cat([self.q_bias, torch.zeros_like(self.q_bias), self.v_bias]))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B * windows, M², C], mask [windows, M², M²] or None -> [B * windows, M², C]."""
        q, k, v = rearrange(self._qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        if self.version == 1:
            scale = self.scale
        else:  # scaled cosine attention: unit q and k, a learned scale per head [heads, 1, 1]
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
            scale = torch.clamp(self.logit_scale, max=LOGIT_SCALE_MAX).exp()
        bias = self.relative_position_bias().to(q.dtype)[None]  # [1, heads, M², M²]
        if self._observed():
            logits = (q @ k.transpose(-2, -1)) * scale + bias
            if mask is not None:  # window w of every image gets mask[w], added after the bias (as in timm: the same rounding)
                logits = rearrange(rearrange(logits, "(b w) h n m -> b w h n m", w=mask.shape[0]) + mask[:, None], "b w h n m -> (b w) h n m")
            attn = self.attend(logits)  # rows sum to 1
            return self.proj(rearrange(attn @ v, "b h n d -> b n (h d)"))
        if mask is not None:
            bias = (bias + mask[:, None]).repeat(x.shape[0] // mask.shape[0], 1, 1, 1)  # [B * windows, heads, M², M²]
        if self.version == 1:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            out = F.scaled_dot_product_attention(q * scale, k, v, attn_mask=bias, scale=1.0)
        return self.proj(rearrange(out, "b h n d -> b n (h d)"))


class SwinBlock(nn.Module):
    """On [B, gh, gw, C]: x + W-MSA(LN(x)), then x + MLP(LN(x)) (Swin V2: x + LN(W-MSA(x)), then
    x + LN(MLP(x))); W-MSA rolls the grid by -shift, cuts it into windows, attends in each, and puts
    the tokens back."""

    def __init__(self, *, width: int, heads: int, window: tuple[int, int], shift: tuple[int, int], config: SwinConfig,
                 pretrained_window: tuple[int, int] = (0, 0)) -> None:
        super().__init__()
        self.window, self.shift, self.pad_before_shift = tuple(window), tuple(shift), config.pad_before_shift
        self.post_norm, self.mask_value = config.version == 2, config.mask_value
        hidden = int(config.mlp_ratio * width)
        self.norm1 = nn.LayerNorm(width, eps=config.eps)
        self.attn = WindowAttention(width=width, heads=heads, window=self.window, qkv_bias=config.qkv_bias, version=config.version,
                                    pretrained_window=pretrained_window)
        self.norm2 = nn.LayerNorm(width, eps=config.eps)
        act = nn.GELU(approximate="tanh" if config.act == "gelu_tanh" else "none")
        self.mlp = nn.Sequential(nn.Linear(width, hidden), act, nn.Linear(hidden, width))

    def geometry(self, grid: tuple[int, int]) -> WindowGeometry:
        """How this block cuts a grid of real tokens (its stage's) into windows."""
        return WindowGeometry(grid=tuple(grid), window=self.window, shift=self.shift, pad_before_shift=self.pad_before_shift)

    def windowed_attention(self, x: torch.Tensor) -> torch.Tensor:
        """W-MSA: [B, gh, gw, C] -> [B, gh, gw, C]."""
        g = self.geometry((x.shape[1], x.shape[2]))
        windows = _partition(g.roll_and_pad(x), g.window)  # [B * windows, M², C]
        attended = self.attn(windows, g.mask(dtype=x.dtype, device=x.device, value=self.mask_value))
        return g.unroll(_unpartition(attended, g.window, g.padded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, gh, gw, C] -> [B, gh, gw, C]."""
        if self.post_norm:
            x = x + self.norm1(self.windowed_attention(x))
            return x + self.norm2(self.mlp(x))
        x = x + self.windowed_attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """Each 2 x 2 group of tokens -> one: concatenated in the order (0,0), (1,0), (0,1), (1,1)
    (row, column offsets; timm's and Hugging Face's), LayerNorm, a linear map 4C -> 2C without bias
    (Swin V2, `post_norm`: the linear map, then a LayerNorm over 2C). An odd grid is padded with
    zeros at the bottom and right first."""

    def __init__(self, width: int, *, post_norm: bool = False) -> None:
        super().__init__()
        self.post_norm = post_norm
        self.norm = nn.LayerNorm(2 * width if post_norm else 4 * width, eps=_PATCH_NORM_EPS)
        self.reduction = nn.Linear(4 * width, 2 * width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, gh, gw, C] -> [B, ceil(gh/2), ceil(gw/2), 2C]."""
        x = F.pad(x, (0, 0, 0, x.shape[2] % 2, 0, x.shape[1] % 2))
        x = rearrange(x, "b (h dh) (w dw) c -> b h w (dw dh c)", dh=2, dw=2)  # (dh, dw) = (0,0), (1,0), (0,1), (1,1)
        return self.norm(self.reduction(x)) if self.post_norm else self.reduction(self.norm(x))


class SwinStage(nn.Module):
    """Patch merging (stages after the first), then blocks alternating plain and shifted windows."""

    def __init__(self, config: SwinConfig, stage: int) -> None:
        super().__init__()
        c, width = config, config.dims[stage]
        window, shift = c.stage_windows()[stage]
        pretrained = (c.pretrained_window_size[stage],) * 2
        self.merge = PatchMerging(c.dims[stage - 1], post_norm=c.version == 2) if stage else None
        self.blocks = nn.ModuleList(
            SwinBlock(width=width, heads=c.num_heads[stage], window=window, shift=shift if i % 2 else (0, 0), config=c,
                      pretrained_window=pretrained)
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

    `vitviz.from_timm` and `vitviz.from_transformers` convert a timm `SwinTransformer` or
    `SwinTransformerV2`, or a Hugging Face `SwinModel` / `SwinForImageClassification` (or their
    `Swinv2` counterparts) into this one (`vitviz.sources.swin`).
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
            elif isinstance(module, WindowAttention) and module.version == 1:  # (V2: logit_scale log 10, q and v biases 0)
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
