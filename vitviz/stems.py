"""The convolutional stems of hybrid Vision Transformers: a CNN whose feature map, not the image,
is cut into patches (Dosovitskiy et al., "An Image is Worth 16x16 Words", ICLR 2021, section 3.1,
"Hybrid Architecture").

image [B, 3, H, W] -> stem -> feature map [B, C, H / s, W / s] -> the ViT's patch embedding

A token then covers P = s x (the patch embedding's own patch) pixels, so `ViTConfig.patch_size` is
P as for any ViT, and everything measured in pixels (the grid, mean attention distance) keeps its
meaning. `ViTConfig.stem` names the kind:

- "bit": the ResNet of the ViT paper's hybrids, from Big Transfer (Kolesnikov et al., "Big Transfer
  (BiT): General Visual Representation Learning", ECCV 2020): GroupNorm and weight-standardised
  convolutions (Qiao et al. 2019), padded as TensorFlow's "SAME"; bottlenecks as in ResNet v1.5
  (the stride on the 3x3 convolution). R50+ViT-B/16 keeps three stages of (3, 4, 9) bottlenecks;
  R+ViT-Ti/16 the root alone.
- "resnet_d": a ResNet with BatchNorm and two tweaks of He et al., "Bag of Tricks for Image
  Classification with Convolutional Neural Networks" (CVPR 2019): three 3x3 convolutions instead of
  the 7x7 one (ResNet-C), and shortcuts that average-pool before their 1x1 projection (ResNet-D).
- "conv": convolutions whose kernel is their stride, each followed by BatchNorm and GELU
  (MobileCLIP's image encoder, Vasu et al., "MobileCLIP", CVPR 2024): the patch embedding is the
  last such convolution.

`ViT` builds the stem its config names through `vitviz.model.register_stem`, called here on import.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vitviz.config import ViTConfig
from vitviz.model import register_stem

__all__ = [
    "BIT_STD_EPS",
    "Bottleneck",
    "ConvStem",
    "MaxPoolSame",
    "ResNetStem",
    "StdConv2d",
    "same_padding",
]

BIT_STD_EPS = 1e-8  # the epsilon of the hybrids' weight standardisation
NORM_EPS = 1e-5  # GroupNorm's and BatchNorm's
GROUPS = 32  # BiT's GroupNorm groups


def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow's "SAME" padding of one axis of `size` pixels: (before, after), the output
    ⌈size / stride⌉ long, the odd pixel of padding after."""
    total = max((-(-size // stride) - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def _pad_same(x: torch.Tensor, kernel: int, stride: int, value: float = 0.0) -> torch.Tensor:
    """x [B, C, H, W] padded for a "SAME" window of `kernel` and `stride`."""
    top, bottom = same_padding(x.shape[-2], kernel, stride)
    left, right = same_padding(x.shape[-1], kernel, stride)
    return F.pad(x, (left, right, top, bottom), value=value)


class StdConv2d(nn.Conv2d):
    """A Conv2d without bias whose filters are standardised before each use (Qiao et al. 2019's weight
    standardisation, BiT's): each output channel's filter W_o to zero mean and unit variance over its
    inputs and taps,

        Ŵ_o = (W_o − mean(W_o)) / sqrt(var(W_o) + eps)

    and the input padded as TensorFlow's "SAME" (`same_padding`)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, *, stride: int = 1, eps: float = BIT_STD_EPS) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, bias=False)
        self.eps = eps

    def standardised(self) -> torch.Tensor:
        """Ŵ [O, I, k, k]."""
        w = self.weight
        var, mean = torch.var_mean(w, dim=(1, 2, 3), unbiased=False, keepdim=True)
        return (w - mean) / torch.sqrt(var + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, I, H, W] -> [B, O, ⌈H / stride⌉, ⌈W / stride⌉]."""
        k, s = self.kernel_size[0], self.stride[0]
        return F.conv2d(_pad_same(x, k, s), self.standardised(), None, s)


class MaxPoolSame(nn.Module):
    """Max pooling padded as TensorFlow's "SAME" (padding never wins the max)."""

    def __init__(self, kernel_size: int, stride: int) -> None:
        super().__init__()
        self.kernel_size, self.stride = kernel_size, stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> [B, C, ⌈H / stride⌉, ⌈W / stride⌉]."""
        return F.max_pool2d(_pad_same(x, self.kernel_size, self.stride, -math.inf), self.kernel_size, self.stride)


ConvFactory = Callable[[int, int, int, int], nn.Module]  # (in channels, out channels, kernel, stride) -> a convolution
NormFactory = Callable[[int], nn.Module]  # channels -> a norm


def _bit_conv(in_channels: int, out_channels: int, kernel: int, stride: int) -> nn.Module:
    return StdConv2d(in_channels, out_channels, kernel, stride=stride)


def _plain_conv(in_channels: int, out_channels: int, kernel: int, stride: int) -> nn.Module:
    return nn.Conv2d(in_channels, out_channels, kernel, stride=stride, padding=kernel // 2, bias=False)


def _group_norm(channels: int) -> nn.Module:
    return nn.GroupNorm(GROUPS, channels, eps=NORM_EPS)


def _batch_norm(channels: int) -> nn.Module:
    return nn.BatchNorm2d(channels, eps=NORM_EPS)


class Bottleneck(nn.Module):
    """A ResNet bottleneck as in v1.5: a 1x1 convolution to a quarter of the output channels, a 3x3 one
    that carries the stride, a 1x1 one out, each followed by a norm, a ReLU after the first two norms
    and after the sum with the shortcut:

        y = ReLU(N3(C3(ReLU(N2(C2(ReLU(N1(C1(x)))))))) + shortcut(x))

    The shortcut is x itself, or, where the block changes the width or the stride, a 1x1 projection
    and a norm: strided (BiT), or after a 2x2 average pool that carries the stride (`avg_down`,
    ResNet-D).
    """

    def __init__(self, in_channels: int, out_channels: int, *, stride: int, conv: ConvFactory, norm: NormFactory,
                 avg_down: bool) -> None:
        super().__init__()
        mid = out_channels // 4
        self.conv1, self.norm1 = conv(in_channels, mid, 1, 1), norm(mid)
        self.conv2, self.norm2 = conv(mid, mid, 3, stride), norm(mid)
        self.conv3, self.norm3 = conv(mid, out_channels, 1, 1), norm(out_channels)
        self.act = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            parts: OrderedDict[str, nn.Module] = OrderedDict()
            if avg_down and stride != 1:
                parts["pool"] = nn.AvgPool2d(2, stride, ceil_mode=True, count_include_pad=False)
            parts["conv"] = conv(in_channels, out_channels, 1, 1 if avg_down else stride)
            parts["norm"] = norm(out_channels)
            self.shortcut = nn.Sequential(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, in, H, W] -> [B, out, H / stride, W / stride]."""
        y = self.act(self.norm1(self.conv1(x)))
        y = self.act(self.norm2(self.conv2(y)))
        return self.act(self.norm3(self.conv3(y)) + self.shortcut(x))


def _bit_root() -> nn.Sequential:
    """BiT's root: a 7x7 convolution of stride 2 to 64 channels, GroupNorm, ReLU, a 3x3 max pool of
    stride 2: [B, 3, H, W] -> [B, 64, H / 4, W / 4]."""
    return nn.Sequential(OrderedDict(conv=_bit_conv(3, 64, 7, 2), norm=_group_norm(64), act=nn.ReLU(), pool=MaxPoolSame(3, 2)))


def _deep_root() -> nn.Sequential:
    """ResNet-C's root: three 3x3 convolutions (32, 32, 64 channels, the first of stride 2), each with
    BatchNorm and ReLU, a 3x3 max pool of stride 2: [B, 3, H, W] -> [B, 64, H / 4, W / 4]."""
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for i, (into, out, stride) in enumerate(((3, 32, 2), (32, 32, 1), (32, 64, 1)), start=1):
        layers[f"conv{i}"], layers[f"norm{i}"], layers[f"act{i}"] = _plain_conv(into, out, 3, stride), _batch_norm(out), nn.ReLU()
    layers["pool"] = nn.MaxPool2d(3, stride=2, padding=1)
    return nn.Sequential(layers)


class ResNetStem(nn.Module):
    """A ResNet as a hybrid's stem ("bit" or "resnet_d"): its root (stride 4, 64 channels), then
    `stem_depths` stages of bottlenecks, stage i giving 256 · 2^i channels, each stage after the
    first halving the map: [B, 3, H, W] -> [B, C, H / s, W / s] (`ViTConfig.stem_channels`,
    `ViTConfig.stem_stride`)."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        bit = config.stem == "bit"
        conv, norm = (_bit_conv, _group_norm) if bit else (_plain_conv, _batch_norm)
        self.root = _bit_root() if bit else _deep_root()
        stages, channels = [], 64
        for i, depth in enumerate(config.stem_depths):
            out = 256 * 2**i
            stages.append(nn.Sequential(*(
                Bottleneck(channels if j == 0 else out, out, stride=2 if i and not j else 1, conv=conv, norm=norm, avg_down=not bit)
                for j in range(depth)
            )))
            channels = out
        self.stages = nn.Sequential(*stages)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> [B, C, H / s, W / s]."""
        return self.stages(self.root(images))


class ConvStem(nn.Sequential):
    """Convolutions whose kernel is their stride ("conv"), `stem_widths` channels and `stem_strides`
    strides, each followed by BatchNorm and GELU: [B, 3, H, W] -> [B, C, H / s, W / s], s the product
    of the strides (MobileCLIP's stem, whose last convolution is the patch embedding)."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        into = 3
        for i, (width, stride) in enumerate(zip(config.stem_widths, config.stem_strides)):
            self.add_module(str(i), nn.Sequential(OrderedDict(
                conv=nn.Conv2d(into, width, stride, stride=stride, bias=False), norm=_batch_norm(width), act=nn.GELU())))
            into = width


register_stem("bit", ResNetStem)
register_stem("resnet_d", ResNetStem)
register_stem("conv", ConvStem)
