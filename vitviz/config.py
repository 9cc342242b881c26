"""The records every part of vitviz reads, and nothing else: a model's architecture (`ViTConfig`;
`TextConfig` for the text tower of an image–text model), how its images are prepared
(`Preprocessing`) and one named variant (`VariantSpec`: both, its class names and where its weights
come from).

This module is the leaf of vitviz: it imports no other module of vitviz, nor torch; the model,
the preprocessing and the weights sources stand on it (`vitviz.model.ViTConfig`,
`vitviz.preprocess.Preprocessing` and `vitviz.sources.VariantSpec` are these same classes).
`VariantSpec.build` makes a model all the same: `vitviz.model` hands its `ViT` class over when it
is imported (`import vitviz` imports it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Literal

__all__ = [
    "ViTConfig",
    "TextConfig",
    "Preprocessing",
    "VariantSpec",
    "ModelRecord",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "INTERPOLATIONS",
    "split_size",
    "fit_size",
    "ImageError",
    "check_size",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# torchvision's `InterpolationMode` values, by which `vitviz.preprocess` resizes (a test holds them equal)
INTERPOLATIONS = ("nearest", "nearest-exact", "bilinear", "bicubic", "box", "hamming", "lanczos")


@dataclass(frozen=True)
class ViTConfig:
    """The architecture of one ViT.

    Attributes:
        image_size: the side S the position embeddings were trained for (any multiple of P runs).
        patch_size: P.
        width, depth, heads, mlp_dim: D, L, H and the MLP hidden width.
        num_classes: outputs of the head; 0 for a model without one (DINO, CLIP towers): the
            forward then returns the pooled features.
        class_token: a cls token first.
        distill_token: DeiT's distillation token after the cls token, with a head of its own; in eval
            the logits are the mean of the two heads'.
        register_tokens: DINOv2's registers after those (Darcet et al. 2024).
        pos_embed_prefix: how many of the leading prefix tokens carry a position embedding (all of
            them in the original ViT and DeiT, the cls token only in Hugging Face's DINOv2 with
            registers, none in DeiT III's layout); the patches always do.
        layer_scale: initial LayerScale value (a learned per-channel scale on each residual
            branch), or None for none.
        qkv_bias, proj_bias, mlp_bias, patch_bias: whether those projections have biases.
        qk_norm: each head's queries and keys through a LayerNorm of their own (over the head's
            d = D / H channels, with `eps`) before q·kᵀ (Dehghani et al. 2023; timm's `qk_norm=True`).
        norm_pre: a LayerNorm before the first block (CLIP).
        final_norm: a LayerNorm after the last block.
        pool: "token" (the cls token), "avg" (the mean of the patch tokens) or "map" (multi-head
            attention pooling: one learned query, the probe, attends over every token, then an MLP
            with its own residual; SigLIP's head, Zhai et al. 2023).
        pool_prefix: with "map", the probe attends to the prefix tokens too (SigLIP has none; timm's
            attention pool leaves them out by default, `pool_include_prefix=False`: their share of the
            probe's attention is then 0).
        pool_head: with "map", the pool's kind: "mlp" (SigLIP's: the probe through a query
            projection, then a LayerNorm and an MLP with their residual) or "plain" (AIMv2's: the probe
            is the query itself, key and value projections with `qkv_bias`, an output projection,
            nothing after).
        pool_mlp_dim: with "map" and an "mlp" pool, its MLP's width (None: `mlp_dim`; PE-core G's is
            6144 beside blocks of 8960).
        pool_heads: with "map", the probe's heads (None: `heads`; Perception Encoder's pool has 8
            over blocks of 12 or 16).
        fc_norm: with "avg", a LayerNorm after pooling instead of the final norm (timm's layout).
        act: the MLP's activation: "gelu", "gelu_tanh", "quick_gelu" (x sigmoid(1.702 x), CLIP) or
            "silu" (x sigmoid(x), SwiGLU's).
        mlp: "plain" (Linear, act, Linear) or "gated": act(x W_g) ⊙ (x W_v), then W_2 (SwiGLU with
            "silu", Shazeer 2020; DINOv2-g, EVA-02); `mlp_dim` is the width after the gate (the input
            projection has twice as many outputs: the gate's, then the value's).
        attn_norm: a LayerNorm over the heads' concatenated outputs before the attention's output
            projection (EVA-02 CLIP's and BEiT-3's "scale_attn_inner"/"scale_norm"; NormFormer's).
        mlp_norm: a LayerNorm inside the MLP, after the activation (after the gating in a gated MLP),
            before the output projection (EVA-02's "scale_mlp", NormFormer's).
        abs_pos_embed: a learned position embedding is added to the tokens (False: positions come from
            the rotary embedding alone, as in DINOv3 and timm's vit_*_rope_* models).
        rope: rotary position embeddings (Su et al. 2021) in 2D, applied to each head's queries and
            keys of the patches (never the prefix tokens'), after the q/k norms: the pair of channels
            (a_j, b_j) is rotated by the angle θ_j = y·f_y,j + x·f_x,j of the patch at (y, x). None, or:
            "axial": y, x are the patch's row and column (+ `rope_offset`), rescaled to `rope_ref_grid`
            when given; d/4 frequencies f_k = T^(-k/(d/4)) (T = `rope_temperature`, d the head's
            width), one half of the pairs turned by y, the other by x (timm's EVA-02, Perception
            Encoder and vit_*_rope_* models). "dinov3": y, x are the patch centres mapped to [-1, 1]
            on each axis ((i + 0.5 + offset) / n · 2 − 1); frequencies 2π / T^(k/(d/4)) (DINOv3,
            T = 100). "mixed": learned frequencies of their own per layer and head, each pair turned by
            both y and x (RoPE-Mixed, Heo et al. 2024; the model's parameter `rotary.freqs`).
        rel_pos_bias: each block adds a learned bias to its attention logits, one per head for every
            offset between a query patch and a key patch at the trained grid, and one each for a cls
            token attending to a patch, a patch to the cls token, and the cls token to itself (BEiT,
            Bao et al. 2022; timm's vit_relpos_*, whose small MLP of the offsets is read into such a
            table). Learned for the trained grid only: other image sizes are refused.
        rope_temperature, rope_offset, rope_ref_grid: T, the offset added to the coordinates, and the
            grid (gh, gw) the "axial" coordinates are rescaled to (EVA's rule for other sizes).
        rope_axes: "yx": the first half of the pairs turns with the row, the second with the column;
            "xy": the other way round.
        rope_pairs: which channels are turned together: "interleaved" (0 with 1, 2 with 3, ...) or
            "half" (j with j + d/2).
        parallel: each block runs its attention and its MLP side by side on one normalised input,
            x + LS(MSA(LN(x))) + LS(MLP(LN(x))) (Dehghani et al. 2023's ViT-22B; timm's vit_*_xp_*).
        post_norm: each block normalises its branches' outputs before adding them to the stream,
            x + LS(LN(MSA(x))), then x + LS(LN(MLP(x))) ("res-post-norm": timm's vit_*_rpn_*, EVA-02-E),
            instead of normalising their inputs.
        norm: the kind of every norm: "layernorm" or "rmsnorm" (x / sqrt(mean(x²) + eps) · γ, no
            centring and no shift; AIMv2's).
        patch_norm: a norm of each patch's embedding, before the position embeddings (AIMv2).
        stem: a convolutional stem before the patch embedding (the ViT paper's hybrids, Dosovitskiy et
            al. 2021, section 3.1): the image goes through a CNN, and its feature map, cut into patches
            of P / `stem_stride` cells by the patch embedding's Conv2d, makes the tokens; `patch_size`
            stays the pixels one token covers (the stem's stride times the embedding's own patch).
            None: the patch embedding reads the pixels. "bit": a ResNet v1.5 with GroupNorm and
            weight-standardised convolutions padded as TensorFlow's "SAME" (Kolesnikov et al. 2020's
            BiT; a 7x7 root, max-pooled, then `stem_depths` stages of bottlenecks: R50+ViT-B/16's are
            (3, 4, 9)). "resnet_d": a ResNet with BatchNorm, three 3x3 convolutions as its root and
            average-pooled shortcuts (He et al. 2019's ResNet-C and -D tweaks). "conv": convolutions
            whose kernel is their stride (`stem_strides`, with `stem_widths` channels), each followed
            by BatchNorm and GELU (MobileCLIP's, Vasu et al. 2024).
        stem_depths: the bottlenecks of each stage of a "bit" or "resnet_d" stem (the stages give 256,
            512, 1024, 2048 channels; the first keeps the root's stride 4, each next one halves the
            map); () for the root alone (R+ViT-Ti's).
        stem_widths, stem_strides: a "conv" stem's channels and kernel (= stride), layer by layer.
        eps: the norms' epsilon.
        pos_embed_antialias: resample position embeddings for another grid with antialiasing (timm
            does; Hugging Face does not, which matters when shrinking the grid).
        pos_embed_interpolation: how the table is resampled for another grid: "bicubic" (timm, most
            of Hugging Face) or "bilinear" (SigLIP 2 in Hugging Face).
        pos_embed_square: resample the table to the square of the grid's longer side, then keep its
            top-left gh x gw (timm's NaFlex `pos_embed_ar_preserving`: a patch's embedding depends on
            where it is, not on the image's aspect ratio); False: resample to gh x gw.
        pos_embed_align_corners: resample with the tables' corner entries on the grid's corner patches
            (F.interpolate's align_corners; timm's RADIO v3 B and H); False: on the grid's corners.
        register_neurons: a test-time register (Jiang et al. 2025, "Vision Transformers Don't Need
            Trained Registers"): one more prefix token "ttr", after the learned ones, that starts at
            zero with no position embedding; in block l, the MLP's hidden activations of the neurons
            (l, j) listed here are moved into it: the register takes each such neuron's maximum over
            all tokens, every other token gets 0 (`vitviz.registers.with_test_time_register`).
        register_keep_prefix: the learned prefix tokens (cls, ...) keep their own activations at
            those neurons instead of 0 (the authors' analysis hook; their released DINOv2 wrapper
            zeroes them, the default).
        attn_window: the blocks attend within windows of this many patches a side (Qwen2.5-VL's
            vision tower: 8, its 112 px), cut from the grid's top-left corner (the windows of the last
            rows and columns smaller where the grid is not a whole number of windows): a patch attends
            only to the patches of its own window, in every block but those of `global_blocks`. None:
            every block attends over the whole image. The attention a windowed block records stays
            N x N, 0 outside each query's window. Takes no prefix tokens.
        global_blocks: with `attn_window`, the 0-based blocks that attend over the whole image
            (Qwen2.5-VL's `fullatt_block_indexes`).
    """

    attention: ClassVar[str] = "global"  # how its tokens attend (`vitviz.layout.TokenLayout.attention`): one N x N matrix a layer

    image_size: int
    patch_size: int
    width: int
    depth: int
    heads: int
    mlp_dim: int
    num_classes: int = 1000
    class_token: bool = True
    distill_token: bool = False
    register_tokens: int = 0
    pos_embed_prefix: int | None = None
    layer_scale: float | None = None
    qkv_bias: bool = True
    proj_bias: bool = True
    mlp_bias: bool = True
    patch_bias: bool = True
    qk_norm: bool = False
    norm_pre: bool = False
    final_norm: bool = True
    pool: Literal["token", "avg", "map"] = "token"
    pool_prefix: bool = True
    pool_heads: int | None = None
    pool_head: Literal["mlp", "plain"] = "mlp"
    pool_mlp_dim: int | None = None
    fc_norm: bool = False
    act: Literal["gelu", "gelu_tanh", "quick_gelu", "silu"] = "gelu"
    mlp: Literal["plain", "gated"] = "plain"
    mlp_norm: bool = False
    attn_norm: bool = False
    abs_pos_embed: bool = True
    rel_pos_bias: bool = False
    rope: Literal["axial", "dinov3", "mixed"] | None = None
    rope_temperature: float = 10000.0
    rope_offset: float = 0.0
    rope_ref_grid: tuple[int, int] | None = None
    rope_axes: Literal["yx", "xy"] = "yx"
    rope_pairs: Literal["interleaved", "half"] = "interleaved"
    parallel: bool = False
    post_norm: bool = False
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    patch_norm: bool = False
    stem: Literal["bit", "resnet_d", "conv"] | None = None
    stem_depths: tuple[int, ...] = ()
    stem_widths: tuple[int, ...] = ()
    stem_strides: tuple[int, ...] = ()
    eps: float = 1e-6
    pos_embed_antialias: bool = True
    pos_embed_interpolation: Literal["bicubic", "bilinear"] = "bicubic"
    pos_embed_square: bool = False
    pos_embed_align_corners: bool = False
    register_neurons: tuple[tuple[int, int], ...] = ()
    register_keep_prefix: bool = False
    attn_window: int | None = None
    global_blocks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")
        self._check_stem()
        if self.distill_token and not self.class_token:
            raise ValueError("a distillation token needs a cls token before it")
        if self.pool == "token" and not self.class_token:
            raise ValueError('pool="token" needs a cls token; use pool="avg"')
        if self.pool not in ("token", "avg", "map"):
            raise ValueError(f'pool must be "token", "avg" or "map", got {self.pool!r}')
        if not self.pool_prefix and self.pool != "map":
            raise ValueError('pool_prefix=False is for attention pooling (pool="map")')
        if self.pool_head not in ("mlp", "plain"):
            raise ValueError(f'pool_head must be "mlp" or "plain", got {self.pool_head!r}')
        if self.pool_heads is not None and (self.pool != "map" or self.width % self.pool_heads):
            raise ValueError(f'pool_heads is for attention pooling (pool="map") and must divide width {self.width}')
        if self.fc_norm and self.pool != "avg":
            raise ValueError('fc_norm is the norm after "avg" pooling')
        if self.act not in ("gelu", "gelu_tanh", "quick_gelu", "silu"):
            raise ValueError(f'act must be "gelu", "gelu_tanh", "quick_gelu" or "silu", got {self.act!r}')
        if self.mlp not in ("plain", "gated"):
            raise ValueError(f'mlp must be "plain" or "gated", got {self.mlp!r}')
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f'norm must be "layernorm" or "rmsnorm", got {self.norm!r}')
        if self.rope not in (None, "axial", "dinov3", "mixed"):
            raise ValueError(f'rope must be None, "axial", "dinov3" or "mixed", got {self.rope!r}')
        if self.rope is not None:
            if (self.width // self.heads) % 4:
                raise ValueError(f"rotary positions need a head width divisible by 4, got {self.width // self.heads}")
            if self.rope_axes not in ("yx", "xy") or self.rope_pairs not in ("interleaved", "half"):
                raise ValueError(f'rope_axes must be "yx" or "xy" and rope_pairs "interleaved" or "half", got '
                                 f"{self.rope_axes!r}, {self.rope_pairs!r}")
            if self.rope == "mixed" and self.rope_pairs != "interleaved":
                raise ValueError('rope="mixed" turns interleaved pairs')
            if self.rope_ref_grid is not None:
                object.__setattr__(self, "rope_ref_grid", tuple(int(g) for g in self.rope_ref_grid))
        if self.parallel and self.post_norm:
            raise ValueError("a block is parallel or res-post-norm, not both")
        if self.pos_embed_interpolation not in ("bicubic", "bilinear"):
            raise ValueError(f'pos_embed_interpolation must be "bicubic" or "bilinear", got {self.pos_embed_interpolation!r}')
        self._check_register_neurons()
        self._check_windows()
        if self.rel_pos_bias and self.num_prefix_tokens > 1:
            raise ValueError("a relative position bias (BEiT's) takes one prefix token at most, the cls token")
        if self.pos_embed_prefix is None:
            object.__setattr__(self, "pos_embed_prefix", self.trained_prefix_tokens if self.abs_pos_embed else 0)
        if not self.abs_pos_embed and self.pos_embed_prefix:
            raise ValueError("pos_embed_prefix must be 0 without a learned position embedding (abs_pos_embed=False)")
        if not 0 <= self.pos_embed_prefix <= self.num_prefix_tokens:
            raise ValueError(f"pos_embed_prefix {self.pos_embed_prefix} is not within 0..{self.num_prefix_tokens}")

    def _check_register_neurons(self) -> None:
        """The test-time register's neurons as sorted, distinct (layer, neuron) pairs of ints (JSON gives lists), each in range."""
        pairs = sorted({(int(layer), int(neuron)) for layer, neuron in self.register_neurons})
        object.__setattr__(self, "register_neurons", tuple(pairs))
        for layer, neuron in pairs:
            if not (0 <= layer < self.depth and 0 <= neuron < self.mlp_dim):
                raise ValueError(f"register neuron ({layer}, {neuron}) is outside this model's {self.depth} layers x {self.mlp_dim} "
                                 "MLP neurons")
        if self.register_keep_prefix and not pairs:
            raise ValueError("register_keep_prefix is an option of a test-time register (register_neurons)")

    def _check_windows(self) -> None:
        """`attn_window` a side of at least one patch, without prefix tokens; `global_blocks` sorted,
        distinct blocks of this model (JSON gives lists), and only with windows."""
        object.__setattr__(self, "global_blocks", tuple(sorted({int(i) for i in self.global_blocks})))
        if self.attn_window is None:
            if self.global_blocks:
                raise ValueError("global_blocks names the blocks that attend globally among windowed ones (attn_window)")
            return
        if isinstance(self.attn_window, bool) or int(self.attn_window) != self.attn_window or self.attn_window < 1:
            raise ValueError(f"attn_window is a window's side in patches, a whole number above 0, got {self.attn_window!r}")
        object.__setattr__(self, "attn_window", int(self.attn_window))
        if self.num_prefix_tokens:
            raise ValueError(f"windowed attention (attn_window) takes no prefix tokens, got {', '.join(self.prefix_names)}")
        if any(not 0 <= i < self.depth for i in self.global_blocks):
            raise ValueError(f"global_blocks {self.global_blocks} are not all within this model's blocks 0..{self.depth - 1}")

    def _check_stem(self) -> None:
        """The stem's fields (lists, as JSON gives them, become tuples), checked against its kind."""
        for name in ("stem_depths", "stem_widths", "stem_strides"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        kind, depths, widths, strides = self.stem, self.stem_depths, self.stem_widths, self.stem_strides
        if kind not in (None, "bit", "resnet_d", "conv"):
            raise ValueError(f'stem must be None, "bit", "resnet_d" or "conv", got {kind!r}')
        if kind in (None, "bit", "resnet_d") and (widths or strides):
            raise ValueError('stem_widths and stem_strides describe a "conv" stem')
        if kind in (None, "conv") and depths:
            raise ValueError('stem_depths describes a "bit" or "resnet_d" stem')
        if kind in ("bit", "resnet_d") and (len(depths) > 4 or min(depths, default=1) < 1):
            raise ValueError(f"stem_depths gives 0 to 4 stages of at least one bottleneck each, got {depths}")
        if kind == "conv" and (not widths or len(widths) != len(strides) or min(widths + strides) < 1):
            raise ValueError(f"a conv stem has one width and one stride per layer, got {widths} and {strides}")
        if self.patch_size % self.stem_stride:
            raise ValueError(f"patch_size {self.patch_size} is not a multiple of the stem's stride {self.stem_stride}")

    @property
    def stem_stride(self) -> int:
        """The pixels one cell of the stem's feature map spans along each axis (1 without a stem)."""
        if self.stem == "conv":
            return math.prod(self.stem_strides)
        if self.stem is None:
            return 1
        return 4 * 2 ** max(len(self.stem_depths) - 1, 0)

    @property
    def stem_channels(self) -> int:
        """The channels the patch embedding reads: 3 (RGB) without a stem, else the stem's last."""
        if self.stem == "conv":
            return self.stem_widths[-1]
        if self.stem is None:
            return 3
        return 256 * 2 ** (len(self.stem_depths) - 1) if self.stem_depths else 64

    @property
    def embed_patch_size(self) -> int:
        """The patch embedding's kernel and stride over the stem's feature map (P without a stem)."""
        return self.patch_size // self.stem_stride

    @property
    def stem_params(self) -> int:
        """Parameters of the stem, counted from the config alone (a norm's running statistics are
        buffers, not parameters)."""
        if self.stem is None:
            return 0
        if self.stem == "conv":
            chans = (3,) + self.stem_widths
            return sum(i * o * k * k + 2 * o for i, o, k in zip(chans, chans[1:], self.stem_strides))
        if self.stem == "bit":  # 7x7 convolution and its norm
            total = 3 * 64 * 49 + 2 * 64
        else:  # three 3x3 convolutions, 32, 32 and 64 channels, and their norms
            total = 9 * (3 * 32 + 32 * 32 + 32 * 64) + 2 * (32 + 32 + 64)
        c = 64
        for i, blocks in enumerate(self.stem_depths):
            out = 256 * 2**i
            mid = out // 4
            for j in range(blocks):
                into = c if j == 0 else out
                total += into * mid + 9 * mid * mid + mid * out + 2 * (2 * mid + out)
                if j == 0:  # the projected shortcut and its norm
                    total += into * out + 2 * out
            c = out
        return total

    @property
    def trained_prefix_tokens(self) -> int:
        """The prefix tokens the model learned: cls, distillation token, registers."""
        return int(self.class_token) + int(self.distill_token) + self.register_tokens

    @property
    def num_prefix_tokens(self) -> int:
        """p: the tokens before the patches (the learned ones, then the test-time register if any)."""
        return self.trained_prefix_tokens + int(bool(self.register_neurons))

    @property
    def prefix_names(self) -> tuple[str, ...]:
        """The prefix tokens in order: "cls", "dist", "reg1", "reg2", ..., then "ttr" (a test-time register)."""
        return (("cls",) if self.class_token else ()) + (("dist",) if self.distill_token else ()) + tuple(
            f"reg{i + 1}" for i in range(self.register_tokens)
        ) + (("ttr",) if self.register_neurons else ())

    @property
    def pooled_query(self) -> bool:
        """The classifier reads the tokens through a pooling and there is no cls token: its query is
        "pool", whose row of any token-by-token map is the mean of the patch tokens' rows ("avg"), or
        the rows weighted by the probe's attention ("map")."""
        return self.pool in ("avg", "map") and not self.class_token

    @property
    def query_names(self) -> tuple[str, ...]:
        """The queries a map can be read from besides the patches: the prefix tokens, then "pool" for
        a model whose classifier reads the mean of its patch tokens and has no cls token."""
        return self.prefix_names + (("pool",) if self.pooled_query else ())

    @property
    def grid(self) -> tuple[int, int]:
        side = self.image_size // self.patch_size
        return side, side

    @property
    def num_tokens(self) -> int:
        return self.tokens_of(self.grid[0] * self.grid[1])

    def tokens_of(self, patches: int) -> int:
        """The tokens the blocks see for an image cut into `patches` patches: the prefix tokens and a
        token a patch. Every price reads it (through `VariantSpec.num_tokens`), before any model is
        built: a family whose model sees other tokens (two frames of each image, a second view) says
        how many by overriding it in its config's class."""
        return self.num_prefix_tokens + patches

    @property
    def num_params(self) -> int:
        """Parameters of a ViT of this config, counted from the config alone (no memory, no weights;
        a test holds it to the count of a built `vitviz.ViT`)."""
        d, m, c = self.width, self.mlp_dim, self.num_classes
        per = 2 if self.norm == "layernorm" else 1  # a LayerNorm's weight and bias; an RMSNorm's weight
        norm = per * d
        patch = (self.stem_params + self.stem_channels * self.embed_patch_size**2 * d + (d if self.patch_bias else 0)
                 + (norm if self.patch_norm else 0))
        tokens = d * self.trained_prefix_tokens + (d * (self.pos_embed_prefix + self.grid[0] * self.grid[1]) if self.abs_pos_embed else 0)
        block = (
            (1 if self.parallel else 2) * norm
            + 3 * d * d + (3 * d if self.qkv_bias else 0)
            + d * d + (d if self.proj_bias else 0)
            + (3 if self.mlp == "gated" else 2) * d * m + (((2 if self.mlp == "gated" else 1) * m + d) if self.mlp_bias else 0)
            + (2 * d if self.layer_scale is not None else 0)
            + (2 * per * (d // self.heads) if self.qk_norm else 0)
            + (per * m if self.mlp_norm else 0)
            + (norm if self.attn_norm else 0)
            + (d if self.rope == "mixed" else 0)  # learned frequencies: 2 axes x H x (D/H)/2
            + (((2 * self.grid[0] - 1) * (2 * self.grid[1] - 1) + 3) * self.heads if self.rel_pos_bias else 0)
        )
        norms = norm * (int(self.norm_pre) + int(self.final_norm and not self.fc_norm) + int(self.fc_norm))
        heads = (d * c + c) * (1 + int(self.distill_token)) if c else 0
        # the probe, q, k, v and out projections with biases, a norm, an MLP with biases
        if self.pool_head == "plain":  # the probe, biased or not k and v, a biased output projection
            map_head = d + 2 * d * d + (2 * d if self.qkv_bias else 0) + d * d + d if self.pool == "map" else 0
        else:
            pm = self.pool_mlp_dim or m
            map_head = d + 4 * (d * d + d) + norm + 2 * d * pm + pm + d if self.pool == "map" else 0
        return patch + tokens + self.depth * block + norms + heads + map_head

    def replace(self, **changes: Any) -> "ViTConfig":
        """A copy with some fields changed (pos_embed_prefix recomputed unless given)."""
        if "pos_embed_prefix" not in changes and self.pos_embed_prefix == (self.trained_prefix_tokens if self.abs_pos_embed else 0):
            changes["pos_embed_prefix"] = None
        return replace(self, **changes)


@dataclass(frozen=True)
class TextConfig:
    """The architecture of the text tower of an image–text model (CLIP, SigLIP; `vitviz.imagetext`).

    Tokens [T, C] -> token and position embeddings -> L pre-norm blocks -> final LayerNorm -> one
    token per text (`pool`) -> a linear projection to the shared embedding [T, E].

    Attributes:
        vocab_size: rows of the token embedding.
        context_length: C, the most tokens a text may have (rows of the position embedding).
        width, depth, heads, mlp_dim: D, L, H and the MLP hidden width.
        embed_dim: E, the width of the shared image–text embedding (the projection's outputs).
        causal: each token attends to itself and the tokens before it only (CLIP); False lets every
            token attend to every other (SigLIP). Padding (an attention mask's zeros) is never attended to.
        pool: which token stands for the text: "eos" (CLIP: the end-of-text token, see
            `eos_token_id`) or "last" (SigLIP: the last position, padding or not).
        eos_token_id: with "eos", the text is read at the first position holding this id; None reads
            it at the position of the highest id (the end-of-text token has the highest id of the
            original CLIP vocabulary; Hugging Face's configs with `eos_token_id` 2 mean this rule).
        proj_bias: the projection has a bias (SigLIP's head) or not (CLIP's `text_projection`).
        act: the MLP's activation, as `ViTConfig.act`.
        eps: LayerNorm epsilon.
    """

    vocab_size: int
    context_length: int
    width: int
    depth: int
    heads: int
    mlp_dim: int
    embed_dim: int
    causal: bool = True
    pool: Literal["eos", "last"] = "eos"
    eos_token_id: int | None = None
    proj_bias: bool = False
    act: Literal["gelu", "gelu_tanh", "quick_gelu"] = "quick_gelu"
    eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")
        if self.pool not in ("eos", "last"):
            raise ValueError(f'pool must be "eos" or "last", got {self.pool!r}')
        if self.act not in ("gelu", "gelu_tanh", "quick_gelu"):
            raise ValueError(f'act must be "gelu", "gelu_tanh" or "quick_gelu", got {self.act!r}')


@dataclass(frozen=True)
class Preprocessing:
    """How a model wants its images.

    Attributes:
        image_size: side S of the square the model sees; for mode "fit", the side of a square image
            with at least `max_patches` patches (the largest input: what requests are priced by).
        resize_size: the shorter side is resized to this before the centre crop (mode "crop");
            None means S.
        mode: "crop" (resize the shorter side, centre-crop S x S), "squash" (resize to S x S) or
            "fit" (SigLIP 2's NaFlex: the whole image resized, its aspect ratio nearly kept, to
            h x w, both multiples of `patch_size`, with at most `max_patches` patches: `fit_size`).
        mean, std: per-channel normalisation of [0, 1] pixels.
        interpolation: "bilinear", "bicubic" or "nearest" (any of `INTERPOLATIONS`).
        full_size: the side of the square the weights' own transform makes when the model's patch
            embedding reads only its top-left S x S (a size that is not a multiple of the patch: timm's
            SigLIP so400m at 384 px with 14 px patches sees 378); None: S itself. The resize and
            crop are made at this side, then the rest is cut off.
        patch_size, max_patches: mode "fit"'s patch side P and most patches (None otherwise).
    """

    image_size: int
    resize_size: int | None = None
    mode: Literal["crop", "squash", "fit"] = "crop"
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    interpolation: str = "bilinear"
    full_size: int | None = None
    patch_size: int | None = None
    max_patches: int | None = None

    def __post_init__(self) -> None:
        if self.full_size is not None and self.full_size < self.image_size:
            raise ValueError(f"full_size {self.full_size} is smaller than image_size {self.image_size}")
        if self.mode not in ("crop", "squash", "fit"):
            raise ValueError(f'mode must be "crop", "squash" or "fit", got {self.mode!r}')
        if (self.mode == "fit") != (self.patch_size is not None and self.max_patches is not None):
            raise ValueError('patch_size and max_patches are given for mode "fit", and only for it')
        if self.mode == "fit" and (self.patch_size < 1 or not 1 <= self.max_patches <= (self.image_size // self.patch_size) ** 2
                                   or self.full_size is not None):
            raise ValueError(f"fit needs a patch side above 0, a patch count from 1 to the patches of an image_size square "
                             f"(got {self.patch_size}, {self.max_patches}, {self.image_size}) and no full_size")
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"{self.interpolation!r} is not a valid InterpolationMode (one of {', '.join(INTERPOLATIONS)})")

    @property
    def crop_fraction(self) -> float:
        """The share of the resized shorter side that the crop keeps (timm's crop_pct)."""
        side = self.full_size or self.image_size
        return side / (self.resize_size or side)

    @property
    def square(self) -> bool:
        """Every image becomes the same S x S input (modes "crop" and "squash")."""
        return self.mode != "fit"

    def size_for(self, height: int, width: int) -> tuple[int, int]:
        """(h, w) of the input made from an image of height x width pixels."""
        if self.mode == "fit":
            return fit_size(height, width, patch_size=self.patch_size, max_patches=self.max_patches)
        return self.image_size, self.image_size

    def at(self, image_size: int) -> "Preprocessing":
        """The same rule for another square side (the crop keeps the same share of the image; "fit"
        allows the patches of that square)."""
        if image_size == self.image_size:
            return self
        if self.mode == "fit":
            return replace(self, image_size=image_size, max_patches=(image_size // self.patch_size) ** 2)
        resize = None if self.resize_size is None else math.floor(image_size / self.crop_fraction + 1e-6)
        return replace(self, image_size=image_size, resize_size=resize, full_size=None)


class ImageError(ValueError):
    """An image vitviz will not analyse; the message says why and what is accepted."""


def fit_size(height: int, width: int, *, patch_size: int, max_patches: int) -> tuple[int, int]:
    """The (h, w) an image of height x width pixels is resized to for SigLIP 2's NaFlex (Tschannen et
    al. 2025; Hugging Face's Siglip2ImageProcessor and timm's naflex transforms use the same rule):
    both sides scaled by one factor s and rounded up to whole patches, at least one patch each, with
    the largest s (found by bisection in [1e-6, 100] to within 1e-5) that keeps h/P x w/P at most
    `max_patches`."""
    if height < 1 or width < 1:
        raise ValueError(f"an image of {width}x{height} px has nothing to fit")

    def sides(scale: float) -> tuple[int, int]:
        return tuple(max(patch_size, math.ceil(side * scale / patch_size) * patch_size) for side in (height, width))

    low, high = 1e-6, 100.0
    while high - low >= 1e-5:
        mid = (low + high) / 2
        h, w = sides(mid)
        if (h // patch_size) * (w // patch_size) <= max_patches:
            low = mid
        else:
            high = mid
    return sides(low)


_PIXELS = re.compile(r"[1-9][0-9]*")
_SIZE_RULE = "a whole number of pixels above 0, without sign or leading zeros, that is a multiple of the model's patch size"


def split_size(name: str) -> tuple[str, int | None]:
    """"<name>@<pixels>" -> (<name>, pixels); a name without "@" -> (name, None).

    Raises:
        ValueError: what follows the last "@" is not a size (it is checked against the patch size
            where the model is known: `check_size`).
    """
    base, at, size = name.rpartition("@")
    if not at:
        return name, None
    if not _PIXELS.fullmatch(size):
        raise ValueError(f"{name!r}: after @ comes the side of the images the model is fed, {_SIZE_RULE} (e.g. "
                         f"shapes_p16@96, timm:vit_small_patch8_224.dino@480); got {size!r}")
    return base, int(size)


def check_size(image_size: object, *, patch_size: int, name: str) -> int:
    """`image_size` when a model of `patch_size` can be fed images of that side.

    Raises:
        ValueError: not a whole number above 0, or not a multiple of the patch size; the message
            names the nearest sizes that are.
    """
    if not isinstance(image_size, int) or isinstance(image_size, bool) or image_size <= 0:
        raise ValueError(f"the image size of {name} is {_SIZE_RULE} ({patch_size} px); got {image_size!r}")
    if image_size % patch_size:
        below = image_size // patch_size * patch_size
        near = " or ".join(str(s) for s in (below, below + patch_size) if s > 0)
        raise ValueError(f"{image_size} px is not a multiple of {name}'s patch size {patch_size}: {near} px would be")
    return image_size


# The class `VariantSpec.build` makes: `vitviz.model.ViT`, handed over by `vitviz.model` on import.
_model_class: list[Callable[[ViTConfig], Any]] = []


def _use_model_class(cls: Callable[[ViTConfig], Any]) -> None:
    """Called by `vitviz.model` with its `ViT` (this module cannot import it: the model stands on it)."""
    _model_class[:] = [cls]


class ModelRecord:
    """The facts the rest of vitviz reads of a model's record, from its `config`, `preprocessing` and
    `categories`: shared by `VariantSpec` and `vitviz.video.VideoSpec`."""

    image_size = property(lambda self: self.preprocessing.image_size)
    patch_size = property(lambda self: self.config.patch_size)
    width = property(lambda self: self.config.width)
    depth = property(lambda self: self.config.depth)
    heads = property(lambda self: self.config.heads)
    num_prefix_tokens = property(lambda self: self.config.num_prefix_tokens)
    mean = property(lambda self: self.preprocessing.mean)
    std = property(lambda self: self.preprocessing.std)

    @property
    def num_classes(self) -> int:
        return len(self.categories) if self.categories is not None else 0

    @property
    def has_head(self) -> bool:
        return self.categories is not None


@dataclass(frozen=True)
class VariantSpec(ModelRecord):
    """One model variant.

    Attributes:
        name: the name `load_model` takes ("vit_b_16", "shapes_p16", "timm:vit_small_patch16_224.dino").
        config: the architecture.
        preprocessing: how images are resized, cropped and normalised for it.
        categories: class names, index = logit; None for a model without a head (features only).
        source: the name of its `WeightsSource` ("torchvision", "embedded", "timm", "hf", or a
            plugin's).
        weights: human-readable weights name.
        locator: where the source finds the weights (a URL, a file name, a timm name, a repo id, or
            the absolute path of a checkpoint of the user's own).
        filename: the checkpoint's file name, where there is one.
        top1: reported ImageNet top-1 accuracy in %, if known.
        description: one line for menus.
        vlm: for the vision tower of a vision–language model, the VLM's family ("shapes_vlm",
            "idefics3", "qwen2_5_vl", "llava", ...): the model loads with its language model, and
            questions can be asked of it (`vitviz.ask`); None for a model that is no VLM's tower.
    """

    name: str
    config: ViTConfig
    preprocessing: Preprocessing
    categories: tuple[str, ...] | None = field(repr=False)
    source: str
    weights: str
    locator: str = ""
    filename: str = ""
    top1: float | None = None
    description: str = ""
    vlm: str | None = None

    # the facts the rest of vitviz reads, from the config and the preprocessing (`ModelRecord`'s, and these)
    mlp_dim = property(lambda self: self.config.mlp_dim)
    prefix_names = property(lambda self: self.config.prefix_names)
    resize_size = property(lambda self: self.preprocessing.resize_size)
    interpolation = property(lambda self: self.preprocessing.interpolation)

    @property
    def url(self) -> str | None:
        return self.locator if self.locator.startswith(("http://", "https://")) else None

    @property
    def grid(self) -> tuple[int, int]:
        """The patch grid at the preprocessing's image size (for "fit", the square one of a square
        image; other images have grids of other shapes, of no more patches)."""
        side = self.preprocessing.image_size // self.config.patch_size
        return side, side

    @property
    def num_tokens(self) -> int:
        """The tokens of an image (for "fit", of an image with the most patches it allows)."""
        pre = self.preprocessing
        return self.config.tokens_of(pre.max_patches if pre.mode == "fit" else self.grid[0] * self.grid[1])

    def at(self, image_size: int) -> "VariantSpec":
        """The same variant fed images of another size (position embeddings are resampled)."""
        check_size(image_size, patch_size=self.patch_size, name=self.name)
        return replace(self, preprocessing=self.preprocessing.at(image_size))

    def whole(self) -> "VariantSpec":
        """The same variant fed each image whole, its aspect ratio kept, in as many patches as its own
        square input has (`Preprocessing` mode "fit"; the name's suffix "@whole"): for a model whose
        positions follow any grid (a learned table resampled, rotary positions). A model whose
        positions are learned for its own grid only (a relative position bias) or that attends within
        windows (Swin) raises ValueError."""
        c, pre = self.config, self.preprocessing
        if getattr(c, "attention", "global") != "global" or getattr(c, "rel_pos_bias", False):
            why = "attends within windows" if getattr(c, "attention", "global") != "global" else "has a relative position bias learned for its grid"
            raise ValueError(f"{self.name} {why}: it takes square images of {pre.image_size} px only, not whole images")
        if pre.mode == "fit":
            return self
        side = pre.image_size
        return replace(self, preprocessing=Preprocessing(image_size=side, mode="fit", mean=pre.mean, std=pre.std,
                                                         interpolation=pre.interpolation, patch_size=c.patch_size,
                                                         max_patches=(side // c.patch_size) ** 2))

    def build(self) -> Any:
        """A randomly initialised vitviz ViT of this architecture (no weights loaded), with this spec."""
        if not _model_class:
            raise RuntimeError("vitviz.model is not imported (`import vitviz` imports it)")
        model = _model_class[0](self.config)
        model.spec = self
        return model
