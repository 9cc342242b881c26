"""A stage-by-stage table of a ViT: output shape and parameter count of each stage, like torchinfo.

Parameter counts are read from the modules themselves; shapes follow from the model's layout
(tests check them against a real forward).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from vitviz.model import ViT

__all__ = ["Summary", "SummaryRow", "summary"]


@dataclass(frozen=True)
class SummaryRow:
    stage: str
    layer: str
    output_shape: tuple[int | str, ...]
    params: int
    depth: int = 0


@dataclass(frozen=True)
class Summary:
    rows: list[SummaryRow]
    total_params: int
    trainable_params: int
    batch: int | str

    def table(self) -> list[list[str]]:
        """Rows of strings: stage, layer, output shape, parameters."""
        return [
            ["  " * r.depth + r.stage, r.layer, "[" + ", ".join(str(s) for s in r.output_shape) + "]", f"{r.params:,}" if r.params else "--"]
            for r in self.rows
        ]

    def __str__(self) -> str:
        head = ["Stage", "Layer", "Output shape", "Param #"]
        body = self.table()
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(4)]
        line = "=" * (sum(widths) + 6)
        fmt = lambda row: "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))  # noqa: E731
        return "\n".join(
            [line, fmt(head), line, *map(fmt, body), line, f"Total params: {self.total_params:,}",
             f"Trainable params: {self.trainable_params:,}", line]
        )


def _count(*modules: nn.Module | nn.Parameter) -> int:
    total = 0
    for m in modules:
        total += m.numel() if isinstance(m, nn.Parameter) else sum(p.numel() for p in m.parameters())
    return total


def summary(model: ViT, *, batch: int | str = "B", expand_blocks: bool = False) -> Summary:
    """The stages of `model` with output shapes and parameter counts.

    Args:
        model: a vitviz ViT.
        batch: what to print for the batch dimension.
        expand_blocks: also list each block's attention and MLP.
    """
    b = batch
    c = model.config
    d = c.width
    gh, gw = model.grid
    n = model.num_tokens
    s = model.image_size
    p = c.num_prefix_tokens
    prefix = [t for t in (model.cls_token, model.dist_token, model.reg_token) if t is not None]
    names = ", ".join(
        [x for x, on in (("cls", c.class_token), ("distillation", c.distill_token)) if on]
        + ([f"{c.register_tokens} registers"] if c.register_tokens else [])
    )
    rows = [SummaryRow("Input image", "", (b, 3, s, s), 0)]
    kernel = c.embed_patch_size  # the patch embedding's, over the pixels or a stem's feature map
    if c.stem is not None:  # a hybrid: the patches are cut from the stem's feature map
        stem = {"bit": "ResNet (BiT: GroupNorm, standardised convolutions)", "resnet_d": "ResNet-D (BatchNorm)",
                "conv": "convolutions of kernel = stride, BatchNorm, GELU"}[c.stem]
        stages = f", stages of {'-'.join(map(str, c.stem_depths))} bottlenecks" if c.stem_depths else ""
        rows.append(SummaryRow("Convolutional stem", f"{stem}{stages}, stride {c.stem_stride}",
                               (b, c.stem_channels, gh * kernel, gw * kernel), _count(model.patch_embed.stem)))
    rows += [
        SummaryRow("Patch embedding", f"Conv2d {kernel}x{kernel}, stride {kernel}" + (f", then {c.norm}" if c.patch_norm else ""),
                   (b, d, gh, gw), _count(model.patch_embed) - _count(model.patch_embed.stem)),
        SummaryRow("Flatten to tokens", "Rearrange b d gh gw -> b (gh gw) d", (b, gh * gw, d), 0),
    ]
    if prefix:
        rows.append(SummaryRow(f"Prepend {names} token{'s' if p > 1 else ''}", f"Parameter [1, {p}, D]", (b, n, d), _count(*prefix)))
    k = c.pos_embed_prefix  # the leading prefix tokens that get one (the registers of some models get none)
    if c.abs_pos_embed:
        rows.append(SummaryRow("Add position embeddings", f"Parameter [1, {k} + gh*gw, D]" + (f", none for {p - k} of the {p} prefix tokens" if k < p else ""),
                               (b, n, d), _count(model.pos_embed)))
    if c.norm_pre:
        rows.append(SummaryRow("LayerNorm before the blocks", "", (b, n, d), _count(model.norm_pre)))
    mlp = ("gated MLP" if c.mlp == "gated" else "MLP") + (" with a LayerNorm inside" if c.mlp_norm else "")
    mlp = ("res-post-norm, " if c.post_norm else "") + mlp
    rope = {"axial": "rotary positions (axial)", "dinov3": "rotary positions (DINOv3)", "mixed": "rotary positions (learned, mixed)"}
    ls = (f", {rope[c.rope]}" if c.rope else "") + (", q/k LayerNorm" if c.qk_norm else "") + (", LayerNorm before W_O" if c.attn_norm else "") + (", LayerScale" if c.layer_scale is not None else "")
    for i, block in enumerate(model.blocks):
        rows.append(SummaryRow(f"Encoder block {i + 1}", f"{c.heads} heads, {mlp} {c.mlp_dim}{ls}", (b, n, d), _count(block)))
        if expand_blocks:
            rows.append(SummaryRow("LayerNorm + multi-head attention", "", (b, n, d), _count(block.norm1, block.attn, block.ls1), 1))
            rows.append(SummaryRow(f"LayerNorm + MLP ({c.act})", "", (b, n, d), _count(block.norm2, block.mlp, block.ls2), 1))
    if c.final_norm and not c.fc_norm:
        rows.append(SummaryRow("Final LayerNorm", "", (b, n, d), _count(model.norm)))
    if c.pool == "avg":
        rows.append(SummaryRow("Mean of the patch tokens" + (" + LayerNorm" if c.fc_norm else ""), "", (b, d), _count(model.fc_norm)))
    elif c.pool == "map":
        over = "every token" if c.pool_prefix or not c.num_prefix_tokens else "the patch tokens"
        after, inside = (", then an output projection", "") if c.pool_head == "plain" else (", + LayerNorm + MLP", f", MLP {c.pool_mlp_dim or c.mlp_dim}")
        rows.append(SummaryRow(f"Attention pooling: a learned probe attends over {over}{after}",
                               f"{c.pool_heads or c.heads} heads{inside}", (b, d), _count(model.attn_pool)))
    elif c.distill_token:
        rows.append(SummaryRow("Take cls and distillation tokens", "", (b, 2, d), 0))
    else:
        rows.append(SummaryRow("Take cls token", "", (b, d), 0))
    if c.num_classes:
        heads = [model.head] + ([model.head_dist] if model.head_dist is not None else [])
        label = "Linear" if len(heads) == 1 else "Linear x 2 (cls, distillation), averaged"
        rows.append(SummaryRow("Classification head", label, (b, c.num_classes), _count(*heads)))
    total = sum(t.numel() for t in model.parameters())
    trainable = sum(t.numel() for t in model.parameters() if t.requires_grad)
    return Summary(rows=rows, total_params=total, trainable_params=trainable, batch=batch)
