"""Image–text models: CLIP (Radford et al. 2021, "Learning Transferable Visual Models From Natural
Language Supervision"): a vitviz `ViT` image tower and a text tower, each projected into one shared
embedding, where an image and a text are scored by the cosine of their embeddings.

image [B, 3, H, W]
  -> image tower (a vitviz ViT without a head): the cls token after the final norm   [B, D]
  -> image_projection (no bias)                                                    [B, E]
input_ids [T, C] (attention_mask [T, C])
  -> text tower: token + position embeddings, L pre-norm blocks (causal), final norm  [T, C, Dt]
  -> the end-of-text token (`TextConfig.pool`), text projection                    [T, E]
logits_per_image = exp(logit_scale) * cos(image, text)                             [B, T]

The image tower is a plain vitviz ViT: `vitviz.record_attention(model)` (or of `model.image`)
records its attention [L, B, H, N, N] and nothing of the text tower, whose attention is a module
of its own (`TextAttention`, with its softmax `attend` for a hook of its own); `vitviz.analyze(model,
image)` analyses the image tower (`model.spec` is the image tower's, without classes).

This module imports nothing else of vitviz but `vitviz.config` and `vitviz.model`; the conversion
from Hugging Face's `CLIPModel` lives with its weights source (`vitviz.from_transformers`,
`vitviz.load_model("hf:openai/clip-vit-base-patch32")`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from vitviz import steps
from vitviz.config import TextConfig, VariantSpec, ViTConfig
from vitviz.model import ViT, _activation

__all__ = ["DEFAULT_TEMPLATE", "MAX_LABELS", "ImageTextModel", "TextTower", "TextBlock", "TextAttention", "TextConfig", "text_mask"]


DEFAULT_TEMPLATE = "a photo of a {}"
MAX_LABELS = 5000  # labels in one zero-shot label set (ImageNet-21k's 21,843 would be a text-tower job of its own)


def text_mask(
    attention_mask: torch.Tensor | None, *, length: int, causal: bool, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """The additive attention mask of a text tower [T or 1, 1, C, C]: 0 where a query may attend to a
    key, the dtype's lowest value where it may not (a later token when `causal`, padding: the zeros
    of `attention_mask` [T, C]); None where every token may attend to every token.

    A lowest value rather than -inf: a query that may attend to nothing (left padding under a causal
    mask) spreads its attention evenly instead of giving NaN, as Hugging Face's eager attention does.
    """
    allowed = None
    if causal:
        allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]  # [1, 1, C, C]
    if attention_mask is not None:
        keys = attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]  # [T, 1, 1, C]
        allowed = keys if allowed is None else allowed & keys
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


class TextAttention(nn.Module):
    """Multi-head self-attention under an additive mask (`text_mask`), with one fused qkv projection.

    The softmax is its own module (`attend`), as in `vitviz.model.Attention`, but this is not that
    class: `vitviz.record_attention` records the image tower only. A hook on `attend` sees the text
    attention [T, H, C, C]; without one a fused `scaled_dot_product_attention` runs.
    """

    def __init__(self, *, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.scale = (width // heads) ** -0.5
        self.qkv = nn.Linear(width, 3 * width)
        self.attend = nn.Softmax(dim=-1)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """[T, C, D] (mask [T or 1, 1, C, C]) -> [T, C, D]."""
        q, k, v = rearrange(self.qkv(x), "t c (three h d) -> three t h c d", three=3, h=self.heads)
        if self.attend._forward_hooks or self.attend._forward_pre_hooks:
            logits = (q @ k.transpose(-2, -1)) * self.scale
            attn = self.attend(logits if mask is None else logits + mask)  # [T, H, C, C], rows sum to 1
            out = attn @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(rearrange(out, "t h c d -> t c (h d)"))


class TextBlock(nn.Module):
    """Pre-norm Transformer block under a mask: x + MSA(LN(x)), then x + MLP(LN(x)); the parameters
    are named as in `vitviz.model.EncoderBlock`."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        c = config
        self.norm1 = nn.LayerNorm(c.width, eps=c.eps)
        self.attn = TextAttention(width=c.width, heads=c.heads)
        self.norm2 = nn.LayerNorm(c.width, eps=c.eps)
        self.mlp = nn.Sequential(nn.Linear(c.width, c.mlp_dim), _activation(c.act), nn.Linear(c.mlp_dim, c.width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class TextTower(nn.Module):
    """The text encoder of an image–text model, built from a `TextConfig`: token ids [T, C] -> one
    embedding per text [T, E]."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = c = config
        self.token_embed = nn.Embedding(c.vocab_size, c.width)
        self.pos_embed = nn.Parameter(torch.empty(1, c.context_length, c.width).normal_(std=0.01))
        self.blocks = nn.ModuleList(TextBlock(c) for _ in range(c.depth))
        self.norm = nn.LayerNorm(c.width, eps=c.eps)
        self.proj = nn.Linear(c.width, c.embed_dim, bias=c.proj_bias)
        nn.init.normal_(self.token_embed.weight, std=0.02)

    def _check(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        c = self.config
        if input_ids.ndim != 2 or not 0 < input_ids.shape[1] <= c.context_length:
            raise ValueError(f"expected token ids of shape [T, C] with 1 <= C <= {c.context_length}, got {list(input_ids.shape)}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"the attention mask is {list(attention_mask.shape)}, the token ids {list(input_ids.shape)}: they must match")

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Every token after the last block and the final norm: [T, C] -> [T, C, D].

        Args:
            attention_mask: [T, C], 1 for a token, 0 for padding (never attended to).
        """
        self._check(input_ids, attention_mask)
        n = input_ids.shape[1]
        x = self.token_embed(input_ids) + self.pos_embed[:, :n]
        mask = text_mask(attention_mask, length=n, causal=self.config.causal, dtype=x.dtype, device=x.device)
        for block in self.blocks:
            x = block(x, mask)
            steps.step()
        return self.norm(x)

    def pool_index(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The position each text is read at [T] (`TextConfig.pool`, `TextConfig.eos_token_id`)."""
        c = self.config
        if c.pool == "last":
            return torch.full(input_ids.shape[:1], input_ids.shape[1] - 1, dtype=torch.long, device=input_ids.device)
        if c.eos_token_id is None:
            return input_ids.argmax(dim=-1)  # the end-of-text token has the highest id
        is_eos = input_ids == c.eos_token_id
        if not bool(is_eos.any(dim=-1).all()):
            raise ValueError(f"every text must hold the end-of-text token {c.eos_token_id} (the tokenizer adds it): "
                             f"rows {is_eos.any(dim=-1).logical_not().nonzero().flatten().tolist()} do not")
        return is_eos.int().argmax(dim=-1)  # the first one (padding may be the same token)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The projected text embeddings (not normalised): [T, C] -> [T, E]."""
        tokens = self.encode(input_ids, attention_mask)
        pooled = tokens[torch.arange(tokens.shape[0], device=tokens.device), self.pool_index(input_ids)]
        return self.proj(pooled)


class ImageTextModel(nn.Module):
    """An image tower (a vitviz `ViT` without a head) and a text tower scoring images against texts.

    Args:
        vision: the image tower's architecture (num_classes 0: its forward is the pooled features).
        text: the text tower's architecture; its `embed_dim` is the shared embedding's width E.
        image_projection: a linear map (no bias) from the image tower's width to E; without one the
            pooled features are the embedding (their width must be E).
        logit_bias: a learned bias added to the logits.
        logit_scale: the initial log of the logits' scale (CLIP's: log(1 / 0.07)).

    Attributes:
        image: the image tower, a vitviz ViT (`record_attention`, `analyze` and its spec apply).
        image_projection: [D] -> [E], or the identity.
        text: the `TextTower`.
        logit_scale: log of the factor the cosines are multiplied by (a 0-d parameter).
        logit_bias: added to the logits, or None.
        tokenizer: the text tokenizer (a Hugging Face tokenizer) where the model was loaded with one
            (`vitviz.load_model("hf:...")`), else None: `tokenize` needs it.
        labels: the label set of zero-shot classification when none is given (`vitviz.analyze`):
            the shapes classes for `shapes_clip`, ImageNet's 1,000 classes for a model from the hub,
            None for a model built here (no zero-shot predictions unless labels are given).
        template: the prompt each label is put in ("a photo of a {}").
        spec: the image tower's `VariantSpec` (no classes); the same object as `model.image.spec`.
    """

    def __init__(
        self,
        vision: ViTConfig,
        text: TextConfig,
        *,
        image_projection: bool = True,
        logit_bias: bool = False,
        logit_scale: float = math.log(1 / 0.07),
    ) -> None:
        super().__init__()
        if vision.num_classes:
            raise ValueError(f"the image tower of an image–text model has no head (num_classes 0), got {vision.num_classes}")
        if not image_projection and vision.width != text.embed_dim:
            raise ValueError(f"without an image projection the image tower's width {vision.width} must be the embedding's {text.embed_dim}")
        self.image = ViT(vision)
        self.image_projection = nn.Linear(vision.width, text.embed_dim, bias=False) if image_projection else nn.Identity()
        self.text = TextTower(text)
        self.logit_scale = nn.Parameter(torch.tensor(float(logit_scale)))
        self.logit_bias = nn.Parameter(torch.tensor(0.0)) if logit_bias else None
        self.tokenizer: Any = None
        self.labels: tuple[str, ...] | None = None
        self.template: str = DEFAULT_TEMPLATE
        self._label_cache: dict[tuple, torch.Tensor] = {}

    @property
    def spec(self) -> VariantSpec | None:
        return self.image.spec

    @spec.setter
    def spec(self, spec: VariantSpec | None) -> None:
        self.image.spec = spec

    @property
    def embed_dim(self) -> int:
        """E, the width of the shared embedding."""
        return self.text.config.embed_dim

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        """The image embeddings, projected and not normalised (as Hugging Face's
        `get_image_features`): [B, 3, H, W] -> [B, E]."""
        return self.image_projection(self.image.forward_features(images))

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The text embeddings, projected and not normalised (as Hugging Face's `get_text_features`):
        token ids [T, C] (attention_mask [T, C], 0 for padding) -> [T, E]."""
        return self.text(input_ids, attention_mask)

    def logits(self, image_embeds: torch.Tensor, text_embeds: torch.Tensor) -> torch.Tensor:
        """exp(logit_scale) * cos(image, text) (+ logit_bias): [B, E] and [T, E] -> logits_per_image [B, T]."""
        image_embeds = F.normalize(image_embeds, dim=-1)
        text_embeds = F.normalize(text_embeds, dim=-1)
        out = self.logit_scale.exp() * image_embeds @ text_embeds.T
        return out if self.logit_bias is None else out + self.logit_bias

    def forward(self, images: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """logits_per_image [B, T]: each image [B, 3, H, W] against each text [T, C]."""
        return self.logits(self.encode_image(images), self.encode_text(input_ids, attention_mask))

    def tokenize(self, texts: Sequence[str] | str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Texts -> (input_ids [T, C], attention_mask [T, C] or None where the tokenizer gives none), on
        the model's device: padded to the longest text (to the context length for a tower that reads
        the last position), cut at the context length.

        Raises:
            RuntimeError: the model has no tokenizer.
        """
        if self.tokenizer is None:
            raise RuntimeError(
                "this image–text model has no tokenizer (it was built from configs or converted from a model instance): "
                "set model.tokenizer = transformers.AutoTokenizer.from_pretrained(<its repo id>), or pass token ids to "
                "encode_text / forward"
            )
        texts = [texts] if isinstance(texts, str) else list(texts)
        c = self.text.config
        padding = "max_length" if c.pool == "last" else True
        out = self.tokenizer(texts, padding=padding, truncation=True, max_length=c.context_length, return_tensors="pt")
        device = self.logit_scale.device
        mask = out.get("attention_mask")
        return out["input_ids"].to(device), None if mask is None else mask.to(device)

    def label_embeddings(self, labels: Sequence[str], template: str | None = None) -> torch.Tensor:
        """The normalised text embeddings of the template with each label in its "{}" [K, E], computed
        without gradients in batches of 256 and kept for the next call with the same labels (the
        last 4 label sets are kept)."""
        labels, template = _checked_labels(labels, self.template if template is None else template)
        key = (labels, template, self.logit_scale.device, self.logit_scale.dtype)
        if key not in self._label_cache:
            with torch.no_grad():
                parts = [self.encode_text(*self.tokenize([template.replace("{}", x) for x in labels[i : i + 256]]))
                         for i in range(0, len(labels), 256)]
            while len(self._label_cache) >= 4:
                self._label_cache.pop(next(iter(self._label_cache)))
            self._label_cache[key] = F.normalize(torch.cat(parts).float(), dim=-1)
        return self._label_cache[key]

    def zero_shot(self, image_embeds: torch.Tensor, labels: Sequence[str], template: str | None = None) -> torch.Tensor:
        """Zero-shot classification of image embeddings [B, E] over `labels`: probabilities [B, K].

        CLIP's: the softmax over the labels of logits_per_image (one label per image). A model with a
        logit bias (SigLIP, trained with a sigmoid loss) scores each label on its own: the sigmoid of
        each logit (they need not sum to 1), as its authors classify zero-shot.
        """
        text = self.label_embeddings(labels, template)
        logits = self.logit_scale.exp().float() * F.normalize(image_embeds.float(), dim=-1) @ text.T
        if self.logit_bias is not None:
            return (logits + self.logit_bias.float()).sigmoid()
        return logits.softmax(dim=-1)


def _checked_labels(labels: Sequence[str], template: str) -> tuple[tuple[str, ...], str]:
    """`labels` as a tuple of non-empty strings (at most `MAX_LABELS`) and a template with one "{}"."""
    if isinstance(labels, str) or not isinstance(labels, Sequence):
        raise TypeError(f"labels must be a list of strings, got {type(labels).__name__}")
    labels = tuple(labels)
    if not 1 <= len(labels) <= MAX_LABELS:
        raise ValueError(f"zero-shot classification takes 1 to {MAX_LABELS} labels, got {len(labels)}")
    if not all(isinstance(x, str) and x.strip() for x in labels):
        raise ValueError("every label must be a non-empty string")
    if not isinstance(template, str) or template.count("{}") != 1:
        raise ValueError(f'the prompt template must hold exactly one "{{}}" where the label goes, got {template!r}')
    return labels, template
