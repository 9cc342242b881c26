"""timm's hybrid Vision Transformers (`vision_transformer_hybrid`: a `HybridEmbed` whose backbone runs
before the patches) read as `vitviz.stems`: the stem's `ViTConfig` fields, and its weights under
vitviz's names.

    timm's backbone                                  vitviz's stem (`ViTConfig.stem`)
    ResNetV2 (preact=False), or its stem alone       "bit": GroupNorm, standardised convolutions, "SAME" padding
    FeatureListNet over a ResNet-D (resnet26d, 50d)  "resnet_d": BatchNorm, a 3x3 root, average-pooled shortcuts
    ConvStem (MobileCLIP's)                          "conv": its last convolution is vitviz's patch embedding

What a backbone has that these stems do not model is named before any weight is read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from vitviz.stems import BIT_STD_EPS, GROUPS, NORM_EPS

__all__ = ["Hybrid", "stem_from_timm", "stem_state_dict"]


@dataclass(frozen=True)
class Hybrid:
    """What a timm `HybridEmbed` gives a `ViTConfig`.

    Attributes:
        fields: the stem's fields (`stem`, `stem_depths`, `stem_widths`, `stem_strides`).
        patch_size: the pixels one token covers: the stem's stride times the embedding's own patch.
        patch_bias: the patch embedding's convolution has a bias.
    """

    fields: dict
    patch_size: int
    patch_bias: bool


def _names(module: nn.Module) -> list[str]:
    return [n for n, _ in module.named_children()]


def _is(module: nn.Module | None, *names: str) -> bool:
    return type(module).__name__ in names


def _conv_is(conv: nn.Module, into: int, out: int, kernel: int, stride: int, padding: int | None = None) -> bool:
    """A plain square convolution of these sizes, no dilation or groups (`padding` checked when given)."""
    return (isinstance(conv, nn.Conv2d) and (conv.in_channels, conv.out_channels) == (into, out)
            and conv.kernel_size == (kernel, kernel) and conv.stride == (stride, stride) and conv.dilation == (1, 1)
            and conv.groups == 1 and (padding is None or conv.padding == (padding, padding)))


def stem_from_timm(pe: nn.Module, problems: list[str]) -> Hybrid | None:
    """The stem of a timm `HybridEmbed` `pe`, or None with what vitviz does not model in `problems`."""
    backbone = pe.backbone
    kind = type(backbone).__name__
    if kind == "ResNetV2" or (kind == "Sequential" and _names(backbone) == ["conv", "norm", "pool"]):
        fields = _bit(backbone, problems)
    elif kind == "FeatureListNet" and _names(backbone)[:4] == ["conv1", "bn1", "act1", "maxpool"]:
        fields = _resnet_d(backbone, problems)
    elif kind == "ConvStem":
        fields = _conv(pe, problems)
    else:
        problems.append(f"a hybrid patch embedding with a {kind} stem (vitviz models BiT's ResNet, ResNet-D and MobileCLIP's "
                        "convolutional stem)")
        return None
    if fields is None:
        return None
    if kind == "ConvStem":  # the last convolution is the embedding: its stride is in the strides
        last = backbone[len(backbone) - 1].conv
        stride = math.prod(fields["stem_strides"]) * last.stride[0]
        return Hybrid(fields, patch_size=stride, patch_bias=last.bias is not None)
    stride = 4 * 2 ** max(len(fields.get("stem_depths", ())) - 1, 0)
    ratio, patch = tuple(pe.feature_ratio), tuple(pe.patch_size)
    proj = pe.proj
    if ratio != (stride, stride) or patch[0] != patch[1]:
        problems.append(f"a hybrid patch embedding of stride {ratio} and patch {patch} (its stem's stride is {stride})")
        return None
    if not (isinstance(proj, nn.Conv2d) and proj.kernel_size == patch and proj.stride == patch and proj.padding == (0, 0)):
        problems.append("a hybrid patch embedding whose projection is not one Conv2d of kernel and stride its patch")
        return None
    return Hybrid(fields, patch_size=stride * patch[0], patch_bias=proj.bias is not None)


def _bit_norm(norm: nn.Module, channels: int, act: bool) -> bool:
    """BiT's norm: a GroupNorm of 32 groups with a weight and a bias, ReLU after it or not."""
    return (_is(norm, "GroupNormAct") and norm.num_groups == GROUPS and norm.num_channels == channels and norm.eps == NORM_EPS
            and norm.affine and isinstance(norm.drop, nn.Identity) and isinstance(norm.act, nn.ReLU if act else nn.Identity))


def _bit_conv(conv: nn.Module, into: int, out: int, kernel: int, stride: int) -> bool:
    """BiT's convolution: weight-standardised (epsilon 1e-8), no bias, "SAME" padding."""
    return _is(conv, "StdConv2dSame") and _conv_is(conv, into, out, kernel, stride) and conv.bias is None and conv.eps == BIT_STD_EPS


def _bit(backbone: nn.Module, problems: list[str]) -> dict | None:
    """A timm `ResNetV2` (as the hybrids build it: not pre-activation, no head) or its stem alone."""
    resnet = _is(backbone, "ResNetV2")
    if resnet and (not isinstance(backbone.norm, nn.Identity) or any(_is(m, "PreActBottleneck", "PreActBasic") for m in backbone.modules())):
        problems.append("a pre-activation ResNetV2 (BiT's own; the hybrids' ResNet normalises after each convolution)")
        return None
    root = backbone.stem if resnet else backbone
    pool = getattr(root, "pool", None)
    if _names(root) != ["conv", "norm", "pool"] or not (
            _bit_conv(root.conv, 3, 64, 7, 2) and _bit_norm(root.norm, 64, act=True)
            and _is(pool, "MaxPool2dSame") and pool.kernel_size == (3, 3) and pool.stride == (2, 2)):
        problems.append("a ResNetV2 root other than BiT's 7x7 standardised convolution padded as TensorFlow's SAME (epsilon 1e-8), "
                        "GroupNorm and max pool")
        return None
    if not resnet:
        return dict(stem="bit")
    head = backbone.head
    if not (backbone.num_classes == 0 and head.global_pool.is_identity()):
        problems.append("a ResNetV2 with its pooling or head")
        return None
    depths = []
    for i, stage in enumerate(backbone.stages):
        blocks = list(stage.blocks)
        out = 256 * 2**i
        into = 64 if i == 0 else out // 2
        for j, b in enumerate(blocks):
            mid, first = out // 4, j == 0
            stride = 2 if i and first else 1
            shortcut = b.downsample
            ok = (_is(b, "Bottleneck") and _bit_conv(b.conv1, into if first else out, mid, 1, 1) and _bit_norm(b.norm1, mid, True)
                  and _bit_conv(b.conv2, mid, mid, 3, stride) and _bit_norm(b.norm2, mid, True)
                  and _bit_conv(b.conv3, mid, out, 1, 1) and _bit_norm(b.norm3, out, False) and isinstance(b.act3, nn.ReLU)
                  and ((shortcut is None) != first)
                  and (shortcut is None or (_is(shortcut, "DownsampleConv") and _bit_conv(shortcut.conv, into, out, 1, stride)
                                            and _bit_norm(shortcut.norm, out, False))))
            if not ok:
                problems.append(f"a ResNetV2 stage {i + 1} other than BiT's bottlenecks of {out} channels (pre-activation, "
                                "dilated or of another width)")
                return None
        depths.append(len(blocks))
    if len(depths) > 4:
        problems.append(f"a ResNetV2 of {len(depths)} stages")
        return None
    return dict(stem="bit", stem_depths=tuple(depths))


def _bn(norm: nn.Module, channels: int) -> bool:
    """A BatchNorm2d with a weight, a bias and running statistics, epsilon 1e-5."""
    return (type(norm) is nn.BatchNorm2d and norm.num_features == channels and norm.eps == NORM_EPS and norm.affine
            and norm.track_running_stats)


def _resnet_d(backbone: nn.Module, problems: list[str]) -> dict | None:
    """A timm `FeatureListNet` over a ResNet-D, its last stage's map the one returned."""
    root = list(backbone.conv1) if isinstance(backbone.conv1, nn.Sequential) else []
    kinds = [type(m).__name__ for m in root]
    pool = backbone.maxpool
    if not (kinds == ["Conv2d", "BatchNorm2d", "ReLU", "Conv2d", "BatchNorm2d", "ReLU", "Conv2d"]
            and _conv_is(root[0], 3, 32, 3, 2, 1) and _bn(root[1], 32) and _conv_is(root[3], 32, 32, 3, 1, 1) and _bn(root[4], 32)
            and _conv_is(root[6], 32, 64, 3, 1, 1) and _bn(backbone.bn1, 64) and isinstance(backbone.act1, nn.ReLU)
            and type(pool) is nn.MaxPool2d and (pool.kernel_size, pool.stride, pool.padding) in ((3, 2, 1), ((3, 3), (2, 2), (1, 1)))):
        problems.append("a ResNet root other than ResNet-C's three 3x3 convolutions (32, 32, 64 channels) with BatchNorm and a max pool")
        return None
    layers = _names(backbone)[4:]
    if layers != [f"layer{i + 1}" for i in range(len(layers))] or list(backbone.return_layers) != layers[-1:] or len(layers) > 4:
        problems.append(f"a ResNet feature extractor returning {list(backbone.return_layers)} of {layers} (vitviz reads the last "
                        "stage's map alone)")
        return None
    depths = []
    for i, name in enumerate(layers):
        out = 256 * 2**i
        into = 64 if i == 0 else out // 2
        blocks = list(getattr(backbone, name))
        for j, b in enumerate(blocks):
            mid, first = out // 4, j == 0
            stride = 2 if i and first else 1
            short = b.downsample
            ok = (_is(b, "Bottleneck") and _conv_is(b.conv1, into if first else out, mid, 1, 1) and _bn(b.bn1, mid)
                  and _conv_is(b.conv2, mid, mid, 3, stride, 1) and _bn(b.bn2, mid) and _conv_is(b.conv3, mid, out, 1, 1)
                  and _bn(b.bn3, out) and b.se is None and all(isinstance(getattr(b, a), nn.ReLU) for a in ("act1", "act2", "act3"))
                  and isinstance(b.aa, nn.Identity) and isinstance(b.drop_block, nn.Identity)
                  and all(m.bias is None for m in (b.conv1, b.conv2, b.conv3))
                  and ((short is None) != first) and (short is None or _avg_down(short, into, out, stride)))
            if not ok:
                problems.append(f"a ResNet stage {i + 1} other than ResNet-D's bottlenecks of {out} channels (squeeze-excitation, "
                                "grouped, dilated or anti-aliased convolutions, or strided shortcuts)")
                return None
        depths.append(len(blocks))
    return dict(stem="resnet_d", stem_depths=tuple(depths))


def _avg_down(short: nn.Module, into: int, out: int, stride: int) -> bool:
    """ResNet-D's shortcut: a 2x2 average pool carrying the stride (none at stride 1), a 1x1
    convolution, BatchNorm."""
    parts = list(short) if isinstance(short, nn.Sequential) else []
    if len(parts) != 3:
        return False
    pool, conv, norm = parts
    pooled = (isinstance(pool, nn.Identity) if stride == 1 else
              (type(pool) is nn.AvgPool2d and pool.kernel_size in (2, (2, 2)) and pool.stride in (stride, (stride, stride))
               and pool.padding in (0, (0, 0)) and pool.ceil_mode and not pool.count_include_pad))
    return pooled and _conv_is(conv, into, out, 1, 1) and conv.bias is None and _bn(norm, out)


def _conv(pe: nn.Module, problems: list[str]) -> dict | None:
    """MobileCLIP's `ConvStem`: convolutions of kernel = stride, each with BatchNorm and GELU but the
    last (bare, the patch embedding: the `HybridEmbed` itself projects nothing)."""
    layers = list(pe.backbone)
    widths, strides, into = [], [], 3
    for i, layer in enumerate(layers):
        conv, norm, last = layer.conv, layer.bn, i == len(layers) - 1
        k = conv.kernel_size[0] if isinstance(conv, nn.Conv2d) else 0
        ok = (_is(layer, "ConvNormAct") and _conv_is(conv, into, conv.out_channels, k, k, 0) and getattr(layer, "aa", None) is None
              and (isinstance(norm, nn.Sequential) and not len(norm) if last else
                   (_is(norm, "BatchNormAct2d") and norm.eps == NORM_EPS and norm.affine and norm.track_running_stats
                    and isinstance(norm.drop, nn.Identity) and type(norm.act) is nn.GELU and norm.act.approximate == "none"
                    and conv.bias is None)))
        if not ok:
            problems.append(f"a convolutional stem whose layer {i + 1} is not a convolution of kernel = stride with BatchNorm and "
                            "GELU (the last bare)")
            return None
        if not last:
            widths.append(conv.out_channels)
            strides.append(k)
        into = conv.out_channels
    if len(layers) < 2 or not isinstance(pe.proj, nn.Identity) or tuple(pe.patch_size) != (1, 1):
        problems.append("a convolutional stem with a projection of its own after it")
        return None
    return dict(stem="conv", stem_widths=tuple(widths), stem_strides=tuple(strides))


# timm's names of a stem's weights -> vitviz's, by kind of backbone (after "patch_embed.backbone.")
_BIT_NAMES = [(r"^(stem\.)?(conv|norm)\.", r"root.\2."), (r"^stages\.(\d+)\.blocks\.", r"stages.\1."),
              (r"\.downsample\.", ".shortcut.")]
_RESNET_D_NAMES = [(r"^conv1\.0\.", "root.conv1."), (r"^conv1\.1\.", "root.norm1."), (r"^conv1\.3\.", "root.conv2."),
                   (r"^conv1\.4\.", "root.norm2."), (r"^conv1\.6\.", "root.conv3."), (r"^bn1\.", "root.norm3."),
                   (r"^layer(\d)\.", lambda m: f"stages.{int(m.group(1)) - 1}."), (r"\.bn(\d)\.", r".norm\1."),
                   (r"\.downsample\.1\.", ".shortcut.conv."), (r"\.downsample\.2\.", ".shortcut.norm.")]
_CONV_NAMES = [(r"^(\d+)\.bn\.", r"\1.norm.")]


def stem_state_dict(model: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`sd` (a timm ViT's weights) with a hybrid's backbone under vitviz's names (`patch_embed.stem.*`;
    MobileCLIP's last convolution as `patch_embed.proj`); `sd` itself for a model without one."""
    backbone = getattr(getattr(model, "patch_embed", None), "backbone", None)
    if backbone is None:
        return sd
    kind = type(backbone).__name__
    rules = _CONV_NAMES if kind == "ConvStem" else _RESNET_D_NAMES if kind == "FeatureListNet" else _BIT_NAMES
    last = f"{len(backbone) - 1}.conv." if kind == "ConvStem" else None
    prefix = "patch_embed.backbone."
    out = {}
    for key, value in sd.items():
        if not key.startswith(prefix):
            out[key] = value
            continue
        name = key.removeprefix(prefix)
        if last is not None and name.startswith(last):  # MobileCLIP's last convolution: the patch embedding
            out["patch_embed.proj." + name.removeprefix(last)] = value
            continue
        for pattern, repl in rules:
            name = re.sub(pattern, repl, name)
        out["patch_embed.stem." + name] = value
    return out
