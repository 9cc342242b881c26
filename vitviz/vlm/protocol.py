"""A vision–language model as `vitviz.ask` uses it: `VLM` (a prompt from an image and a question,
the language model's logits with every layer's attention, greedy generation, token texts, the
shape of what one question runs), the `Prompt` it makes, and the `AskShape` a question is priced by.
The embedded model implements it in `vitviz.vlm.model`, Hugging Face's VLMs in `vitviz.vlm.hf`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["Prompt", "AskShape", "VLM"]


@dataclass
class Prompt:
    """One image and question, ready for the language model.

    Attributes:
        ids: the prompt's token ids [T] (long), image tokens included.
        inputs: the other inputs the model takes with them (pixel values, grids, masks).
        image_positions: the positions of the image tokens in `ids` [M], in row-major order of
            `token_grid`.
        token_grid: (rows, columns) of the image tokens as the language model sees them.
        merge: each image token covers merge x merge patches of the vision tower.
        image: the picture the vision tower saw (uint8 [H, W, 3]), for drawing maps over.
    """

    ids: torch.Tensor
    inputs: dict[str, Any]
    image_positions: torch.Tensor
    token_grid: tuple[int, int]
    merge: int
    image: np.ndarray

    def __post_init__(self) -> None:
        m = self.token_grid[0] * self.token_grid[1]
        if self.image_positions.numel() != m:
            raise ValueError(f"the prompt has {self.image_positions.numel()} image tokens; its grid "
                             f"{self.token_grid[0]} x {self.token_grid[1]} needs {m}")

    @property
    def patch_grid(self) -> tuple[int, int]:
        """The vision tower's patch grid under the image tokens."""
        return self.token_grid[0] * self.merge, self.token_grid[1] * self.merge


@dataclass(frozen=True)
class AskShape:
    """What one `ask` runs, for its price before it runs (`vitviz.cost.price(..., "ask", ask=...)`).

    Attributes:
        layers, heads, width, mlp, vocab: the language model's.
        params: the language model's parameters that multiply each token (its blocks and output
            layer; not the embedding table, which is looked up).
        image_tokens: the image tokens of the prompt (at most).
        prompt_tokens: the prompt's tokens, image tokens included (at most).
        new_tokens: the tokens to generate (at most).
        cache: generation keeps the keys and values (each new token runs alone); False: each step
            runs the whole sequence again.
    """

    layers: int
    heads: int
    width: int
    mlp: int
    vocab: int
    params: int
    image_tokens: int
    prompt_tokens: int
    new_tokens: int
    cache: bool = True

    @property
    def tokens(self) -> int:
        """The longest sequence: the prompt and the answer."""
        return self.prompt_tokens + self.new_tokens


class VLM(ABC):
    """A vision–language model as `ask` uses it: a prompt from an image and a question, the
    language model's logits with every layer's attention, greedy generation, token texts.

    Attributes:
        name: the model's name.
        tower: its vision tower as a vitviz model (every other view reads it), or None.
        layers, heads: the language model's.
    """

    name: str = "vlm"
    tower: nn.Module | None = None
    layers: int = 0
    heads: int = 0

    @abstractmethod
    def prompt(self, image: Any, question: str) -> Prompt:
        """The prompt for `question` about `image` (a path, PIL image or array)."""

    @abstractmethod
    def forward(self, prompt: Prompt, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The language model over `ids` [1, T'] (the prompt's ids, then generated ones):
        logits [1, T', V] and every layer's attention [1, H, T', T'] (in the autograd graph when
        gradients are on: the tensors the layers multiply the values with)."""

    @abstractmethod
    def generate(self, prompt: Prompt, max_new_tokens: int) -> list[int]:
        """The greedy answer's ids (the end token included when it came)."""

    @abstractmethod
    def piece(self, token_id: int) -> str:
        """The text of one token, as it reads in the answer (a leading space kept)."""

    @abstractmethod
    def ask_shape(self, question: str, max_new_tokens: int) -> AskShape:
        """What `ask` of `question` would run, from the model's facts and the question's length
        alone (nothing runs): its price."""
