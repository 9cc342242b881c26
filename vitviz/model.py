"""The Vision Transformer of Dosovitskiy et al., "An Image is Worth 16x16 Words: Transformers for
Image Recognition at Scale" (ICLR 2021), written to be read top to bottom.

image [B, 3, S, S]
  -> patch embedding (Conv2d, kernel = stride = P)      [B, gh*gw, D]
  -> prepend the cls token, add learned position embeddings  [B, N, D],  N = 1 + gh*gw
  -> L pre-norm encoder blocks: x + MSA(LN(x)), then x + MLP(LN(x))
  -> final LayerNorm, the cls token                     [B, D]
  -> linear head                                         [B, classes]

Attention is softmax(q k^T / sqrt(D / H)) — the scale is applied to the logits before the softmax.
The softmax is its own module (`Attention.attend`), so a forward hook on it sees each layer's
attention `[B, H, N, N]`. When nobody records, a fused `scaled_dot_product_attention` runs instead;
both paths give the same output (tests hold them to it).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from einops import rearrange
from einops.layers.torch import Rearrange
from torch import nn

if TYPE_CHECKING:
    from vitviz.zoo import VariantSpec

__all__ = ["ViT", "Attention", "EncoderBlock", "PatchEmbedding", "recording_in_this_thread"]

_recording = threading.local()


def recording_in_this_thread() -> bool:
    """True while `vitviz.record_attention` is active in the calling thread."""
    return getattr(_recording, "depth", 0) > 0


def _enter_recording() -> None:
    _recording.depth = getattr(_recording, "depth", 0) + 1


def _leave_recording() -> None:
    _recording.depth -= 1


class PatchEmbedding(nn.Module):
    """Cuts the image into P x P patches and projects each to D dims with one strided Conv2d."""

    def __init__(self, *, patch_size: int, width: int, in_channels: int = 3) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_channels, width, kernel_size=patch_size, stride=patch_size)
        self.flatten = Rearrange("b d gh gw -> b (gh gw) d")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] -> [B, gh*gw, D]."""
        return self.flatten(self.proj(images))


class Attention(nn.Module):
    """Multi-head self-attention with one fused qkv projection.

    `attend` (the softmax) is a module of its own so that hooks can observe the attention.
    Set `fused = False` to always take the explicit path.
    """

    def __init__(self, *, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.scale = (width // heads) ** -0.5
        self.qkv = nn.Linear(width, 3 * width)
        self.attend = nn.Softmax(dim=-1)
        self.proj = nn.Linear(width, width)
        self.fused = True

    def _observed(self) -> bool:
        if not self.fused or recording_in_this_thread():
            return True
        # A hook that somebody else put on the softmax must see it run; vitviz's own recorder hooks
        # only care about their own thread (handled above). tuple() copies the dict atomically.
        hooks = tuple(self.attend._forward_hooks.values()) + tuple(self.attend._forward_pre_hooks.values())
        return any(not getattr(h, "_vitviz_recorder", False) for h in hooks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N, D] -> [B, N, D]."""
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        if self._observed():
            attn = self.attend((q @ k.transpose(-2, -1)) * self.scale)  # [B, H, N, N], rows sum to 1
            out = attn @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(rearrange(out, "b h n d -> b n (h d)"))


class EncoderBlock(nn.Module):
    """Pre-norm Transformer block: x + MSA(LN(x)), then x + MLP(LN(x)) with a GELU MLP."""

    def __init__(self, *, width: int, heads: int, mlp_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=eps)
        self.attn = Attention(width=width, heads=heads)
        self.norm2 = nn.LayerNorm(width, eps=eps)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Vision Transformer classifying from the cls token after a final LayerNorm.

    Args:
        image_size: side S of the square input in pixels.
        patch_size: side P of a patch; S must be a multiple of P.
        width: token width D.
        depth: number of encoder blocks L.
        heads: attention heads H per block.
        mlp_dim: hidden width of the MLP.
        num_classes: outputs of the head.
        eps: LayerNorm epsilon.
    """

    num_prefix_tokens = 1

    def __init__(
        self,
        *,
        image_size: int,
        patch_size: int,
        width: int,
        depth: int,
        heads: int,
        mlp_dim: int,
        num_classes: int,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
        self.image_size = image_size
        self.patch_size = patch_size
        self.width = width
        self.depth = depth
        self.heads = heads
        self.mlp_dim = mlp_dim
        self.num_classes = num_classes
        self.grid = (image_size // patch_size, image_size // patch_size)
        num_tokens = self.num_prefix_tokens + self.grid[0] * self.grid[1]

        self.patch_embed = PatchEmbedding(patch_size=patch_size, width=width)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embed = nn.Parameter(torch.empty(1, num_tokens, width).normal_(std=0.02))
        self.blocks = nn.ModuleList(
            EncoderBlock(width=width, heads=heads, mlp_dim=mlp_dim, eps=eps) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width, eps=eps)
        self.head = nn.Linear(width, num_classes)
        self.spec: VariantSpec | None = None
        self._init_weights()

    def _init_weights(self) -> None:
        fan_in = self.patch_embed.proj.in_channels * self.patch_size**2
        nn.init.trunc_normal_(self.patch_embed.proj.weight, std=(1.0 / fan_in) ** 0.5)
        nn.init.zeros_(self.patch_embed.proj.bias)
        for module in self.blocks.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.normal_(module.bias, std=1e-6)

    @property
    def num_tokens(self) -> int:
        return self.pos_embed.shape[1]

    def tokens(self, images: torch.Tensor) -> torch.Tensor:
        """Patch tokens with the cls token and position embeddings: [B, 3, S, S] -> [B, N, D]."""
        if images.ndim != 4 or images.shape[1:] != (3, self.image_size, self.image_size):
            raise ValueError(
                f"expected images of shape [B, 3, {self.image_size}, {self.image_size}], "
                f"got {list(images.shape)}"
            )
        x = self.patch_embed(images)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + self.pos_embed

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Every token after the last block and the final norm: [B, 3, S, S] -> [B, N, D]."""
        x = self.tokens(images)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """The normalised cls token, the input of the head: [B, 3, S, S] -> [B, D]."""
        return self.encode(images)[:, 0]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes]."""
        return self.head(self.forward_features(images))

    @classmethod
    def from_torchvision(cls, tv_model: nn.Module) -> "ViT":
        """A vitviz ViT with the weights of a torchvision `VisionTransformer`, giving the same outputs."""
        from vitviz.zoo import convert_torchvision_state_dict, spec_for_torchvision_model

        spec = spec_for_torchvision_model(tv_model)
        model = spec.build()
        model.load_state_dict(convert_torchvision_state_dict(tv_model.state_dict()))
        model.spec = spec
        param = next(tv_model.parameters())
        return model.to(device=param.device, dtype=param.dtype).train(tv_model.training)
