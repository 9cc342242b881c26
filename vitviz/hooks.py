"""Recording attention with forward hooks that live for one `with` block.

    with vitviz.record_attention(model) as rec:
        logits = model(x)
    rec.attentions            # [L, B, H, N, N]

    with vitviz.record_attention(model, gradients=True) as rec:   # outside inference_mode
        model(x)[torch.arange(B), targets].sum().backward()
    rec.gradients             # [L, B, H, N, N]: d(target logit) / d(each layer's softmax output)

    with vitviz.record_attention(model, graph=True) as rec:       # outside inference_mode
        score = model(x)[:, c].sum()
    torch.autograd.grad(score, rec.graph_attentions)             # your own derivatives, layer by layer

The hooks sit on each block's softmax module (`Attention.attend`) and are removed in `finally`, also
when the forward raises. Each recorder keeps only what runs in the thread that opened it, so several
threads can analyse different images through one shared model at the same time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from vitviz.model import Attention, AttentionPool, _enter_recording, _leave_recording, _part_reducer, _set_part_reducer

__all__ = ["AttentionRecord", "record_attention"]


class AttentionRecord:
    """What one `record_attention` block captured.

    `calls[c][l]` is layer l's attention `[B, H, N, N]` in the c-th forward of the block;
    `grad_calls[c][l]` its gradient, once a backward has run through it (with `gradients=True`).
    A model that pools with attention (`vitviz.model.AttentionPool`, SigLIP) has its probe's
    attention `[B, H, N]` recorded as one more entry of each call (index L), read as
    `pool_attention` (and `pool_gradients`, `graph_pool_attention`); it is not part of the stack.
    """

    def __init__(self, num_layers: int, *, pooled: bool = False) -> None:
        self.num_layers = num_layers
        self.pooled = pooled
        self.calls: list[list[torch.Tensor | None]] = []
        self.grad_calls: list[list[torch.Tensor | None]] = []
        self.graph_calls: list[list[torch.Tensor | None]] = []

    def _capture(self, layer: int, attn: torch.Tensor, live: torch.Tensor | None = None) -> int:
        if layer == 0 or not self.calls:
            slots = self.num_layers + int(self.pooled)
            self.calls.append([None] * slots)
            self.grad_calls.append([None] * slots)
            self.graph_calls.append([None] * slots)
        self.calls[-1][layer] = attn.detach()
        self.graph_calls[-1][layer] = live
        return len(self.calls) - 1

    def _pool_entry(self, calls: list[list[torch.Tensor | None]], what: str) -> torch.Tensor | None:
        if not self.pooled:
            return None
        if not calls or calls[-1][self.num_layers] is None:
            raise RuntimeError(f"no {what} of the attention pooling was captured in the last forward")
        return calls[-1][self.num_layers]  # [B, H, 1, N]

    @property
    def pool_attention(self) -> torch.Tensor | None:
        """The probe's attention over the tokens in the last forward [B, H, N] (rows sum to 1), or
        None for a model that does not pool with attention."""
        entry = self._pool_entry(self.calls, "attention")
        return None if entry is None else entry[:, :, 0]

    @property
    def pool_gradients(self) -> torch.Tensor | None:
        """The gradient of the probe's attention [B, H, N] (with `gradients=True`), or None."""
        entry = self._pool_entry(self.grad_calls, "gradient")
        return None if entry is None else entry[:, :, 0]

    @property
    def graph_pool_attention(self) -> torch.Tensor | None:
        """The probe's attention on the autograd graph as the model made it, [B, H, 1, N] (with
        `graph=True`; differentiate with respect to this tensor itself), or None."""
        return self._pool_entry(self.graph_calls, "graph")

    def _capture_grad(self, call: int, layer: int, grad: torch.Tensor) -> None:
        slot = self.grad_calls[call]
        slot[layer] = grad.detach() if slot[layer] is None else slot[layer] + grad.detach()  # several backwards add up

    @property
    def layers(self) -> list[torch.Tensor]:
        """The last forward's attention, one entry per layer as captured (no copy).

        Raises:
            RuntimeError: no forward ran in this block, or one stopped part-way.
        """
        if not self.calls:
            raise RuntimeError("record_attention captured nothing: run the model inside the `with` block")
        last = self.calls[-1][: self.num_layers]
        missing = [i for i, a in enumerate(last) if a is None]
        if missing:
            raise RuntimeError(f"the last forward did not reach layers {missing}; nothing complete was captured")
        return list(last)  # type: ignore[arg-type]

    @property
    def attentions(self) -> torch.Tensor:
        """The last forward's attention, stacked over layers: [L, B, H, N, N] (RuntimeError as `layers`)."""
        return torch.stack(self.layers)

    @property
    def graph_attentions(self) -> list[torch.Tensor]:
        """The last forward's softmax outputs themselves, one [B, H, N, N] per layer, still on the
        autograd graph (recorded with `graph=True`): the `inputs` of `torch.autograd.grad` calls of
        the caller's own. Layer l's entry is the tensor layer l multiplied by V.

        Raises:
            RuntimeError: nothing was recorded with graph=True, or the forward ran without autograd.
        """
        if not self.graph_calls:
            raise RuntimeError("record_attention captured nothing: run the model inside the `with` block")
        last = self.graph_calls[-1][: self.num_layers]
        if any(a is None or not a.requires_grad for a in last):
            raise RuntimeError("no attention on the autograd graph: record with graph=True, outside torch.inference_mode / no_grad, "
                               "with an input or weights that require grad")
        return list(last)  # type: ignore[arg-type]

    @property
    def gradients(self) -> torch.Tensor:
        """The gradients of the last forward's attention, stacked over layers: [L, B, H, N, N].

        Layer l's entry is the gradient with respect to layer l's own softmax output, whatever the
        order in which backward reached the layers.

        Raises:
            RuntimeError: nothing was recorded with gradients=True, or no backward reached every layer.
        """
        if not self.grad_calls:
            raise RuntimeError("record_attention captured nothing: run the model inside the `with` block")
        last = self.grad_calls[-1][: self.num_layers]
        missing = [i for i, g in enumerate(last) if g is None]
        if missing:
            raise RuntimeError(
                f"no gradient reached layers {missing}: record with gradients=True, outside torch.inference_mode / no_grad, "
                "and call .backward() on an output of the last forward"
            )
        return torch.stack(last)  # type: ignore[arg-type]


@contextmanager
def record_attention(
    model: nn.Module, *, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, gradients: bool = False,
    graph: bool = False, images_at_a_time: int | None = None,
) -> Iterator[AttentionRecord]:
    """Records every attention map of `model` (a vitviz ViT) during the block.

    Args:
        model: a vitviz ViT, or a module holding one: for an image–text model
            (`vitviz.imagetext.ImageTextModel`) its image tower's attention, never the text tower's.
        reduce: applied to each layer's attention [B, H, N, N] as soon as it is computed; its
            result is stored instead, so a large batch need not hold the whole stack.
        gradients: also keep the gradient of each layer's softmax output when a backward runs
            (the forward must run with autograd on).
        graph: also keep each layer's softmax output as the forward made it, on the autograd graph
            (`rec.graph_attentions`), for derivatives taken with `torch.autograd.grad` (several
            scores, each layer on its own) rather than by one `.backward()`.
        images_at_a_time: with a `reduce` that treats each image on its own (its result [B, ...],
            image b's from image b's attention alone): each layer's attention is computed and
            reduced this many images at a time, while it is in the processor's cache, and the parts'
            results are joined along the batch; the layer's other work still runs on the whole
            batch. Stored and returned as without it. Not with `gradients` or `graph`.

    Yields:
        an `AttentionRecord`; read `rec.attentions` after the forward ([L, ...] of what was stored)
        and `rec.gradients` after a backward.
    """
    modules = [m for m in model.modules() if isinstance(m, Attention)]
    if not modules:
        raise TypeError(
            f"{type(model).__name__} has no vitviz Attention modules; convert it first with vitviz.ViT.from_torchvision, "
            "ViT.from_timm or ViT.from_transformers"
        )
    if images_at_a_time is not None:
        if isinstance(images_at_a_time, bool) or not isinstance(images_at_a_time, int) or images_at_a_time < 1:
            raise ValueError(f"images_at_a_time must be a whole number >= 1, not {images_at_a_time!r}")
        if reduce is None or gradients or graph:
            raise ValueError("images_at_a_time needs a reduce, and takes neither gradients nor graph")
    pools = [m for m in model.modules() if isinstance(m, AttentionPool)]
    rec = AttentionRecord(len(modules), pooled=len(pools) == 1)
    owner = threading.get_ident()
    handles = []

    def make_hook(layer: int, *, keep_whole: bool = False):
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            if threading.get_ident() == owner:
                kept = reduce(output) if reduce is not None and not keep_whole else output
                call = rec._capture(layer, kept, output if graph else None)
                if gradients and output.requires_grad:
                    # a hook on this very tensor: its gradient is d/dA of this layer, paired by index
                    output.register_hook(lambda grad, call=call: rec._capture_grad(call, layer, grad))

        hook._vitviz_recorder = True  # type: ignore[attr-defined]
        return hook

    def make_parts(layer: int):
        pending: list[torch.Tensor] = []

        def parts(attn: torch.Tensor, first: int, batch: int) -> None:  # this thread's only (`Attention._by_parts`)
            if first == 0:
                pending.clear()
            pending.append(reduce(attn))
            if first + attn.shape[0] >= batch:
                rec._capture(layer, pending[0] if len(pending) == 1 else torch.cat(pending))
                pending.clear()

        return parts

    by_parts = []

    _enter_recording()
    try:
        for i, m in enumerate(modules):
            if images_at_a_time is not None and _part_reducer(m) is None:
                _set_part_reducer(m, make_parts(i), images_at_a_time)
                by_parts.append(m)
            else:  # a recorder by parts already open on it in this thread: it gets the whole layer, as this hook does
                handles.append(m.attend.register_forward_hook(make_hook(i)))
        if rec.pooled:  # recorded as it is: the reduction is for the [B, H, N, N] stack
            handles.append(pools[0].attend.register_forward_hook(make_hook(len(modules), keep_whole=True)))
        yield rec
    finally:
        for h in handles:
            h.remove()
        for m in by_parts:
            _set_part_reducer(m, None)
        _leave_recording()
