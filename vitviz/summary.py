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
    d = model.width
    gh, gw = model.grid
    n = model.num_tokens
    s = model.image_size
    rows = [
        SummaryRow("Input image", "", (b, 3, s, s), 0),
        SummaryRow("Patch embedding", f"Conv2d {model.patch_size}x{model.patch_size}, stride {model.patch_size}", (b, d, gh, gw), _count(model.patch_embed.proj)),
        SummaryRow("Flatten to tokens", "Rearrange b d gh gw -> b (gh gw) d", (b, gh * gw, d), 0),
        SummaryRow("Prepend cls token", "Parameter [1, 1, D]", (b, n, d), _count(model.cls_token)),
        SummaryRow("Add position embeddings", "Parameter [1, N, D]", (b, n, d), _count(model.pos_embed)),
    ]
    for i, block in enumerate(model.blocks):
        rows.append(SummaryRow(f"Encoder block {i + 1}", f"{model.heads} heads, MLP {model.mlp_dim}", (b, n, d), _count(block)))
        if expand_blocks:
            rows.append(SummaryRow("LayerNorm + multi-head attention", "", (b, n, d), _count(block.norm1, block.attn), 1))
            rows.append(SummaryRow("LayerNorm + MLP (GELU)", "", (b, n, d), _count(block.norm2, block.mlp), 1))
    rows.append(SummaryRow("Final LayerNorm", "", (b, n, d), _count(model.norm)))
    rows.append(SummaryRow("Take cls token", "", (b, d), 0))
    rows.append(SummaryRow("Classification head", "Linear", (b, model.num_classes), _count(model.head)))
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return Summary(rows=rows, total_params=total, trainable_params=trainable, batch=batch)
