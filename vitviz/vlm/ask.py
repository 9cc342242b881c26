"""Ask a vision–language model about an image: its answer, and for each word of it, where in the
image it came from.

    answer = vitviz.ask(model, "photo.jpg", "what colour is the star?")
    answer.text, answer.tokens                 # the greedy answer, token by token
    answer.map(2)                              # token 2's relevance on the vision tower's patch grid
    answer.map((0, 2), method="attention", layer=5)   # tokens 0-1 summed, layer 5's attention
    answer.top_patches(2, k=5)                 # the five image tokens that count most, with their boxes

`model` is anything `vlm_of` makes a `VLM` of: the embedded `shapes_vlm`, or a Hugging Face VLM
(`vitviz.vlm.hf`). The answer is generated greedily, as the model's own `generate` does with
`do_sample=False`; then the prompt and the answer run once more through the language model with
every layer's attention kept, and for each generated token:

- **attention**: the attention of the position that produced the token (the one before it) over the
  image tokens, at every layer and head: `Answer.attention` [tokens, layers, heads, image tokens],
  float32, 4 x tokens x layers x heads x image tokens bytes (SmolVLM-256M, 30 layers x 9 heads x 64
  image tokens: 69 KB a token). Only the image columns are kept.
- **relevance**: the rule of Chefer et al. 2021b for self-attention over mixed tokens: R = I; for
  each layer, R += mean over heads of (∇A ⊙ A)⁺ R, with ∇A the gradient of the token's logit (before
  the softmax over the vocabulary) with respect to the layer's attention A; the token's relevance is
  R's row of the producing position at the image tokens' columns: `Answer.relevance` [tokens, image
  tokens].

Image tokens are placed back on the vision tower's patch grid through the connector: a model that
merges r x r patches into one token (Idefics3's pixel shuffle, Qwen2.5-VL's merger) gives each of
those patches its token's value (`Answer.map`); the tower's own attention is not composed in
(it is in the tower's own views: every other tab).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np
import torch
from torch import nn

from vitviz.vlm.protocol import VLM, AskShape, Prompt

__all__ = ["Prompt", "VLM", "AskShape", "Answer", "ask", "vlm_of", "chefer_relevance", "MAX_NEW_TOKENS", "answer_bytes"]

MAX_NEW_TOKENS = 64  # the most tokens one `ask` generates


def vlm_of(model: Any) -> VLM:
    """`model` as a `VLM`: itself when it is one; a `vitviz.vlm.ShapesVLM` (the embedded model) or
    a Hugging Face VLM (through `vitviz.vlm.hf.hf_vlm`) wrapped; else a TypeError."""
    if isinstance(model, VLM):
        return model
    held = getattr(model, "__dict__", {}).get("vlm")  # a VLM's tower as `load_model` gives it, holding the whole model
    if held is not None:
        return vlm_of(held)
    from vitviz.vlm.model import ShapesVLM, ShapesVLMRunner

    if isinstance(model, ShapesVLM):
        return ShapesVLMRunner(model)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "model_type") and isinstance(model, nn.Module):
        from vitviz.vlm.hf import hf_vlm

        return hf_vlm(model)
    raise TypeError(f"vitviz cannot ask a {type(model).__name__}: give a vision–language model "
                    "(the embedded shapes_vlm, or a Hugging Face Idefics3/SmolVLM, Qwen2.5-VL or LLaVA)")


def answer_bytes(tokens: int, layers: int, heads: int, image_tokens: int) -> int:
    """What an `Answer` keeps: the attention (float32) and the relevance of each token."""
    return 4 * tokens * image_tokens * (layers * heads + 1)


@dataclass
class Answer:
    """What `ask` returns (module docstring).

    Attributes:
        question: the question asked.
        ids: the generated token ids (the end token included when it came).
        tokens: their texts.
        attention: [tokens, layers, heads, image tokens] float32: each token's producing position's
            attention over the image tokens.
        relevance: [tokens, image tokens] float32 (Chefer et al. 2021b).
        token_grid, merge: the image tokens' grid and how many patches each covers per side.
        image: the picture the vision tower saw (uint8 [H, W, 3]).
        model: the model's name.
    """

    question: str
    ids: list[int]
    tokens: list[str]
    attention: torch.Tensor
    relevance: torch.Tensor
    token_grid: tuple[int, int]
    merge: int
    image: np.ndarray
    model: str = ""
    ends: bool = False

    @property
    def text(self) -> str:
        """The answer as one string (without the end token)."""
        return "".join(self.tokens[: len(self.tokens) - int(self.ends)]).strip()

    @property
    def patch_grid(self) -> tuple[int, int]:
        return self.token_grid[0] * self.merge, self.token_grid[1] * self.merge

    def words(self) -> list[tuple[str, tuple[int, int]]]:
        """The answer's words, each with its span of tokens [start, stop): a token that starts with a
        space (or is the first) starts a word; punctuation joins the word before it; the end token
        is left out."""
        words: list[tuple[str, tuple[int, int]]] = []
        stop = len(self.tokens) - int(self.ends)
        for i, piece in enumerate(self.tokens[:stop]):
            if not words or piece[:1].isspace() or (piece.strip() and piece.strip()[0].isalnum() and not words[-1][0].strip()):
                words.append((piece.strip(), (i, i + 1)))
            else:
                text, (a, _) = words[-1]
                words[-1] = (text + piece.strip(), (a, i + 1))
        return [(w, span) for w, span in words if w]

    def _span(self, span: int | tuple[int, int] | slice | None) -> slice:
        n = len(self.tokens)
        if span is None:
            s = slice(0, n - int(self.ends))
        elif isinstance(span, slice):
            s = span
        elif isinstance(span, (tuple, list)):
            if len(span) != 2:
                raise ValueError(f"a span is (start, stop), got {span!r}")
            s = slice(int(span[0]), int(span[1]))
        else:
            i = int(span)
            if not -n <= i < n:
                raise ValueError(f"token {i} is outside the answer's {n} tokens")
            s = slice(i % n, i % n + 1)
        a, b, step = s.indices(n)
        if step != 1 or b <= a:
            raise ValueError(f"the span {span!r} holds none of the answer's {n} tokens")
        return slice(a, b)

    def token_map(self, span: int | tuple[int, int] | slice | None = None, *,
                  method: Literal["relevance", "attention"] = "relevance", layer: int | None = None) -> torch.Tensor:
        """The summed map of the tokens of `span` on the image tokens' grid [rows, columns].

        Args:
            span: a token index, (start, stop) or a slice; None: the whole answer but the end token.
            method: "relevance" (Chefer et al. 2021b) or "attention" (mean over heads, and over
                layers unless `layer` is given).
            layer: the language model's layer for "attention" (0-based).
        """
        s = self._span(span)
        if method == "relevance":
            if layer is not None:
                raise ValueError("relevance runs through every layer; a layer is for the attention map")
            values = self.relevance[s].sum(0)
        elif method == "attention":
            att = self.attention[s]  # [t, L, H, M]
            if layer is not None:
                if not 0 <= int(layer) < att.shape[1]:
                    raise ValueError(f"layer {layer} is outside the language model's layers 0..{att.shape[1] - 1}")
                values = att[:, int(layer)].mean(1).sum(0)
            else:
                values = att.mean((1, 2)).sum(0)
        else:
            raise ValueError(f'method must be "relevance" or "attention", got {method!r}')
        return values.reshape(self.token_grid)

    def map(self, span: int | tuple[int, int] | slice | None = None, *,
            method: Literal["relevance", "attention"] = "relevance", layer: int | None = None) -> torch.Tensor:
        """`token_map` on the vision tower's patch grid: each patch has the value of the image token
        that covers it (merge x merge patches a token)."""
        values = self.token_map(span, method=method, layer=layer)
        r = self.merge
        return values.repeat_interleave(r, 0).repeat_interleave(r, 1)

    def top_patches(self, span: int | tuple[int, int] | slice | None = None, *, k: int = 5,
                    method: Literal["relevance", "attention"] = "relevance", layer: int | None = None) -> list[dict]:
        """The `k` image tokens with the largest values for `span`, largest first: each its row and
        column on the token grid, its value and its box (x0, y0, x1, y1) in the pixels of `image`."""
        values = self.token_map(span, method=method, layer=layer)
        rows, cols = self.token_grid
        h, w = self.image.shape[:2]
        order = torch.argsort(values.flatten(), descending=True, stable=True)[: max(1, int(k))]
        out = []
        for i in order.tolist():
            r, c = divmod(i, cols)
            out.append({"row": r, "col": c, "value": float(values.flatten()[i]),
                        "box": (round(c * w / cols), round(r * h / rows), round((c + 1) * w / cols), round((r + 1) * h / rows))})
        return out


def chefer_relevance(attentions: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], row: int) -> torch.Tensor:
    """Row `row` of R after every layer (module docstring): R = I, R += mean_h((∇A ⊙ A)⁺) R, layer by
    layer first to last. Each of `attentions` and `grads` is [1, H, T, T] (or [H, T, T]); returns [T].

    Only the row is computed: R_L = (I + Ā_L) ... (I + Ā_1), so its row is e_row (I + Ā_L) ...
    (I + Ā_1), a vector times each factor from the last layer down.
    """
    v = None
    for a, g in zip(reversed(list(attentions)), reversed(list(grads))):
        a = a.reshape(-1, *a.shape[-2:])
        g = g.reshape(-1, *g.shape[-2:])
        bar = (g.double() * a.double()).clamp(min=0).mean(0)  # [T, T]
        if v is None:
            v = torch.zeros(bar.shape[-1], dtype=torch.float64, device=bar.device)
            v[row] = 1.0
        v = v + v @ bar
    return v


def _check_question(question: str) -> str:
    if not isinstance(question, str) or not question.strip():
        raise ValueError("ask a question: the text is empty")
    if len(question) > 500:
        raise ValueError(f"the question is {len(question)} characters; at most 500 are asked")
    return question.strip()


def ask(model: Any, image: Any, question: str, *, max_new_tokens: int = 16, relevance: bool = True) -> Answer:
    """Generate `model`'s answer to `question` about `image` and where each token came from.

    Args:
        model: a VLM (`vlm_of`).
        image: a path, PIL image or uint8 array.
        question: the question (at most 500 characters).
        max_new_tokens: the most tokens to generate (1..`MAX_NEW_TOKENS`).
        relevance: compute each token's relevance (one backward pass per token); False leaves
            `Answer.relevance` zeros.

    Returns:
        an `Answer` (module docstring).
    """
    vlm = vlm_of(model)
    question = _check_question(question)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must be an integer from 1 to {MAX_NEW_TOKENS}, got {max_new_tokens!r}")
    prompt = vlm.prompt(image, question)
    with torch.no_grad():
        generated = vlm.generate(prompt, max_new_tokens)
    if not generated:
        raise RuntimeError(f"{vlm.name} generated no token")
    t = prompt.ids.numel()
    # the positions that produced the tokens: the prompt's last, then each generated token but the last
    ids = torch.cat([prompt.ids, torch.tensor(generated[:-1], dtype=torch.long, device=prompt.ids.device)])[None]
    cols = prompt.image_positions
    n = len(generated)
    rows = torch.arange(t - 1, t - 1 + n)
    with torch.set_grad_enabled(relevance):
        logits, attentions = vlm.forward(prompt, ids)
        relevances = torch.zeros(n, cols.numel(), dtype=torch.float32)
        if relevance:
            needs = [a for a in attentions if a.requires_grad]
            if len(needs) != len(attentions):
                raise RuntimeError(f"{vlm.name}'s attention is not in the autograd graph: no relevance")
            for i in range(n):
                target = logits[0, t - 1 + i, generated[i]]
                grads = torch.autograd.grad(target, attentions, retain_graph=i < n - 1)
                with torch.no_grad():
                    relevances[i] = chefer_relevance(attentions, grads, t - 1 + i)[cols].float().cpu()
        attention = _per_token(attentions, rows, cols)
    tokens = [vlm.piece(i) for i in generated]
    ends = generated[-1] in getattr(vlm, "eos_ids", ())
    return Answer(question=question, ids=list(generated), tokens=tokens, attention=attention, relevance=relevances,
                  token_grid=prompt.token_grid, merge=prompt.merge, image=prompt.image, model=vlm.name, ends=ends)


def _per_token(attentions: Sequence[torch.Tensor], rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """[tokens, layers, heads, image tokens]: each layer's attention at `rows` and `cols`."""
    per_layer = [a.detach()[0][:, rows][:, :, cols].float().cpu() for a in attentions]  # [H, n, M] each
    return torch.stack(per_layer).permute(2, 0, 1, 3).contiguous()
