"""A word-level tokenizer over a fixed vocabulary: the text side of the embedded image–text model
`shapes_clip` (captions such as "a photo of a red star"), with no Hugging Face dependency.

It is called as a Hugging Face tokenizer is (`ImageTextModel.tokenize` calls it so):

    tokenizer = WordTokenizer()
    batch = tokenizer(["a red star", "a photo of a ring"], padding=True, truncation=True,
                      max_length=8, return_tensors="pt")
    batch["input_ids"], batch["attention_mask"]          # [T, C] each

Each text is lower-cased, split into words (anything but letters separates them), each word mapped
to its id (`UNKNOWN` where it is not in the vocabulary), and framed by `START` and `END`: the text
tower reads a text at its `END` token (`TextConfig(pool="eos", eos_token_id=END_ID)`, causal).
Padding is `PAD` (id 0) on the right, with attention mask 0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

import torch

from vitviz.shapes import CLASSES, COLORS

__all__ = ["VOCABULARY", "PAD", "START", "END", "UNKNOWN", "PAD_ID", "START_ID", "END_ID", "UNKNOWN_ID", "WordTokenizer"]

PAD, START, END, UNKNOWN = "<pad>", "<start>", "<end>", "<unknown>"
_FILLERS = ("a", "an", "the", "photo", "picture", "image", "of", "with", "and", "shape", "in")

VOCABULARY: tuple[str, ...] = (PAD, START, END, UNKNOWN, *_FILLERS, *COLORS, *CLASSES)
PAD_ID, START_ID, END_ID, UNKNOWN_ID = 0, 1, 2, 3

_WORD = re.compile(r"[a-z]+")


class WordTokenizer:
    """Texts -> token ids over `VOCABULARY` (module docstring).

    Attributes:
        vocabulary: the words, index = id.
        pad_token_id, bos_token_id, eos_token_id, unk_token_id: the special ids (Hugging Face's names).
    """

    vocabulary = VOCABULARY
    pad_token_id, bos_token_id, eos_token_id, unk_token_id = PAD_ID, START_ID, END_ID, UNKNOWN_ID

    def __init__(self) -> None:
        self._ids = {word: i for i, word in enumerate(self.vocabulary)}

    @property
    def vocab_size(self) -> int:
        return len(self.vocabulary)

    def __len__(self) -> int:
        return len(self.vocabulary)

    def encode(self, text: str) -> list[int]:
        """One text -> its ids, framed by the start and end tokens (never cut)."""
        words = _WORD.findall(text.lower())
        return [START_ID, *(self._ids.get(w, UNKNOWN_ID) for w in words), END_ID]

    def decode(self, ids: Sequence[int] | torch.Tensor, *, skip_special_tokens: bool = True) -> str:
        """Ids -> the words joined by spaces (without start, end and padding unless asked)."""
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        special = {PAD_ID, START_ID, END_ID}
        return " ".join(self.vocabulary[i] for i in ids if not (skip_special_tokens and i in special))

    def __call__(
        self,
        texts: str | Sequence[str],
        *,
        padding: bool | Literal["longest", "max_length"] = False,
        truncation: bool = False,
        max_length: int | None = None,
        return_tensors: Literal["pt"] | None = None,
    ) -> dict[str, torch.Tensor | list[list[int]]]:
        """Tokenizes texts as a Hugging Face tokenizer does.

        Args:
            texts: a text or a list of texts.
            padding: True / "longest" pads to the longest text, "max_length" to `max_length`.
            truncation: cut texts longer than `max_length` (the end token is kept as the last).
            max_length: the context length C.
            return_tensors: "pt" for tensors [T, C] (needs padding where lengths differ), None for lists.

        Returns:
            {"input_ids", "attention_mask"}.
        """
        texts = [texts] if isinstance(texts, str) else list(texts)
        rows = [self.encode(t) for t in texts]
        if truncation and max_length is not None:
            if max_length < 2:
                raise ValueError(f"max_length {max_length} leaves no room for the start and end tokens")
            rows = [r if len(r) <= max_length else r[: max_length - 1] + [END_ID] for r in rows]
        if padding in (True, "longest"):
            length = max((len(r) for r in rows), default=0)
        elif padding == "max_length":
            if max_length is None:
                raise ValueError('padding="max_length" needs max_length')
            length = max(max_length, max((len(r) for r in rows), default=0))
        elif padding is False:
            length = None
        else:
            raise ValueError(f'padding must be True, False, "longest" or "max_length", not {padding!r}')
        masks = [[1] * len(r) for r in rows]
        if length is not None:
            masks = [m + [0] * (length - len(m)) for m in masks]
            rows = [r + [PAD_ID] * (length - len(r)) for r in rows]
        if return_tensors is None:
            return {"input_ids": rows, "attention_mask": masks}
        if return_tensors != "pt":
            raise ValueError(f'return_tensors must be "pt" or None, not {return_tensors!r}')
        if len({len(r) for r in rows}) > 1:
            raise ValueError("texts of different lengths make a tensor only with padding=True or \"max_length\"")
        return {"input_ids": torch.tensor(rows, dtype=torch.long), "attention_mask": torch.tensor(masks, dtype=torch.long)}
