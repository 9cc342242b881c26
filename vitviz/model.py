"""The Vision Transformer of Dosovitskiy et al., "An Image is Worth 16x16 Words: Transformers for
Image Recognition at Scale" (ICLR 2021), written to be read top to bottom, with the variations of
its descendants as options of one `ViTConfig`: DeiT's distillation token (Touvron et al. 2021),
DINOv2's registers and LayerScale (Oquab et al. 2023; Darcet et al. 2024), CLIP's norm before the
blocks and QuickGELU (Radford et al. 2021), mean pooling, models without a head.

image [B, 3, H, W]
  -> (a hybrid's convolutional stem, `vitviz.stems`: a feature map of stride s, P / s cells a patch)
  -> patch embedding (Conv2d, kernel = stride = P)            [B, gh*gw, D]
  -> add position embeddings (resampled when the grid is not the trained one; none when the
     positions are rotary)
  -> prepend the prefix tokens: cls, distillation, registers   [B, N, D],  N = p + gh*gw
     (and a test-time register, zeros: `ViTConfig.register_neurons`)
  -> (optional LayerNorm)
(every norm a LayerNorm, or an RMSNorm when `ViTConfig.norm` says so: AIMv2's)
  -> L pre-norm encoder blocks: x + LS(MSA(LN(x))), then x + LS(MLP(LN(x)))
  -> final LayerNorm; the cls token (or the mean of the patches, or attention pooling)   [B, D]
  -> linear head                                               [B, classes]

Attention is softmax(q k^T / sqrt(D / H)) — the scale is applied to the logits before the softmax.
With rotary positions (`ViTConfig.rope`), each patch's queries and keys are first turned, pair of
channels by pair, by angles that grow with its row and column (`Rotary`), so that q·k depends on
the offset between two patches; the prefix tokens are not turned.
With windows (`ViTConfig.attn_window`, Qwen2.5-VL's tower), a block's patches attend only within
square windows of the grid: the logits outside a query's window are −inf, its attention there 0.
The softmax is its own module (`Attention.attend`), so a forward hook on it sees each layer's
attention `[B, H, N, N]`. When nobody observes it, a fused `scaled_dot_product_attention` runs
instead; both paths give the same output (tests hold them to it).

This module imports nothing else of vitviz but the leaf `vitviz.config` (where `ViTConfig` lives).
Conversions from torchvision, timm and Hugging Face models live with their weights sources
(`vitviz.from_torchvision`, `vitviz.from_timm`, `vitviz.from_transformers`), whose modules also
register themselves as `ViT.from_<library>` when `vitviz.sources` imports them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from einops import rearrange
from einops.layers.torch import Rearrange
from torch import nn

from vitviz import steps
from vitviz.config import VariantSpec, ViTConfig, _use_model_class

__all__ = [
    "ViT",
    "ViTConfig",
    "Attention",
    "AttentionPool",
    "EncoderBlock",
    "PatchEmbedding",
    "LayerScale",
    "QuickGELU",
    "Rotary",
    "RelativePositionBias",
    "relative_index",
    "norm_layer",
    "register_stem",
    "stem_of",
    "recording_in_this_thread",
    "resample_pos_embed",
    "Windowed",
    "window_mask",
]

_recording = threading.local()


def recording_in_this_thread() -> bool:
    """True while `vitviz.record_attention` is active in the calling thread."""
    return getattr(_recording, "depth", 0) > 0


def _enter_recording() -> None:
    _recording.depth = getattr(_recording, "depth", 0) + 1


def _leave_recording() -> None:
    _recording.depth -= 1


def _set_part_reducer(module: Attention, reducer: Callable[[torch.Tensor, int, int], None] | None, images: int = 1) -> None:
    """In the calling thread only: `module`'s explicit attention computed `images` images at a time,
    each part's softmax output [b, H, N, N] handed to `reducer(part, first image, batch size)`
    (`vitviz.record_attention(..., images_at_a_time=...)`); None: as before."""
    parts = getattr(_recording, "parts", None)
    if parts is None:
        parts = _recording.parts = {}
    if reducer is None:
        parts.pop(id(module), None)
    else:
        parts[id(module)] = (reducer, images)


def _part_reducer(module: Attention) -> tuple[Callable[[torch.Tensor, int, int], None], int] | None:
    parts = getattr(_recording, "parts", None)
    return parts.get(id(module)) if parts else None


def norm_layer(kind: str, width: int, eps: float) -> nn.Module:
    """A norm over the last `width` channels: "layernorm" (centred, scaled, shifted) or "rmsnorm"
    (x / sqrt(mean(x²) + eps) · γ: no centring, no shift; AIMv2's)."""
    if kind == "rmsnorm":
        return nn.RMSNorm(width, eps=eps)
    return nn.LayerNorm(width, eps=eps)


# The convolutional stems `ViTConfig.stem` names, by kind: `vitviz.stems` registers its own when it is
# imported (`import vitviz` imports it), since this module imports nothing else of vitviz.
STEMS: dict[str, Callable[[ViTConfig], nn.Module]] = {}


def register_stem(kind: str, build: Callable[[ViTConfig], nn.Module]) -> None:
    """Build the stems of `kind` (`ViTConfig.stem`) with `build(config)`: a module taking images
    [B, 3, H, W] to a feature map [B, config.stem_channels, H / config.stem_stride, W / config.stem_stride]."""
    STEMS[kind] = build


def stem_of(config: ViTConfig) -> nn.Module | None:
    """The stem `config` names (`ViTConfig.stem`), built; None for a patch embedding of the pixels."""
    if config.stem is None:
        return None
    if config.stem not in STEMS:
        raise ValueError(f"no stem of kind {config.stem!r} is registered (vitviz.stems registers 'bit', 'resnet_d' and 'conv' "
                         "when imported; `import vitviz` imports it)")
    return STEMS[config.stem](config)


class PatchEmbedding(nn.Module):
    """Cuts the image into P x P patches and projects each to D dims with one strided Conv2d (then,
    for AIMv2, a norm of each patch's embedding: `norm`). A hybrid (`ViTConfig.stem`) runs its
    convolutional stem first and cuts the stem's feature map instead: P / s cells a patch for a stem
    of stride s, so that a token still covers P x P pixels."""

    def __init__(self, *, patch_size: int, width: int, in_channels: int = 3, bias: bool = True, norm: nn.Module | None = None,
                 stem: nn.Module | None = None, stem_stride: int = 1) -> None:
        super().__init__()
        self.patch_size = patch_size  # P: the pixels one token covers
        self.stem = stem if stem is not None else nn.Identity()  # [B, 3, H, W] -> [B, in_channels, H / s, W / s]
        kernel = patch_size // stem_stride
        self.proj = nn.Conv2d(in_channels, width, kernel_size=kernel, stride=kernel, bias=bias)
        self.flatten = Rearrange("b d gh gw -> b (gh gw) d")
        self.norm = norm if norm is not None else nn.Identity()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> [B, gh*gw, D]."""
        return self.norm(self.flatten(self.proj(self.stem(images))))


class Rotary(nn.Module):
    """Rotary position embeddings in 2D (`ViTConfig.rope`): for a patch grid, the cosines and sines of
    the angles θ_j = y·f_y,j + x·f_x,j by which each pair j of a head's query and key channels is
    turned (Su et al. 2021's rotation, with one angle per pair made of the patch's row y and column
    x).

        rotate(q)_pair j = [[cos θ_j, −sin θ_j], [sin θ_j, cos θ_j]] · (q_a, q_b)

    so that q_m·k_n after rotation depends on the positions only through y_m − y_n and x_m − x_n
    (the coordinates are linear in the patch indices). `frequencies()` gives (f_y, f_x) [2, d/2]: fixed
    for "axial" and "dinov3" (computed in float32 whatever the model's dtype), learned per layer and
    head for "mixed" (the parameter `freqs` [L, H, 2, d/2]).
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        c = self.config = config
        d = c.width // c.heads
        if c.rope == "mixed":
            self.freqs = nn.Parameter(torch.zeros(c.depth, c.heads, 2, d // 2))
        else:  # fixed: computed in float32 when used, whatever the model's dtype
            self.register_buffer("anchor", torch.zeros(0), persistent=False)  # (follows the model's device)

    def frequencies(self) -> torch.Tensor:
        """(f_y, f_x): [2, d/2], or [L, H, 2, d/2] for "mixed"; float32."""
        c = self.config
        if c.rope == "mixed":
            return self.freqs.float()
        n = c.width // c.heads // 4
        k = torch.arange(n, dtype=torch.float32, device=self.anchor.device) / n
        bands = c.rope_temperature ** -k if c.rope == "axial" else 2 * torch.pi / c.rope_temperature**k
        zeros = torch.zeros_like(bands)
        first, second = torch.cat([bands, zeros]), torch.cat([zeros, bands])  # the first half of the pairs, then the second
        fy, fx = (first, second) if c.rope_axes == "yx" else (second, first)
        return torch.stack([fy, fx])

    def coordinates(self, grid: tuple[int, int]) -> torch.Tensor:
        """The (y, x) of each patch of `grid`, row by row: [gh*gw, 2], float32."""
        c, (gh, gw) = self.config, grid
        device = self.freqs.device if c.rope == "mixed" else self.anchor.device
        if c.rope == "dinov3":  # patch centres, each axis mapped to [-1, 1]
            axes = [((torch.arange(g, device=device, dtype=torch.float32) + 0.5 + c.rope_offset) / g) * 2 - 1 for g in (gh, gw)]
        else:
            axes = [torch.arange(g, device=device, dtype=torch.float32) + c.rope_offset for g in (gh, gw)]
            if c.rope_ref_grid is not None:  # EVA: positions rescaled to the grid the model was trained at
                axes = [a / g * r for a, g, r in zip(axes, (gh, gw), c.rope_ref_grid)]
        y, x = torch.meshgrid(*axes, indexing="ij")
        return torch.stack([y.flatten(), x.flatten()], dim=-1)

    def angles(self, grid: tuple[int, int]) -> torch.Tensor:
        """θ [gh*gw, d/2] (or [L, H, gh*gw, d/2] for "mixed"), float32."""
        yx = self.coordinates(grid)
        f = self.frequencies()
        return yx[:, 0:1] * f[..., 0, None, :] + yx[:, 1:2] * f[..., 1, None, :]

    def forward(self, grid: tuple[int, int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each block's (cos, sin) [gh*gw, d] (or [H, gh*gw, d]), laid out as the pairs are
        (`ViTConfig.rope_pairs`), float32."""
        theta = self.angles(grid)
        cos, sin = theta.cos(), theta.sin()
        if self.config.rope_pairs == "half":
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        else:
            cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        if self.config.rope == "mixed":
            return [(cos[i], sin[i]) for i in range(cos.shape[0])]
        return [(cos, sin)] * self.config.depth


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], pairs: str) -> torch.Tensor:
    """x [..., N, d] turned by `rope`'s (cos, sin) [N, d] (or [H, N, d]): x cos + x⊥ sin, x⊥ each pair
    (a, b) -> (−b, a); in float32 at least, returned in x's dtype."""
    cos, sin = rope
    if pairs == "half":
        a, b = x.chunk(2, dim=-1)
        perp = torch.cat([-b, a], dim=-1)
    else:
        perp = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).flatten(-2)
    return (x * cos + perp * sin).to(x.dtype)


def relative_index(grid: tuple[int, int], prefix: int) -> torch.Tensor:
    """BEiT's index of each (query, key) pair's entry in a relative position bias table, [N, N] for
    `prefix` (0 or 1) cls tokens then the patches of `grid` row by row: a patch pair's offset
    (query − key) at (Δy + gh − 1)(2gw − 1) + Δx + gw − 1; then, after those (2gh − 1)(2gw − 1),
    the cls token to a patch, a patch to the cls token, the cls token to itself."""
    gh, gw = grid
    y = torch.arange(gh).repeat_interleave(gw)
    x = torch.arange(gw).repeat(gh)
    patches = (y[:, None] - y[None, :] + gh - 1) * (2 * gw - 1) + (x[:, None] - x[None, :] + gw - 1)
    if not prefix:
        return patches
    n = (2 * gh - 1) * (2 * gw - 1)
    index = torch.zeros(gh * gw + 1, gh * gw + 1, dtype=torch.long)
    index[1:, 1:] = patches
    index[0, :] = n
    index[:, 0] = n + 1
    index[0, 0] = n + 2
    return index


class RelativePositionBias(nn.Module):
    """A learned bias per head for every (query, key) offset of the trained grid, added to the
    attention logits (`ViTConfig.rel_pos_bias`; BEiT's). `table` [(2gh − 1)(2gw − 1) + 3, H]
    holds the patches' offsets, then the cls token's three entries (`relative_index`)."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        c = config
        self.grid = c.grid
        self.table = nn.Parameter(torch.zeros((2 * c.grid[0] - 1) * (2 * c.grid[1] - 1) + 3, c.heads))
        self.register_buffer("index", relative_index(c.grid, c.num_prefix_tokens), persistent=False)

    def forward(self) -> torch.Tensor:
        """The bias [H, N, N] of the trained grid."""
        return self.table[self.index].permute(2, 0, 1)

    def offsets(self) -> torch.Tensor:
        """The patches' bias by offset [H, 2gh − 1, 2gw − 1], entry [gh − 1 + dy, gw − 1 + dx] for the key
        dy rows and dx columns from the query (the table read with key − query)."""
        gh, gw = self.grid
        patches = self.table[: (2 * gh - 1) * (2 * gw - 1)].T.reshape(-1, 2 * gh - 1, 2 * gw - 1)  # by query − key
        return patches.flip(-2, -1)


def window_mask(grid: tuple[int, int], window: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[gh*gw, gh*gw] bool over the patches of `grid` row by row: True where the query and the key lie
    in the same window of `window` x `window` patches, the windows cut from the grid's top-left corner
    (those of the last rows and columns smaller where the grid is not a whole number of windows)."""
    gh, gw = grid
    across = -(-gw // window)  # windows per row of windows
    rows = torch.arange(gh, device=device).repeat_interleave(gw) // window
    cols = torch.arange(gw, device=device).repeat(gh) // window
    cell = rows * across + cols
    return cell[:, None] == cell[None, :]


class Windowed:
    """What `ViT.rotations` hands a block that attends within windows (`ViTConfig.attn_window`) in
    place of its rotary (cos, sin): those (`rope`, or None) and `mask` [N, N] (`window_mask`), True
    where a query may attend to a key."""

    __slots__ = ("rope", "mask")

    def __init__(self, rope: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor) -> None:
        self.rope, self.mask = rope, mask

    def __repr__(self) -> str:
        return f"Windowed(rope={'None' if self.rope is None else 'cos, sin'}, mask={list(self.mask.shape)})"


class Attention(nn.Module):
    """Multi-head self-attention with one fused qkv projection.

    `attend` (the softmax) is a module of its own so that hooks can observe the attention.
    Set `fused = False` to always take the explicit path.
    """

    def __init__(self, *, width: int, heads: int, qkv_bias: bool = True, proj_bias: bool = True, qk_norm: bool = False,
                 eps: float = 1e-6, prefix: int = 0, rope_pairs: str = "interleaved", out_norm: bool = False,
                 norm: str = "layernorm", rel_pos: nn.Module | None = None) -> None:
        super().__init__()
        self.rel_pos = rel_pos  # `RelativePositionBias`: added to the logits
        self.prefix = prefix  # leading tokens that rotary positions leave as they are
        self.rope_pairs = rope_pairs
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.scale = (width // heads) ** -0.5
        self.qkv = nn.Linear(width, 3 * width, bias=qkv_bias)
        # normalised queries and keys: each head's through a LayerNorm over its own channels
        self.q_norm = norm_layer(norm, width // heads, eps) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(norm, width // heads, eps) if qk_norm else nn.Identity()
        self.attend = nn.Softmax(dim=-1)
        # `ViTConfig.attn_norm`: a LayerNorm over the heads' concatenated outputs (an identity without
        # one; either way the heads' outputs o_h are its input)
        self.norm = norm_layer(norm, width, eps) if out_norm else nn.Identity()
        self.proj = nn.Linear(width, width, bias=proj_bias)
        self.fused = True

    def _observed(self) -> bool:
        if not self.fused or recording_in_this_thread():
            return True
        # A hook that somebody else put on the softmax must see it run; vitviz's own recorder hooks
        # only care about their own thread (handled above). tuple() copies the dict atomically.
        hooks = tuple(self.attend._forward_hooks.values()) + tuple(self.attend._forward_pre_hooks.values())
        return any(not getattr(h, "_vitviz_recorder", False) for h in hooks)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | Windowed | None = None) -> torch.Tensor:
        """[B, N, D] -> [B, N, D]; `rope`: the patches' rotary (cos, sin) (`Rotary`), if any, or a
        `Windowed` with them and the window's mask (no attention outside it)."""
        window = None
        if isinstance(rope, Windowed):
            rope, window = rope.rope, rope.mask
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            p = self.prefix
            q = torch.cat([q[:, :, :p], rotate(q[:, :, p:], rope, self.rope_pairs)], dim=2)
            k = torch.cat([k[:, :, :p], rotate(k[:, :, p:], rope, self.rope_pairs)], dim=2)
        bias = self.rel_pos().to(q.dtype) if self.rel_pos is not None else None  # [H, N, N]
        parts = _part_reducer(self) if recording_in_this_thread() else None
        if parts is not None:
            out = self._by_parts(q, k, v, *parts, bias=bias, window=window)
        elif self._observed():
            attn = self.attend(self._logits(q, k, bias, window))  # [B, H, N, N], rows sum to 1 (float32 for a half-precision model)
            out = attn.to(v.dtype) @ v
        else:
            mask = bias
            if window is not None:  # a boolean mask (True: attended), or the bias with −inf outside the window
                mask = window if bias is None else bias.masked_fill(~window, float("-inf"))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(self.norm(rearrange(out, "b h n d -> b n (h d)")))

    def _logits(self, q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None, window: torch.Tensor | None = None) -> torch.Tensor:
        """q kᵀ / sqrt(d) (+ the relative position bias; −inf outside the window where `window` [N, N]
        is given): in float32 when the model is in half precision, so that the softmax (what vitviz
        records) keeps float32's resolution."""
        if q.dtype in (torch.float16, torch.bfloat16):
            q, k, bias = q.float(), k.float(), None if bias is None else bias.float()
        logits = (q @ k.transpose(-2, -1)) * self.scale
        if bias is not None:
            logits = logits + bias
        return logits if window is None else logits.masked_fill(~window, float("-inf"))

    def _by_parts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, reducer, images: int,
                  bias: torch.Tensor | None = None, window: torch.Tensor | None = None) -> torch.Tensor:
        """The explicit attention a few images at a time, each part's softmax output reduced while it
        is in the processor's cache (the layer's other work runs on the whole batch). The same
        arithmetic as the explicit path; hooks on `attend` see the whole layer's attention as ever,
        so with any hook the layer is computed whole and reduced as one part."""
        batch = q.shape[0]
        if self.attend._forward_hooks or self.attend._forward_pre_hooks:
            images = batch  # every hook sees the whole layer, as on the explicit path
        differentiable = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        out = None if differentiable else q.new_empty(q.shape[:-1] + v.shape[-1:])
        outs = []
        for first in range(0, batch, images):
            part = slice(first, first + images)
            attn = self.attend(self._logits(q[part], k[part], bias, window))
            reducer(attn, first, batch)
            if out is None:
                outs.append(attn.to(v.dtype) @ v[part])
            else:  # written in place: no copy of the layer's output
                torch.matmul(attn.to(v.dtype), v[part], out=out[part])
        return torch.cat(outs) if out is None else out


class AttentionPool(nn.Module):
    """Multi-head attention pooling ("MAP"; SigLIP's head, Zhai et al. 2023): one learned query, the
    probe, attends over every token (or the patches alone: `ViTConfig.pool_prefix`); an MLP with its
    own residual follows.

        a = softmax(q(probe) k(x)^T / sqrt(D / H))     [B, H, 1, N], the probe's attention (H: `pool_heads`)
        y = proj(a v(x));  out = y + MLP(LN(y))         [B, D]

    The probe has no residual of its own (y is the attention's output alone). AIMv2's pool
    (`ViTConfig.pool_head="plain"`) uses the probe itself as the query and stops at y. The softmax is its own
    module (`attend`), as in `Attention`: `vitviz.record_attention` records the probe's attention
    beside the blocks' (`AttentionRecord.pool_attention`).
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        c = config
        self.heads = c.pool_heads or c.heads
        self.scale = (c.width // self.heads) ** -0.5
        self.skip = 0 if c.pool_prefix else c.num_prefix_tokens  # leading tokens the probe does not attend to
        self.probe = nn.Parameter(torch.zeros(1, 1, c.width))
        self.plain = c.pool_head == "plain"  # AIMv2's: the probe is the query; nothing after the output projection
        self.q = nn.Identity() if self.plain else nn.Linear(c.width, c.width)
        self.kv = nn.Linear(c.width, 2 * c.width, bias=c.qkv_bias or not self.plain)
        self.attend = nn.Softmax(dim=-1)
        self.proj = nn.Linear(c.width, c.width)
        if not self.plain:
            self.norm = norm_layer(c.norm, c.width, c.eps)
            m = c.pool_mlp_dim or c.mlp_dim
            self.mlp = nn.Sequential(nn.Linear(c.width, m), _activation(c.act), nn.Linear(m, c.width))
        nn.init.normal_(self.probe, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, N, D] -> [B, D]."""
        q = rearrange(self.q(self.probe), "one m (h d) -> one h m d", h=self.heads)  # [1, H, 1, d]
        k, v = rearrange(self.kv(tokens), "b n (two h d) -> two b h n d", two=2, h=self.heads)
        logits = (q.float() @ k.float().transpose(-2, -1)) * self.scale  # (float32 for a half-precision model, as `Attention`)
        if self.skip:  # the prefix tokens left out: a softmax over the patches alone, the prefix's share 0
            logits = logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) < self.skip, float("-inf"))
        attn = self.attend(logits)  # [B, H, 1, N], rows sum to 1
        y = self.proj(rearrange(attn.to(v.dtype) @ v, "b h m d -> b m (h d)"))[:, 0]
        return y if self.plain else y + self.mlp(self.norm(y))


class LayerScale(nn.Module):
    """A learned per-channel scale of a residual branch (Touvron et al. 2021, CaiT)."""

    def __init__(self, width: int, init: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((width,), float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class QuickGELU(nn.Module):
    """x sigmoid(1.702 x): the GELU approximation CLIP was trained with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def _activation(name: str) -> nn.Module:
    return {"gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh"), "quick_gelu": QuickGELU(), "silu": nn.SiLU()}[name]


class GatedMLP(nn.Module):
    """A gated MLP (GLU family; SwiGLU with SiLU, Shazeer 2020): act(x W_g) ⊙ (x W_v), then W_2.

    The input projection is one Linear, "0", [2 M, D]: its first M outputs the gate's, the next M
    the value's; "2" is W_2 [D, M] (the names of the plain MLP's layers, so that a block's MLP is
    `mlp.0`, `mlp.2` in either kind).
    """

    def __init__(self, width: int, hidden: int, act: str, bias: bool = True, norm: nn.Module | None = None,
                 shift: nn.Module | None = None) -> None:
        super().__init__()
        self.hidden = hidden
        self.add_module("0", nn.Linear(width, 2 * hidden, bias=bias))
        self.act = _activation(act)
        self.shift = shift if shift is not None else nn.Identity()  # `RegisterShift` of a test-time register
        self.norm = norm if norm is not None else nn.Identity()  # `ViTConfig.mlp_norm`: after the gating
        self.add_module("2", nn.Linear(hidden, width, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = getattr(self, "0")(x).split(self.hidden, dim=-1)
        return getattr(self, "2")(self.norm(self.shift(self.act(gate) * value)))


class RegisterShift(nn.Module):
    """A test-time register's work in one MLP (Jiang et al. 2025): the hidden activations [B, N, M]
    of some neurons moved into the register token at `position`, which takes each neuron's maximum
    over all tokens while every other token gets 0 (with `keep_prefix` the tokens before the register
    keep theirs). Out of place, so gradients flow through it."""

    def __init__(self, neurons: tuple[int, ...], position: int, keep_prefix: bool = False) -> None:
        super().__init__()
        self.neurons, self.position, self.keep_prefix = tuple(neurons), position, keep_prefix

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        index = torch.tensor(self.neurons, device=h.device)
        a = h.index_select(-1, index)  # [B, N, k]
        moved = torch.zeros_like(a)
        moved[:, self.position] = a.amax(dim=1)
        if self.keep_prefix:
            moved[:, : self.position] = a[:, : self.position]
        return h.index_copy(-1, index, moved)

    def extra_repr(self) -> str:
        return f"neurons={list(self.neurons)}, position={self.position}"


def mlp_of(c: ViTConfig, layer: int = 0) -> nn.Module:
    """Block `layer`'s MLP for `c`: plain (Linear "0", act "1", Linear "2"; with `mlp_norm` a LayerNorm
    "norm" before "2") or gated (`GatedMLP`); with a test-time register's neurons in this block
    (`ViTConfig.register_neurons`), a `RegisterShift` "shift" right after the activation."""
    norm = norm_layer(c.norm, c.mlp_dim, c.eps) if c.mlp_norm else None
    neurons = tuple(j for l, j in c.register_neurons if l == layer)
    shift = RegisterShift(neurons, c.num_prefix_tokens - 1, c.register_keep_prefix) if neurons else None
    if c.mlp == "gated":
        return GatedMLP(c.width, c.mlp_dim, c.act, bias=c.mlp_bias, norm=norm, shift=shift)
    layers = {"0": nn.Linear(c.width, c.mlp_dim, bias=c.mlp_bias), "1": _activation(c.act)}
    if shift is not None:
        layers["shift"] = shift
    if norm is not None:
        layers["norm"] = norm
    layers["2"] = nn.Linear(c.mlp_dim, c.width, bias=c.mlp_bias)
    return nn.Sequential(OrderedDict(layers))


class EncoderBlock(nn.Module):
    """Pre-norm Transformer block: x + LS(MSA(LN(x))), then x + LS(MLP(LN(x))), LS the identity
    unless the config asks for LayerScale; with `ViTConfig.post_norm`, x + LS(LN(MSA(x))), then
    x + LS(LN(MLP(x))); with `ViTConfig.parallel`, x + LS(MSA(LN(x))) + LS(MLP(LN(x))) (one norm,
    `norm2` the identity)."""

    def __init__(self, config: ViTConfig, layer: int = 0) -> None:
        super().__init__()
        c = config
        self.post = c.post_norm
        self.norm1 = norm_layer(c.norm, c.width, c.eps)
        self.attn = Attention(width=c.width, heads=c.heads, qkv_bias=c.qkv_bias, proj_bias=c.proj_bias, qk_norm=c.qk_norm, eps=c.eps,
                              prefix=c.num_prefix_tokens, rope_pairs=c.rope_pairs, out_norm=c.attn_norm, norm=c.norm,
                              rel_pos=RelativePositionBias(c) if c.rel_pos_bias else None)
        self.ls1 = LayerScale(c.width, c.layer_scale) if c.layer_scale is not None else nn.Identity()
        self.parallel = c.parallel
        self.norm2 = nn.Identity() if c.parallel else norm_layer(c.norm, c.width, c.eps)
        self.mlp = mlp_of(c, layer)
        self.ls2 = LayerScale(c.width, c.layer_scale) if c.layer_scale is not None else nn.Identity()

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | Windowed | None = None) -> torch.Tensor:
        if self.parallel:
            y = self.norm1(x)
            return x + self.ls1(self.attn(y, rope)) + self.ls2(self.mlp(y))
        if self.post:
            x = x + self.ls1(self.norm1(self.attn(x, rope)))
            return x + self.ls2(self.norm2(self.mlp(x)))
        x = x + self.ls1(self.attn(self.norm1(x), rope))
        return x + self.ls2(self.mlp(self.norm2(x)))


def resample_pos_embed(
    pos: torch.Tensor, *, old_grid: tuple[int, int], new_grid: tuple[int, int], antialias: bool = True,
    mode: str = "bicubic", square: bool = False, align_corners: bool = False,
) -> torch.Tensor:
    """Patch position embeddings [1, gh*gw, D] for another grid: interpolated on each channel's grid
    (`mode` "bicubic", as timm and most of Hugging Face do, or "bilinear", SigLIP 2's; timm antialiases,
    Hugging Face's ViT does not). With `square`, the table is resampled to the square of the new grid's
    longer side and its top-left gh x gw kept (timm's NaFlex with `pos_embed_ar_preserving`);
    `align_corners` as F.interpolate takes it."""
    if tuple(old_grid) == tuple(new_grid):
        return pos
    d = pos.shape[-1]
    gh, gw = new_grid
    size = (max(gh, gw),) * 2 if square else (gh, gw)
    grid = pos.reshape(1, *old_grid, d).permute(0, 3, 1, 2).float()  # [1, D, gh, gw]
    if tuple(old_grid) != size:
        grid = F.interpolate(grid, size=size, mode=mode, align_corners=align_corners, antialias=antialias)
    grid = grid[:, :, :gh, :gw]
    return grid.permute(0, 2, 3, 1).reshape(1, gh * gw, d).to(pos.dtype)


class ViT(nn.Module):
    """Vision Transformer, built from a `ViTConfig` (or its fields as keywords).

    The original ViT classifies from the cls token after a final LayerNorm; the config's options
    cover DeiT, DINO, DINOv2 (with registers), CLIP image towers and models without a head.
    `ViT.from_torchvision`, `ViT.from_timm` and `ViT.from_transformers` convert a model of those
    libraries into this one (same outputs, attention you can record).
    """

    # The conversions: the functions `vitviz.from_torchvision`, `vitviz.from_timm` and
    # `vitviz.from_transformers` themselves, kept here for existing callers. Each weights source's
    # module sets its own when it is imported (`import vitviz` imports them), since this module
    # cannot import those that stand on it.
    from_torchvision: ClassVar[Callable[[nn.Module], "ViT"]]
    from_timm: ClassVar[Callable[[nn.Module], "ViT"]]
    from_transformers: ClassVar[Callable[..., "ViT"]]

    def __init__(self, config: ViTConfig | None = None, **fields_: Any) -> None:
        super().__init__()
        if config is None:
            config = ViTConfig(**fields_)
        elif fields_:
            raise TypeError("pass a ViTConfig or its fields, not both")
        self.config = c = config
        self.patch_embed = PatchEmbedding(patch_size=c.patch_size, width=c.width, bias=c.patch_bias,
                                          norm=norm_layer(c.norm, c.width, c.eps) if c.patch_norm else None,
                                          in_channels=c.stem_channels, stem=stem_of(c), stem_stride=c.stem_stride)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.width)) if c.class_token else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, c.width)) if c.distill_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, c.register_tokens, c.width)) if c.register_tokens else None
        gh, gw = c.grid
        self.pos_embed = nn.Parameter(torch.empty(1, c.pos_embed_prefix + gh * gw, c.width).normal_(std=0.02)) if c.abs_pos_embed else None
        self.rotary = Rotary(c) if c.rope else None
        self.norm_pre = norm_layer(c.norm, c.width, c.eps) if c.norm_pre else nn.Identity()
        self.blocks = nn.ModuleList(EncoderBlock(c, i) for i in range(c.depth))
        self.norm = norm_layer(c.norm, c.width, c.eps) if c.final_norm and not c.fc_norm else nn.Identity()
        self.fc_norm = norm_layer(c.norm, c.width, c.eps) if c.fc_norm else nn.Identity()
        self.attn_pool = AttentionPool(c) if c.pool == "map" else None
        self.head = nn.Linear(c.width, c.num_classes) if c.num_classes else nn.Identity()
        self.head_dist = nn.Linear(c.width, c.num_classes) if c.num_classes and c.distill_token else None
        self.spec: VariantSpec | None = None  # the record of where the model came from, attached by its loader
        self._init_weights()

    def _init_weights(self) -> None:
        fan_in = self.patch_embed.proj.in_channels * self.config.embed_patch_size**2
        nn.init.trunc_normal_(self.patch_embed.proj.weight, std=(1.0 / fan_in) ** 0.5)
        if self.patch_embed.proj.bias is not None:
            nn.init.zeros_(self.patch_embed.proj.bias)
        for token in (self.dist_token, self.reg_token):
            if token is not None:
                nn.init.trunc_normal_(token, std=0.02)
        for module in self.blocks.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.normal_(module.bias, std=1e-6)

    # the config's facts, as attributes
    image_size = property(lambda self: self.config.image_size)
    patch_size = property(lambda self: self.config.patch_size)
    width = property(lambda self: self.config.width)
    depth = property(lambda self: self.config.depth)
    heads = property(lambda self: self.config.heads)
    mlp_dim = property(lambda self: self.config.mlp_dim)
    num_classes = property(lambda self: self.config.num_classes)
    grid = property(lambda self: self.config.grid)
    num_prefix_tokens = property(lambda self: self.config.num_prefix_tokens)
    prefix_names = property(lambda self: self.config.prefix_names)
    query_names = property(lambda self: self.config.query_names)

    @property
    def num_tokens(self) -> int:
        """N at the trained image size."""
        return self.config.num_tokens

    def grid_for(self, height: int, width: int) -> tuple[int, int]:
        """The patch grid of an image of height x width pixels (both multiples of P; the trained size
        for a model with a relative position bias, learned for its grid only)."""
        c = self.config
        p = c.patch_size
        if height % p or width % p:
            raise ValueError(f"the image is {height}x{width} px; both sides must be multiples of the patch size {p}")
        if c.rel_pos_bias and (height // p, width // p) != c.grid:
            raise ValueError(f"this model's relative position bias is learned for its {c.grid[0]}x{c.grid[1]} grid "
                             f"({c.image_size} px); the image is {height}x{width} px")
        return height // p, width // p

    def patch_pos_embed(self, grid: tuple[int, int]) -> torch.Tensor | None:
        """Position embeddings of the patches for `grid` [1, gh*gw, D], resampled from the trained
        grid; None for a model without a learned table (`ViTConfig.abs_pos_embed`)."""
        c = self.config
        if self.pos_embed is None:
            return None
        return resample_pos_embed(self.pos_embed[:, c.pos_embed_prefix :], old_grid=c.grid, new_grid=grid, antialias=c.pos_embed_antialias,
                                  mode=c.pos_embed_interpolation, square=c.pos_embed_square, align_corners=c.pos_embed_align_corners)

    def tokens(self, images: torch.Tensor) -> torch.Tensor:
        """Prefix and patch tokens with their position embeddings: [B, 3, H, W] -> [B, N, D]."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(
                f"expected images of shape [B, 3, {self.image_size}, {self.image_size}] (or another multiple of "
                f"{self.patch_size} px), got {list(images.shape)}"
            )
        grid = self.grid_for(images.shape[2], images.shape[3])
        x = self.patch_embed(images)
        pos = self.patch_pos_embed(grid)
        if pos is not None:
            x = x + pos
        c = self.config
        learned = [t for t in (self.cls_token, self.dist_token, self.reg_token) if t is not None]
        prefix = torch.cat(learned, dim=1) if learned else x.new_zeros(1, 0, x.shape[-1])  # [1, p, D]: cls, dist, registers
        k = c.pos_embed_prefix
        if k:
            prefix = torch.cat([prefix[:, :k] + self.pos_embed[:, :k], prefix[:, k:]], dim=1)
        if c.register_neurons:  # a test-time register: zeros, no position, after the learned prefix
            prefix = torch.cat([prefix, x.new_zeros(1, 1, x.shape[-1])], dim=1)
        if prefix.shape[1]:
            x = torch.cat([prefix.expand(x.shape[0], -1, -1), x], dim=1)
        return self.norm_pre(x)

    def encode(self, images: torch.Tensor, *, layers: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Every token after the last block and the final norm: [B, 3, H, W] -> [B, N, D].

        Args:
            layers: when given, each block's output [B, N, D] is appended to it (before the final norm).
        """
        x = self.tokens(images)
        ropes = self.rotations(self.grid_for(images.shape[2], images.shape[3]))
        for block, rope in zip(self.blocks, ropes):
            x = block(x, rope)
            if layers is not None:
                layers.append(x)
            steps.step()
        return self.norm(x)

    def stream_after(self, images: torch.Tensor, layer: int) -> torch.Tensor:
        """The residual stream after block `layer` (0-based; no later block runs, no final norm):
        [B, 3, H, W] -> [B, N, D], what `encode`'s `layers[layer]` holds."""
        if not 0 <= layer < len(self.blocks):
            raise ValueError(f"layer {layer} is outside this model's blocks 0..{len(self.blocks) - 1}")
        x = self.tokens(images)
        ropes = self.rotations(self.grid_for(images.shape[2], images.shape[3]))
        for block, rope in zip(self.blocks[: layer + 1], ropes[: layer + 1]):
            x = block(x, rope)
            steps.step()
        return x

    def rotations(self, grid: tuple[int, int]) -> list[tuple[torch.Tensor, torch.Tensor] | Windowed | None]:
        """Each block's rotary (cos, sin) for the patches of `grid` (`Rotary`); None for each block of a
        model without rotary positions; for a block that attends within windows (`ViTConfig.attn_window`),
        a `Windowed` holding those and its window mask. Whoever runs the blocks one by one hands block i
        the i-th."""
        ropes = [None] * len(self.blocks) if self.rotary is None else self.rotary(grid)
        c = self.config
        if c.attn_window is None:
            return ropes
        mask = window_mask(grid, c.attn_window, device=self.patch_embed.proj.weight.device)
        return [rope if i in c.global_blocks else Windowed(rope, mask) for i, rope in enumerate(ropes)]

    def pool(self, tokens: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The encoded tokens [B, N, D] -> the head's input [B, D] (cls and distillation token for DeiT)."""
        c = self.config
        if c.pool == "avg":
            return self.fc_norm(tokens[:, c.num_prefix_tokens :].mean(dim=1))
        if c.pool == "map":
            return self.attn_pool(tokens)
        if c.distill_token:
            return tokens[:, 0], tokens[:, 1]
        return tokens[:, 0]

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """The pooled features, the input of the head: [B, 3, H, W] -> [B, D] (for DeiT, the
        mean of the cls and distillation tokens)."""
        pooled = self.pool(self.encode(images))
        return (pooled[0] + pooled[1]) / 2 if isinstance(pooled, tuple) else pooled

    def head_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The encoded tokens [B, N, D] -> logits [B, classes] (the pooled features for a model without a head)."""
        pooled = self.pool(tokens)
        if isinstance(pooled, tuple):
            if self.head_dist is None:
                return (pooled[0] + pooled[1]) / 2
            return (self.head(pooled[0]) + self.head_dist(pooled[1])) / 2
        return self.head(pooled)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes], or the pooled features [B, D] when the model has no head."""
        return self.head_logits(self.encode(images))


_use_model_class(ViT)  # `VariantSpec.build` makes one (vitviz.config cannot import this module)
