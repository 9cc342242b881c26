"""Every ViT-family architecture timm knows, through `vitviz.from_timm`: exact, or refused with the
part vitviz does not model. Writes docs/models.md's table.

    python -m vitviz.dev.zoo                      # the table on stdout
    python -m vitviz.dev.zoo --out docs/models.md # the page, with the date, timm's version and the machine

Each architecture (one timm model function) is built with random weights, two blocks deep where its
constructor takes a depth (a Swin at full depth), offline: no weight is downloaded. Its LayerScale,
head and q/v biases are moved off their inits, so that a conversion dropping any cannot pass. "exact": the
converted model's outputs within 1e-4 of timm's (relative to the largest) and, for a
`VisionTransformer`, `Eva`, `Beit`, `VisionTransformerRelPos` or `NaFlexVit`, every block's attention within 1e-5 of timm's own softmax
(`AttentionExtract`, fused attention off; for a `SwinTransformer` or `SwinTransformerV2`, every block's window softmax), at the
architecture's own input size (a NaFlexVit, which takes any aspect ratio, at half its height). "refused": `from_timm` raised
`NotImplementedError` before any weight was read, its sentence quoted. "differs" and "error" are
bugs; "timm cannot build it" is timm's own failure at that depth (such an architecture is built whole
on the meta device, without memory or weights, and refused there if `from_timm` refuses it).
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import sys
import warnings
from dataclasses import dataclass

import torch

# timm's modules of the ViT family, in the order the table shows them
MODULES = ("vision_transformer", "deit", "vision_transformer_hybrid", "vision_transformer_relpos", "eva", "naflexvit", "beit",
           "swin_transformer", "swin_transformer_v2")
LOGIT_TOLERANCE = 1e-4
ATTENTION_TOLERANCE = 1e-5


@dataclass(frozen=True)
class Row:
    module: str
    name: str
    cls: str
    status: str  # "exact", "refused", "differs", "error", "timm cannot build it"
    detail: str = ""


def _build(name: str) -> torch.nn.Module:
    """timm's `name`, random weights, two blocks where its constructor takes `depth`."""
    import timm

    try:
        model = timm.create_model(name, pretrained=False, depth=2)
    except TypeError:  # (a Swin takes depths per stage: built whole)
        model = timm.create_model(name, pretrained=False)
    return randomise(model.eval())


def randomise(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (timm's, in place) with the weights that start at a constant moved off it: LayerScale
    (1e-5), norms (ones and zeros: LayerNorm, GroupNorm, BatchNorm and its running mean and
    variance), heads (zeros), an Eva's, BEiT's or Swin V2's q and v biases and BEiT's relative
    position tables (zeros), Swin V2's log scale of its cosine attention (log 10; drawn
    on both sides of its clamp at log 100), so that a conversion dropping any of them cannot pass a
    comparison of outputs."""
    with torch.no_grad():
        for module in model.modules():
            gamma = getattr(module, "gamma", None)
            if type(module).__name__ == "LayerScale" and isinstance(gamma, torch.Tensor):
                gamma.normal_(1.0, 0.2)
        for module in model.modules():  # norms start at 1 and 0 (a res-post-norm block's at 1e-5)
            if "norm" in type(module).__name__.lower() and isinstance(getattr(module, "weight", None), torch.Tensor):
                module.weight.normal_(1.0, 0.2)
                if isinstance(getattr(module, "bias", None), torch.Tensor):
                    module.bias.normal_(0.0, 0.2)
            if isinstance(getattr(module, "running_mean", None), torch.Tensor):  # a BatchNorm's statistics start at 0 and 1
                module.running_mean.normal_(0.0, 0.2)
                module.running_var.uniform_(0.5, 1.5)
        for name, p in model.named_parameters():
            last = name.rpartition(".")[2]
            if last in ("gamma_1", "gamma_2"):
                p.normal_(1.0, 0.2)
            elif last in ("q_bias", "v_bias", "relative_position_bias_table"):
                p.normal_(std=0.02)
            elif last == "logit_scale":
                p.uniform_(math.log(2), math.log(200))
        for head in (getattr(model, "head", None), getattr(model, "head_dist", None)):
            head = getattr(head, "fc", head)
            if isinstance(head, torch.nn.Linear):
                head.weight.normal_(std=0.02)
                if head.bias is not None:
                    head.bias.normal_(std=0.02)
    return model


def timm_attention(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm's own softmax outputs, taken by timm's own extractor with fused attention off (then on
    again): [L, B, H, N, N]."""
    from timm.utils import AttentionExtract

    owners = [getattr(block, "attn", block) for block in model.blocks]  # (a parallel block computes its attention itself)
    for owner in owners:
        owner.fused_attn = False
    try:
        with torch.inference_mode():
            out = AttentionExtract(model, method="hook")(x)
    finally:
        for owner in owners:
            owner.fused_attn = True
    if len(out) != len(model.blocks):
        raise RuntimeError(f"timm's extractor found {len(out)} attention maps in {len(model.blocks)} blocks")
    return torch.stack(list(out.values()))


def timm_window_attention(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """A timm Swin's own window softmax outputs (`attn.softmax`, fused attention off, then on again):
    one [B * windows, heads, M², M²] per block."""
    caught: list[torch.Tensor] = []
    attns = [block.attn for stage in model.layers for block in stage.blocks]
    handles = [a.softmax.register_forward_hook(lambda _m, _i, out: caught.append(out)) for a in attns]
    fused = [getattr(a, "fused_attn", None) for a in attns]
    for a in attns:
        if hasattr(a, "fused_attn"):
            a.fused_attn = False
    try:
        with torch.inference_mode():
            model(x)
    finally:
        for h in handles:
            h.remove()
        for a, f in zip(attns, fused):
            if f is not None:
                a.fused_attn = f
    if len(caught) != len(attns):
        raise RuntimeError(f"{len(caught)} window softmax outputs caught in {len(attns)} blocks")
    return caught


def _unbuilt(module: str, name: str, exc: Exception) -> Row:
    """The row of an architecture timm cannot build two blocks deep: built whole on the meta device
    (no memory, no weights), it is refused as `from_timm` refuses it, or timm's failure is the row."""
    import timm

    import vitviz

    try:
        with torch.device("meta"):
            whole = timm.create_model(name, pretrained=False)
        vitviz.from_timm(whole)
    except NotImplementedError as refusal:
        return Row(module, name, type(whole).__name__, "refused", str(refusal))
    except Exception:
        pass
    return Row(module, name, "", "timm cannot build it", f"{type(exc).__name__}: {str(exc)[:120]}")


def check(module: str, name: str) -> Row:
    """One architecture's row."""
    import vitviz

    try:
        model = _build(name)
    except Exception as exc:  # timm's own failure (an assertion at two blocks, a missing dependency)
        return _unbuilt(module, name, exc)
    cls = type(model).__name__
    try:
        ours = vitviz.from_timm(model).eval()
    except NotImplementedError as exc:
        return Row(module, name, cls, "refused", str(exc))
    except Exception as exc:
        return Row(module, name, cls, "error", f"{type(exc).__name__}: {str(exc)[:200]}")
    size = model.pretrained_cfg.get("input_size", (3, 224, 224))[-2:]
    if cls == "NaFlexVit":  # images of any aspect ratio: fed one of 1:2
        p = ours.config.patch_size
        size = (size[0] // 2 // p * p, size[1])
    torch.manual_seed(0)
    x = torch.randn(1, 3, *size)
    try:
        with torch.inference_mode():
            want = model(x)
            p = ours.config.patch_size  # (a model whose size is not a multiple of its patch reads the top-left whole patches)
            with vitviz.record_attention(ours) as rec:
                got = ours(x[..., : x.shape[2] // p * p, : x.shape[3] // p * p])
        logits = ((got - want).abs().max() / want.abs().max()).item()
        if logits > LOGIT_TOLERANCE:
            return Row(module, name, cls, "differs", f"outputs {logits:.1e} off")
        if cls in ("VisionTransformer", "VisionTransformerDistilled", "Eva", "Beit", "VisionTransformerRelPos", "NaFlexVit"):
            attention = (rec.attentions - timm_attention(model, x)).abs().max().item()
            if attention > ATTENTION_TOLERANCE:
                return Row(module, name, cls, "differs", f"attention {attention:.1e} off")
            return Row(module, name, cls, "exact", f"outputs {logits:.0e}, attention {attention:.0e}")
        if cls in ("SwinTransformer", "SwinTransformerV2"):
            attention = max((a - b).abs().max().item() for a, b in zip(rec.calls[-1], timm_window_attention(model, x), strict=True))
            if attention > ATTENTION_TOLERANCE:
                return Row(module, name, cls, "differs", f"window attention {attention:.1e} off")
            return Row(module, name, cls, "exact", f"outputs {logits:.0e}, window attention {attention:.0e}")
        return Row(module, name, cls, "exact", f"outputs {logits:.0e}")
    except Exception as exc:
        return Row(module, name, cls, "error", f"{type(exc).__name__}: {str(exc)[:200]}")


def rows(modules: tuple[str, ...] = MODULES, pattern: str = "*") -> list[Row]:
    import timm

    out = []
    for module in modules:
        for name in timm.list_models(pattern, module=module):
            out.append(check(module, name))
            print(f"{len(out):4d} {name}: {out[-1].status}", file=sys.stderr, flush=True)
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(table: list[Row]) -> str:
    """The per-module summary, then every architecture."""
    lines = ["| timm module | architectures | exact | refused | other |", "|---|---:|---:|---:|---:|"]
    for module in dict.fromkeys(r.module for r in table):
        mine = [r for r in table if r.module == module]
        exact = sum(r.status == "exact" for r in mine)
        refused = sum(r.status == "refused" for r in mine)
        lines.append(f"| `{module}` | {len(mine)} | {exact} | {refused} | {len(mine) - exact - refused} |")
    exact = sum(r.status == "exact" for r in table)
    refused = sum(r.status == "refused" for r in table)
    lines.append(f"| all | {len(table)} | {exact} | {refused} | {len(table) - exact - refused} |")
    lines += ["", "| architecture | timm class | status | |", "|---|---|---|---|"]
    lines += [f"| `{r.name}` | {r.cls} | {r.status} | {_cell(r.detail)} |" for r in table]
    return "\n".join(lines) + "\n"


PAGE = """# Models: timm's ViT family through vitviz

Every architecture timm {timm} lists in its ViT-family modules, through `vitviz.from_timm` (and so
`timm:<name>`): **exact** (outputs within {logits:g} of timm's, relative to the largest, and every
block's attention within {attention:g} of timm's own softmax), or **refused** before any weight is
read, with the sentence `from_timm` gives. Random weights, two blocks deep where the constructor takes
a depth, each at its own input size (a NaFlex model at half its height: a 1:2 image); nothing
downloaded (`vitviz/dev/zoo.py` says how each is built).

Measured {date} on {machine}, torch {torch}:

    python -m vitviz.dev.zoo --out docs/models.md

{table}"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m vitviz.dev.zoo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the page here (docs/models.md) instead of the table to stdout")
    ap.add_argument("--modules", nargs="*", default=list(MODULES), help="timm modules (default: the ViT family)")
    ap.add_argument("--pattern", default="*", help="only names matching this pattern (timm.list_models's)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    table = markdown(rows(tuple(args.modules), args.pattern))
    if args.out is None:
        print(table, end="")
        return
    import timm

    machine = f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads), {platform.system()}"
    page = PAGE.format(timm=timm.__version__, logits=LOGIT_TOLERANCE, attention=ATTENTION_TOLERANCE,
                       date=datetime.date.today().isoformat(), machine=machine, torch=torch.__version__, table=table)
    with open(args.out, "w") as f:
        f.write(page)


if __name__ == "__main__":
    main()
