"""Video transformers as one `VideoViT`, built from a `VideoConfig`: TimeSformer's divided space-time
attention (Bertasius et al. 2021), VideoMAE (Tong et al. 2022), ViViT's joint space-time model
(Arnab et al. 2021, "model 1") and V-JEPA 2's encoder (Assran et al. 2025) with its attentive
classifier.

video [B, T, 3, H, W]
  -> tubelet embedding (Conv3d, kernel = stride = (τ, P, P))      [B, t*h*w, D],  t = T / τ, h = H / P, w = W / P
     tokens frame by frame, each frame's row by row: patch (t, y, x) is token p + t*h*w + y*w + x
  -> positions: a learned table ("learned", ViViT), a fixed sinusoidal one ("sinusoidal", VideoMAE),
     a space table plus a time table ("divided", TimeSformer), or none but rotary ("rope3d", V-JEPA 2)
  -> prepend the cls token (p = 1), where the model has one               [B, N, D],  N = p + t*h*w
  -> L pre-norm blocks:
       joint:   x + MSA(LN(x)), then x + MLP(LN(x)), attention over all N tokens
       divided: patches + W_t MSA_time(LN_t(patches)) over the t tokens of each position (y, x), the
                cls token left as it is; then x + MSA_space(LN(x)) over the cls token and the h*w
                patches of each frame, the cls token's t outputs averaged; then x + MLP(LN(x))
  -> final LayerNorm (none for VideoMAE's mean pooling)
  -> pooling: the cls token, token 0, the mean of the patches (+ fc_norm), or V-JEPA 2's attentive pooler
  -> linear head                                                          [B, classes]

Every attention is a `vitviz.model.Attention`, its softmax the module `attend`, so that
`vitviz.record_attention` records it: a joint model has L of them ([B, H, N, N] each); a divided
one 2L, each block's time attention ([B*h*w, H, t, t], rows position by position) before its space
attention ([B*t, H, 1 + h*w, 1 + h*w], rows frame by frame). `VideoViT.attention` gathers them into
a `VideoAttention`, which the space-time analyses (`vitviz.video.analysis`) read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from torch import nn

from vitviz import steps
from vitviz.analysis import fuse_heads
from vitviz.config import ModelRecord, Preprocessing
from vitviz.hooks import record_attention
from vitviz.model import Attention, _activation
from vitviz.imagetext import TextAttention

__all__ = [
    "VideoConfig",
    "VideoSpec",
    "VideoViT",
    "VideoAttention",
    "TubeletEmbedding",
    "Rotary3D",
    "JointBlock",
    "DividedBlock",
    "AttentivePooler",
    "sinusoid_table",
]

ATTENTIONS = ("joint", "divided")
POSITIONS = ("learned", "sinusoidal", "divided", "rope3d")
POOLS = ("cls", "first", "mean", "attentive")


@dataclass(frozen=True)
class VideoConfig:
    """The architecture of one video transformer.

    Attributes:
        frames: T, the frames of a clip the positions were trained for.
        tubelet: τ, the frames one token covers (1 for TimeSformer's per-frame patches).
        image_size: the side S of each square frame; patch_size: P.
        width, depth, heads, mlp_dim: D, L, H and the MLP hidden width.
        attention: "joint" (every token attends to every token) or "divided" (TimeSformer's: a time
            attention over each position's tokens, then a space attention within each frame; needs the
            cls token).
        class_token: a cls token first (p = 1), else p = 0.
        positions: "learned" (a table [1, p + t*h*w, D], the cls token's entry first), "sinusoidal"
            (VideoMAE's fixed table over the t*h*w patches, `sinusoid_table`), "divided" (a space table
            [1, p + h*w, D] and a time table [1, t, D]: patch (t, y, x) gets space[p + y*w + x] + time[t],
            the cls token space[0]) or "rope3d" (no table; V-JEPA 2's rotary angles over (t, y, x), `Rotary3D`).
        act: the MLP's activation ("gelu", "gelu_tanh", "quick_gelu", "silu").
        eps: every LayerNorm's epsilon but fc_norm's.
        qkv_bias: biases on the query, key and value projections.
        final_norm: a LayerNorm after the last block.
        pool: what the head reads: "cls" (the cls token), "first" (token 0 of a model without one: the
            first tubelet, as Hugging Face's VideoMAE without mean pooling reads it), "mean" (the mean
            of the patch tokens, then fc_norm if `fc_norm`) or "attentive" (V-JEPA 2's `AttentivePooler`).
        fc_norm: a LayerNorm after mean pooling, with epsilon `fc_norm_eps`.
        num_classes: outputs of the head; 0 for a model without one (the forward returns the pooled features).
        pool_layers, pool_mlp_dim: the attentive pooler's self-attention blocks and their MLP width.
    """

    frames: int = 16
    tubelet: int = 2
    image_size: int = 224
    patch_size: int = 16
    width: int = 768
    depth: int = 12
    heads: int = 12
    mlp_dim: int = 3072
    attention: Literal["joint", "divided"] = "joint"
    class_token: bool = False
    positions: Literal["learned", "sinusoidal", "divided", "rope3d"] = "learned"
    act: str = "gelu"
    eps: float = 1e-6
    qkv_bias: bool = True
    final_norm: bool = True
    pool: Literal["cls", "first", "mean", "attentive"] = "mean"
    fc_norm: bool = False
    fc_norm_eps: float = 1e-5
    num_classes: int = 0
    pool_layers: int = 0
    pool_mlp_dim: int = 0

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, not {self.attention!r}")
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {', '.join(POSITIONS)}, not {self.positions!r}")
        if self.pool not in POOLS:
            raise ValueError(f"pool must be one of {', '.join(POOLS)}, not {self.pool!r}")
        if self.frames < 1 or self.tubelet < 1 or self.frames % self.tubelet:
            raise ValueError(f"frames ({self.frames}) must be a positive multiple of the tubelet ({self.tubelet})")
        if self.patch_size < 1 or self.image_size % self.patch_size:
            raise ValueError(f"image_size ({self.image_size}) must be a multiple of patch_size ({self.patch_size})")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")
        if self.attention == "divided" and not self.class_token:
            raise ValueError("divided attention is TimeSformer's, with a cls token; set class_token=True")
        if self.pool == "cls" and not self.class_token:
            raise ValueError('pool "cls" needs the cls token; "first" reads token 0 of a model without one')
        if self.pool == "attentive" and self.pool_mlp_dim < 1:
            raise ValueError("the attentive pooler needs pool_mlp_dim, its MLP's width")
        if self.act not in ("gelu", "gelu_tanh", "quick_gelu", "silu"):
            raise ValueError(f"act must be gelu, gelu_tanh, quick_gelu or silu, not {self.act!r}")

    @property
    def grid(self) -> tuple[int, int, int]:
        """(t, h, w): the tokens of a clip along time, rows and columns."""
        side = self.image_size // self.patch_size
        return self.frames // self.tubelet, side, side

    @property
    def num_prefix_tokens(self) -> int:
        """p: 1 with a cls token, else 0."""
        return int(self.class_token)

    @property
    def num_tokens(self) -> int:
        """N = p + t*h*w at the trained clip."""
        t, h, w = self.grid
        return self.num_prefix_tokens + t * h * w

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


@dataclass(frozen=True)
class VideoSpec(ModelRecord):
    """One video model: its architecture, how each clip is sampled and each frame prepared, its class
    names and where its weights come from (the record `VariantSpec` is for a `ViT`).

    Attributes:
        name, source, weights, locator, description: as `VariantSpec`'s.
        config: the architecture.
        preprocessing: each frame's resize, crop, mean and std (on [0, 1] pixels).
        frames: the frames of one clip.
        sampling: "uniform" (`frames` indices spread evenly over the video: i * total // frames,
            transformers' `default_sample_indices_fn`) or "stride" (`frames` frames `frame_stride` apart,
            the clip centred in the video; the last frame repeated where the video is shorter).
        frame_stride: the stride of "stride" sampling; None for "uniform".
        categories: class names, index = logit; None for a model without a head.
        vlm: None (no video model is a vision–language model's tower; read as `VariantSpec.vlm` is).
    """

    vlm: ClassVar[None] = None
    name: str
    config: VideoConfig
    preprocessing: Preprocessing
    frames: int
    sampling: Literal["uniform", "stride"]
    categories: tuple[str, ...] | None = field(repr=False)
    source: str
    weights: str
    frame_stride: int | None = None
    locator: str = ""
    description: str = ""

    grid = property(lambda self: self.config.grid)  # (t, h, w); `ModelRecord` gives the rest

    def frame_indices(self, total: int) -> list[int]:
        """The indices of the frames of a video of `total` frames that make the model's clip (`sampling`)."""
        if total < 1:
            raise ValueError(f"a video has at least one frame, not {total}")
        if self.sampling == "uniform":
            return [i * total // self.frames for i in range(self.frames)]
        stride = self.frame_stride or 1
        span = (self.frames - 1) * stride + 1
        start = max(0, (total - span) // 2)
        return [min(start + i * stride, total - 1) for i in range(self.frames)]

    def at(self, image_size: int) -> "VideoSpec":
        """The same model at another frame size: only its own (video models here run at their trained size)."""
        if image_size != self.preprocessing.image_size:
            raise ValueError(f"{self.name} runs on frames of its trained size {self.preprocessing.image_size} px only")
        return self

    def whole(self) -> "VideoSpec":
        raise ValueError(f"{self.name} is a video model; its frames are cropped to its trained square, never fed whole")


@dataclass(frozen=True)
class VideoAttention:
    """One clip's attention (batch 1), layer by layer, every head kept (no fusion).

    Attributes:
        grid: (t, h, w); num_prefix_tokens: p.
        joint: a joint model's attention [L, H, N, N] over all tokens (p prefix, then (t, y, x) in order).
        time: a divided model's time attention [L, H, h*w, t, t]: at position s = y*w + x, row t' over the
            t tokens of that position (the cls token takes no part).
        space: a divided model's space attention [L, H, t, p + h*w, p + h*w]: in frame t, over the cls
            token (index 0) and that frame's patches (index p + y*w + x).
        pool: V-JEPA 2's attentive pooler: the query's attention over the N encoded tokens [H, N], after
            the pooler's own self-attention blocks; None for other models.
        logits: the output of the forward that recorded the attention [classes] (the pooled features [D]
            for a model without a head); None when it was not kept.
    """

    grid: tuple[int, int, int]
    num_prefix_tokens: int
    joint: torch.Tensor | None = None
    time: torch.Tensor | None = None
    space: torch.Tensor | None = None
    pool: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __post_init__(self) -> None:
        divided = self.time is not None and self.space is not None
        if (self.joint is not None) == divided or (self.time is None) != (self.space is None):
            raise ValueError("a VideoAttention holds either joint attention or both time and space attention")

    @property
    def kind(self) -> Literal["joint", "divided"]:
        return "joint" if self.joint is not None else "divided"

    @property
    def depth(self) -> int:
        return (self.joint if self.joint is not None else self.space).shape[0]

    @property
    def heads(self) -> int:
        return (self.joint if self.joint is not None else self.space).shape[1]

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid
        return self.num_prefix_tokens + t * h * w


def sinusoid_table(positions: int, width: int) -> torch.Tensor:
    """VideoMAE's fixed position table [1, positions, width] (Vaswani et al. 2017): channel j of position
    n is sin(n / 10000^(2⌊j/2⌋ / width)) for even j, cos(...) for odd j; computed in float64, returned
    in float32."""
    n = torch.arange(positions, dtype=torch.float64)[:, None]
    j = torch.arange(width, dtype=torch.float64)
    angles = n / torch.pow(torch.tensor(10000.0, dtype=torch.float64), 2 * torch.div(j, 2, rounding_mode="floor") / width)
    table = torch.where(j.long() % 2 == 0, angles.sin(), angles.cos())
    return table.float()[None]


class TubeletEmbedding(nn.Module):
    """Cuts a clip into tubelets of τ frames x P x P pixels and projects each to D dims with one strided
    Conv3d: [B, T, 3, H, W] -> [B, t*h*w, D], tokens frame by frame, row by row."""

    def __init__(self, *, tubelet: int, patch_size: int, width: int, in_channels: int = 3) -> None:
        super().__init__()
        self.tubelet, self.patch_size = tubelet, patch_size
        self.proj = nn.Conv3d(in_channels, width, kernel_size=(tubelet, patch_size, patch_size), stride=(tubelet, patch_size, patch_size))

    def forward(self, videos: torch.Tensor) -> torch.Tensor:
        x = self.proj(videos.transpose(1, 2).to(self.proj.weight.dtype))  # [B, D, t, h, w]
        return x.flatten(2).transpose(1, 2)


class Rotary3D(nn.Module):
    """V-JEPA 2's rotary positions over (t, y, x): a head's d channels in three segments of
    s = 2⌊⌊d/3⌋/2⌋ channels, turned by the token's tubelet index t, row y and column x (the rest left as
    they are). In a segment with position q and frequencies f_i = 10000^(−i / (s/2)), i < s/2:

        out_c = x_c cos(q f_(c mod s/2)) + x⊥_c sin(q f_(c mod s/2)),   x⊥ = each pair (x_2k, x_2k+1) -> (−x_2k+1, x_2k)

    Hugging Face's layout, in which the two channels of a pair take different frequencies (kept as it
    is, so the outputs are the same)."""

    def __init__(self, config: VideoConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.segment = 2 * ((self.head_dim // 3) // 2)
        self.register_buffer("anchor", torch.zeros(0), persistent=False)  # (follows the model's device)

    def forward(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [t*h*w, d], float32, for `vitviz.model.rotate` with interleaved pairs."""
        t, h, w = grid
        device = self.anchor.device
        ids = torch.arange(t * h * w, device=device)
        coords = (ids // (h * w), (ids % (h * w)) // w, ids % w)
        s, d = self.segment, self.head_dim
        cos, sin = [], []
        for q in coords:
            omega = torch.arange(s // 2, dtype=torch.float32, device=device)
            omega /= s / 2.0
            omega = 1.0 / 10000**omega
            freq = q[:, None] * omega  # [n, s/2]
            cos.append(freq.cos().repeat(1, 2))
            sin.append(freq.sin().repeat(1, 2))
        rest = d - 3 * s
        cos.append(torch.ones(t * h * w, rest, device=device))
        sin.append(torch.zeros(t * h * w, rest, device=device))
        return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


def _mlp(width: int, hidden: int, act: str) -> nn.Sequential:
    """Linear "0", activation "1", Linear "2" (the names of `vitviz.model`'s plain MLP)."""
    return nn.Sequential(OrderedDict({"0": nn.Linear(width, hidden), "1": _activation(act), "2": nn.Linear(hidden, width)}))


def _attention(c: VideoConfig, prefix: int) -> Attention:
    return Attention(width=c.width, heads=c.heads, qkv_bias=c.qkv_bias, eps=c.eps, prefix=prefix, rope_pairs="interleaved")


class JointBlock(nn.Module):
    """x + MSA(LN(x)), then x + MLP(LN(x)): attention over all N tokens of the clip (ViViT, VideoMAE,
    V-JEPA 2, TimeSformer's "joint_space_time")."""

    def __init__(self, config: VideoConfig) -> None:
        super().__init__()
        c = config
        self.norm1 = nn.LayerNorm(c.width, eps=c.eps)
        self.attn = _attention(c, c.num_prefix_tokens)
        self.norm2 = nn.LayerNorm(c.width, eps=c.eps)
        self.mlp = _mlp(c.width, c.mlp_dim, c.act)

    def forward(self, x: torch.Tensor, grid: tuple[int, int, int], rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class DividedBlock(nn.Module):
    """TimeSformer's block of divided space-time attention, on x [B, 1 + t*h*w, D] (cls, then the patches
    frame by frame):

        time:  patch (t, s) += W_t · MSA_time(LN_t(x))[t, s], the attention over the t tokens at position s;
               the cls token takes no part
        space: in each frame t, [cls, patches of t] -> MSA_space(LN(·)); each patch += its output, the
               cls token += the mean over frames of its t outputs
        MLP:   x += MLP(LN(x))

    `time_attn` (its `proj` Hugging Face's `temporal_attention.output.dense`) and `time_proj` (its
    `temporal_dense`) are kept apart, as trained. `time_attn` comes before `attn` among the block's
    modules, so recorders see each block's time attention, then its space attention."""

    def __init__(self, config: VideoConfig) -> None:
        super().__init__()
        c = config
        self.time_norm = nn.LayerNorm(c.width, eps=c.eps)
        self.time_attn = _attention(c, 0)
        self.time_proj = nn.Linear(c.width, c.width)
        self.norm1 = nn.LayerNorm(c.width, eps=c.eps)
        self.attn = _attention(c, 1)
        self.norm2 = nn.LayerNorm(c.width, eps=c.eps)
        self.mlp = _mlp(c.width, c.mlp_dim, c.act)

    def forward(self, x: torch.Tensor, grid: tuple[int, int, int], rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        b, _, d = x.shape
        t, h, w = grid
        s = h * w
        cls, patches = x[:, :1], x[:, 1:]
        by_position = patches.reshape(b, t, s, d).transpose(1, 2).reshape(b * s, t, d)  # [B*s, t, D]
        mixed = self.time_attn(self.time_norm(by_position)).reshape(b, s, t, d).transpose(1, 2).reshape(b, t * s, d)
        patches = patches + self.time_proj(mixed)
        frames = torch.cat([cls.expand(b, t, d).reshape(b * t, 1, d), patches.reshape(b * t, s, d)], dim=1)  # [B*t, 1 + s, D]
        out = self.attn(self.norm1(frames))
        cls = cls + out[:, :1].reshape(b, t, d).mean(dim=1, keepdim=True)
        patches = patches + out[:, 1:].reshape(b, t * s, d)
        x = torch.cat([cls, patches], dim=1)
        return x + self.mlp(self.norm2(x))


class _PoolerBlock(nn.Module):
    def __init__(self, c: VideoConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(c.width, eps=c.eps)
        self.attn = TextAttention(width=c.width, heads=c.heads)  # not `vitviz.model.Attention`: recorders of the encoder leave it out
        self.norm2 = nn.LayerNorm(c.width, eps=c.eps)
        self.mlp = _mlp(c.width, c.pool_mlp_dim, c.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _PoolerCross(nn.Module):
    """One learned query attending over the normalised tokens (no output projection), with the query as
    its residual, then an MLP with its own."""

    def __init__(self, c: VideoConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.scale = c.head_dim**-0.5
        self.norm1 = nn.LayerNorm(c.width, eps=c.eps)
        self.q = nn.Linear(c.width, c.width)
        self.kv = nn.Linear(c.width, 2 * c.width)
        self.attend = nn.Softmax(dim=-1)
        self.norm2 = nn.LayerNorm(c.width, eps=c.eps)
        self.mlp = _mlp(c.width, c.pool_mlp_dim, c.act)

    def forward(self, query: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        b, n, d = tokens.shape
        q = self.q(query).reshape(b, 1, self.heads, d // self.heads).transpose(1, 2)  # [B, H, 1, d]
        k, v = self.kv(self.norm1(tokens)).reshape(b, n, 2, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = self.attend((q @ k.transpose(-2, -1)) * self.scale)  # [B, H, 1, N]
        y = query + (attn @ v).transpose(1, 2).reshape(b, 1, d)
        return y + self.mlp(self.norm2(y))


class AttentivePooler(nn.Module):
    """V-JEPA 2's classifier pooling: `pool_layers` self-attention blocks over the encoded tokens, then one
    learned query attends over them (`cross.attend` its softmax, [B, H, 1, N]): [B, N, D] -> [B, D]."""

    def __init__(self, config: VideoConfig) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(1, 1, config.width))
        self.blocks = nn.ModuleList(_PoolerBlock(config) for _ in range(config.pool_layers))
        self.cross = _PoolerCross(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            tokens = block(tokens)
        return self.cross(self.query.expand(tokens.shape[0], -1, -1), tokens)[:, 0]


def pool_row(pooled: list[torch.Tensor]) -> torch.Tensor | None:
    """The first clip's attention probe row [H, N] of the last forward `VideoViT.recording_pool` saw, or None."""
    return pooled[-1][0, :, 0].float() if pooled else None


class VideoViT(nn.Module):
    """A video transformer, built from a `VideoConfig` (or its fields as keywords): videos [B, T, 3, H, W]
    -> logits [B, classes], or the pooled features [B, D] for a model without a head.

    `encode` gives every token after the last block (prefix, then (t, y, x) frame by frame);
    `attention` one clip's attention as a `VideoAttention`. `vitviz.video.video_from_transformers`
    converts Hugging Face's TimeSformer, VideoMAE, ViViT and V-JEPA 2 into this model.
    """

    def __init__(self, config: VideoConfig | None = None, **fields_) -> None:
        super().__init__()
        if config is None:
            config = VideoConfig(**fields_)
        elif fields_:
            raise TypeError("pass a VideoConfig or its fields, not both")
        self.config = c = config
        t, h, w = c.grid
        p = c.num_prefix_tokens
        self.patch_embed = TubeletEmbedding(tubelet=c.tubelet, patch_size=c.patch_size, width=c.width)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.width)) if c.class_token else None
        self.pos_embed = self.time_embed = self.rotary = None
        if c.positions == "learned":
            self.pos_embed = nn.Parameter(torch.empty(1, p + t * h * w, c.width).normal_(std=0.02))
        elif c.positions == "divided":
            self.pos_embed = nn.Parameter(torch.empty(1, p + h * w, c.width).normal_(std=0.02))
            self.time_embed = nn.Parameter(torch.empty(1, t, c.width).normal_(std=0.02))
        elif c.positions == "sinusoidal":
            self.register_buffer("pos_table", sinusoid_table(t * h * w, c.width), persistent=False)
        else:
            self.rotary = Rotary3D(c)
        block = DividedBlock if c.attention == "divided" else JointBlock
        self.blocks = nn.ModuleList(block(c) for _ in range(c.depth))
        self.norm = nn.LayerNorm(c.width, eps=c.eps) if c.final_norm else nn.Identity()
        self.fc_norm = nn.LayerNorm(c.width, eps=c.fc_norm_eps) if c.fc_norm else nn.Identity()
        self.attn_pool = AttentivePooler(c) if c.pool == "attentive" else None
        self.head = nn.Linear(c.width, c.num_classes) if c.num_classes else nn.Identity()
        self.spec: VideoSpec | None = None  # the record of where the model came from, attached by its loader

    image_size = property(lambda self: self.config.image_size)
    patch_size = property(lambda self: self.config.patch_size)
    width = property(lambda self: self.config.width)
    depth = property(lambda self: self.config.depth)
    heads = property(lambda self: self.config.heads)
    num_classes = property(lambda self: self.config.num_classes)
    grid = property(lambda self: self.config.grid)
    num_prefix_tokens = property(lambda self: self.config.num_prefix_tokens)

    def grid_for(self, videos: torch.Tensor) -> tuple[int, int, int]:
        """The token grid (t, h, w) of `videos` [B, T, 3, H, W]: frames of the trained size only; T the
        trained frames, or for rotary positions any multiple of τ (or fewer than τ frames, repeated to τ)."""
        c = self.config
        if videos.ndim != 5 or videos.shape[2] != 3:
            raise ValueError(f"expected videos of shape [B, {c.frames}, 3, {c.image_size}, {c.image_size}], got {list(videos.shape)}")
        frames, height, width = videos.shape[1], videos.shape[3], videos.shape[4]
        if (height, width) != (c.image_size, c.image_size):
            raise ValueError(f"this model's frames are {c.image_size}x{c.image_size} px; the video's are {height}x{width}")
        if c.positions == "rope3d":
            if frames >= c.tubelet and frames % c.tubelet:
                raise ValueError(f"the video has {frames} frames; this model takes a multiple of its tubelet of {c.tubelet}")
            return max(frames // c.tubelet, 1), *c.grid[1:]
        if frames != c.frames:
            raise ValueError(f"this model's positions are learned for {c.frames} frames; the video has {frames}")
        return c.grid

    def tokens(self, videos: torch.Tensor) -> torch.Tensor:
        """The prefix and patch tokens with their positions: [B, T, 3, H, W] -> [B, N, D]."""
        c = self.config
        self.grid_for(videos)
        if videos.shape[1] < c.tubelet:  # V-JEPA 2's: a clip shorter than a tubelet (an image) repeated to one
            videos = videos.repeat(1, c.tubelet, 1, 1, 1)
        x = self.patch_embed(videos)
        b, d = x.shape[0], x.shape[-1]
        t, hw = x.shape[1] // (c.grid[1] * c.grid[2]), c.grid[1] * c.grid[2]
        prefix = self.cls_token.expand(b, -1, -1) if self.cls_token is not None else x.new_zeros(b, 0, d)
        if c.positions == "learned":
            x = torch.cat([prefix, x], dim=1) + self.pos_embed
            return x
        if c.positions == "divided":
            p = c.num_prefix_tokens
            space, time = self.pos_embed[:, p:], self.time_embed
            x = (x.reshape(b, t, hw, d) + space[:, None] + time[:, :, None]).reshape(b, t * hw, d)
            prefix = prefix + self.pos_embed[:, :p]
        elif c.positions == "sinusoidal":
            x = x + self.pos_table.to(x.dtype)
        return torch.cat([prefix, x], dim=1)

    def encode(self, videos: torch.Tensor, *, layers: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Every token after the last block and the final norm: [B, T, 3, H, W] -> [B, N, D].

        Args:
            layers: when given, each block's output [B, N, D] is appended to it (before the final norm).
        """
        grid = self.grid_for(videos)
        x = self.tokens(videos)
        rope = self.rotary(grid) if self.rotary is not None else None
        for block in self.blocks:
            x = block(x, grid, rope)
            if layers is not None:
                layers.append(x)
            steps.step()
        return self.norm(x)

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        """The encoded tokens [B, N, D] -> the head's input [B, D] (`VideoConfig.pool`)."""
        c = self.config
        if c.pool == "mean":
            return self.fc_norm(tokens[:, c.num_prefix_tokens :].mean(dim=1))
        if c.pool == "attentive":
            return self.attn_pool(tokens)
        return tokens[:, 0]

    def forward_features(self, videos: torch.Tensor) -> torch.Tensor:
        """The pooled features, the head's input: [B, T, 3, H, W] -> [B, D]."""
        return self.pool(self.encode(videos))

    def head_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The encoded tokens [B, N, D] -> logits [B, classes] (the pooled features without a head)."""
        return self.head(self.pool(tokens))

    def forward(self, videos: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes], or the pooled features [B, D] when the model has no head."""
        return self.head_logits(self.encode(videos))

    def attention(self, videos: torch.Tensor, *, head_fusion: str | None = None) -> VideoAttention:
        """One clip's attention, every layer and head (`VideoAttention`), and that forward's output
        (`VideoAttention.logits`), from one forward without gradients.

        Args:
            videos: [1, T, 3, H, W] or [T, 3, H, W].
            head_fusion: None: every head; "mean", "max" or "min": each layer's heads fused as soon as
                it is computed (`vitviz.analysis.fuse_heads`), kept as one head (H = 1): 1/H of the
                memory, for what reads the heads fused (the rollout, the Video tab).
        """
        if videos.ndim == 4:
            videos = videos[None]
        if videos.ndim != 5 or videos.shape[0] != 1:
            raise ValueError(f"attention reads one clip, [1, T, 3, H, W] or [T, 3, H, W]; got {list(videos.shape)}")
        grid = self.grid_for(videos)
        reduce = None if head_fusion is None else (lambda a: fuse_heads(a, head_fusion, dim=1).unsqueeze(1))
        with self.recording_pool() as pooled, torch.no_grad(), record_attention(self, reduce=reduce) as rec:
            out = self(videos)[0]
        return self.attention_of(rec.layers, grid, pool=pool_row(pooled), logits=out)

    @contextmanager
    def recording_pool(self) -> Iterator[list[torch.Tensor]]:
        """The attention probe's attention [B, H, 1, N] of each forward this thread runs in the block
        (`pool_row` reads the last; another thread's forwards of the same model are not seen); nothing
        for a model without one."""
        pooled: list[torch.Tensor] = []
        handle = None
        owner = threading.get_ident()

        def keep(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if threading.get_ident() == owner:
                pooled.append(out.detach())

        if self.attn_pool is not None:
            handle = self.attn_pool.cross.attend.register_forward_hook(keep)
        try:
            yield pooled
        finally:
            if handle is not None:
                handle.remove()

    def attention_of(self, layers: list[torch.Tensor], grid: tuple[int, int, int], *, pool: torch.Tensor | None = None,
                     logits: torch.Tensor | None = None) -> VideoAttention:
        """One clip's `VideoAttention` from each attention the model ran, as `record_attention` lists them
        (a joint model's [1, H, N, N] per layer; a divided one's time [h*w, H, t, t] and space [t, H, N_f, N_f]
        of each block), with its attention pool's row and its output."""
        p = self.config.num_prefix_tokens
        if self.config.attention == "joint":
            return VideoAttention(grid, p, joint=torch.stack([a[0] for a in layers]).float(), pool=pool, logits=logits)
        t, h, w = grid
        time = torch.stack([a.reshape(h * w, -1, t, t).transpose(0, 1) for a in layers[0::2]]).float()  # [L, H, s, t, t]
        space = torch.stack([a.reshape(t, -1, p + h * w, p + h * w).transpose(0, 1) for a in layers[1::2]]).float()
        return VideoAttention(grid, p, time=time, space=space, pool=pool, logits=logits)
