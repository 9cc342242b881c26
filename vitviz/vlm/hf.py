"""Hugging Face vision–language models as `vitviz.vlm.ask.VLM`s: Idefics3 and SmolVLM
(`Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`), Qwen2.5-VL
(`Qwen2_5_VLForConditionalGeneration`) and LLaVA (`LlavaForConditionalGeneration`).

    vlm = vitviz.vlm.hf.load_vlm("HuggingFaceTB/SmolVLM-256M-Instruct")   # the model and its processor
    answer = vitviz.ask(vlm, "photo.jpg", "what is in the picture?")
    vitviz.ask(model, image, question)    # a transformers model in hand, with its processor as `model.processor`

The prompt is the processor's own: its chat template when it has one (one user turn holding the image,
then the question; `add_generation_prompt=True`), else the image placeholder followed by the question
("<image>what is ...", Qwen2.5-VL's "<|vision_start|><|image_pad|><|vision_end|>what is ..."). Idefics3
and SmolVLM run with image splitting off (`do_image_splitting=False`): the tower sees the whole image once,
resized to the square `max_image_size`, so that the image tokens form one grid.

The image tokens are the positions of the model's image token id in the prompt, which the model fills
with the connector's outputs in order; in each family that order is row-major over the merged grid:

- Idefics3 / SmolVLM: the tower's patches are row-major; the pixel shuffle puts each `scale_factor` x
  `scale_factor` block of patches into one token, row-major over the blocks. `merge` = `scale_factor`.
- Qwen2.5-VL: the processor orders the patches by 2 x 2 merge unit, (t, h/2, w/2) row-major, each unit's
  four patches inside; the tower's window attention reorders them and puts them back after its
  `PatchMerger`, one token per unit. `merge` = `spatial_merge_size`.
- LLaVA: one token per patch, row-major (the cls token dropped by the "default" feature select; with
  "full" and a tower with a cls token, the cls token's image position is left out of the grid). `merge` = 1.

`Prompt.image` is what the tower saw: the pixel values with the processor's normalisation undone
(Qwen2.5-VL's patches put back on their grid), as uint8.

An adapter made for a vitviz tower (`hf_vlm(model, processor, tower=..., follow=True)`, as
`vitviz.load_model` makes it) moves its model to the tower's device and dtype whenever a prompt is
made and they differ: `load_model` moves the tower alone, and the model (which holds its own copy of
the tower's weights) follows on its first question.

The language model's attention comes from the model's eager attention (`output_attentions=True`): the
softmax each layer multiplies the values with. A model loaded with another implementation (sdpa, flash)
is switched to eager for the duration of `forward` only and switched back after (`set_attn_implementation`
on its configs), so another thread using the same model meanwhile would run eager too; `generate` runs the
model as it is. When none of the model's parameters requires a gradient, `forward` makes the input
embeddings require one, so that the attention is still in the autograd graph.

A token's text (`piece`) is what it adds after a plain token: the tokenizer's decoding of ["a", token]
with the decoding of ["a"] taken off, so a token that starts a word keeps its leading space whichever
way the tokenizer marks it ("Ġ", "▁" or a word-level join).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from vitviz.vlm.protocol import VLM, AskShape, Prompt

__all__ = ["HF_VLM_TYPES", "HFVLM", "hf_vlm", "load_vlm", "eager_attention"]

# model type -> the transformers class `hf_vlm` takes
HF_VLM_TYPES: dict[str, str] = {
    "idefics3": "Idefics3ForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
}
_PROCESSORS = {"idefics3": "Idefics3Processor", "smolvlm": "SmolVLMProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
               "llava": "LlavaProcessor"}
_SUPPORTED = "Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration, Qwen2_5_VLForConditionalGeneration or LlavaForConditionalGeneration"
_SEQUENCE_INPUTS = {"attention_mask": 1, "mm_token_type_ids": 0, "token_type_ids": 0}  # per-token inputs and the value of a generated token


def _transformers():
    from vitviz.sources.hf_common import _transformers as imported

    return imported()


def _family(model: Any) -> str:
    """The model type of a supported transformers VLM, or a TypeError."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    transformers = _transformers() if kind in HF_VLM_TYPES else None
    cls = getattr(transformers, HF_VLM_TYPES[kind], None) if transformers is not None else None
    if cls is None or not isinstance(model, cls):
        raise TypeError(f"vitviz asks a Hugging Face {_SUPPORTED}; got a {type(model).__name__}"
                        f"{f' ({kind})' if kind else ''}")
    return kind


def _configs(model: nn.Module) -> list[Any]:
    """Every config of `model`: its own, their sub-configs, and those of its sub-models."""
    found: dict[int, Any] = {}
    todo = [m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "_attn_implementation")]
    while todo:
        config = todo.pop()
        if id(config) in found:
            continue
        found[id(config)] = config
        for key in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, key, None)
            if sub is not None and hasattr(sub, "_attn_implementation"):
                todo.append(sub)
    return list(found.values())


@contextlib.contextmanager
def eager_attention(model: nn.Module) -> Iterator[None]:
    """`model` on transformers' eager attention inside the block, on the implementation it had after it."""
    configs = _configs(model)
    if all(c._attn_implementation == "eager" for c in configs):
        yield
        return
    before = [(c, getattr(c, "_attn_implementation_internal", None)) for c in configs]
    try:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("eager")
        else:
            for c in configs:
                c._attn_implementation_internal = "eager"
        yield
    finally:
        for c, value in before:
            c._attn_implementation_internal = value


@contextlib.contextmanager
def _embeddings_require_grad(model: nn.Module) -> Iterator[None]:
    """With gradients on and no parameter requiring one: the input embeddings require one inside the block."""
    if not torch.is_grad_enabled() or any(p.requires_grad for p in model.parameters()):
        yield
        return

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output if output.requires_grad else output.detach().requires_grad_(True)

    handle = model.get_input_embeddings().register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _pil(image: Any):
    from PIL import Image

    from vitviz.images import load_image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    return load_image(image).convert("RGB")


def _shown(pixels: torch.Tensor, image_processor: Any) -> np.ndarray:
    """Pixel values [3, H, W] as the processor made them -> the picture (uint8 [H, W, 3])."""
    x = pixels.detach().float().cpu()
    if getattr(image_processor, "do_normalize", True):
        mean = torch.tensor(list(_triple(getattr(image_processor, "image_mean", None) or 0.0)))[:, None, None]
        std = torch.tensor(list(_triple(getattr(image_processor, "image_std", None) or 1.0)))[:, None, None]
        x = x * std + mean
    if getattr(image_processor, "do_rescale", True):
        x = x / float(getattr(image_processor, "rescale_factor", None) or 1 / 255)
    return x.round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()


def _sized(value: Any) -> dict[str, int]:
    """An image processor's size (a dict, transformers' SizeDict, or one number) as a dict."""
    from vitviz.sources.hf_common import _size

    return _size(value, "height")


def _triple(value: Any) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    return tuple(float(v) for v in value)


class HFVLM(VLM):
    """A transformers VLM as `vitviz.ask` uses it (module docstring). `hf_vlm` makes the family's.

    Attributes:
        model: the transformers model.
        processor: its processor (tokenizer and image processor).
        family: its model type.
        eos_ids: the ids that end its generation (its generation config's, else its tokenizer's).
        follow: the model moves to the vitviz tower's device and dtype when a prompt is made
            (module docstring).
    """

    placeholder = "<image>"  # what stands for the image in a prompt without a chat template
    processor_kwargs: dict[str, Any] = {}

    def __init__(self, model: nn.Module, processor: Any, *, tower: nn.Module | None = None, follow: bool = False) -> None:
        self.model = model
        self.processor = processor
        self.family = model.config.model_type
        self.tokenizer = getattr(processor, "tokenizer", processor)
        text = getattr(model.config, "text_config", None) or model.config
        self.name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.layers = int(text.num_hidden_layers)
        self.heads = int(text.num_attention_heads)
        token = getattr(model.config, "image_token_id", None)
        self.image_token_id = int(token if token is not None else model.config.image_token_index)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]))
        self._tower: nn.Module | None = tower
        self._tower_done = tower is not None
        self.follow = bool(follow) and tower is not None
        anchor = self.tokenizer.encode("a", add_special_tokens=False)
        self._anchor = int(anchor[0]) if anchor else None

    @property
    def tower(self) -> nn.Module | None:
        """The vision tower as a vitviz model (`vitviz.from_transformers`, converted on first use), or
        None where vitviz does not convert this family's tower."""
        if not self._tower_done:
            from vitviz.sources.hf_vlm import vision_tower

            try:
                self._tower = vision_tower(self.model, self.processor)
            except (NotImplementedError, ValueError):
                self._tower = None
            if self._tower is not None:  # the tower holds this adapter
                self._tower.spec = dataclasses.replace(self._tower.spec, vlm=self.family)
                self._tower.__dict__["vlm"] = self
            self._tower_done = True
        return self._tower

    def _follow_tower(self) -> None:
        """With `follow`: the model's parameters on the tower's device and dtype; its float32 buffers
        (rotary frequencies) stay float32, as transformers keeps them in a half-precision model."""
        if not self.follow:
            return
        want = next(self._tower.parameters(), None)
        have = next(self.model.parameters(), None)
        if want is None or have is None or (have.device, have.dtype) == (want.device, want.dtype):
            return
        kept = [(m, k, b) for m in self.model.modules() for k, b in m._buffers.items() if b is not None and b.dtype == torch.float32]
        self.model.to(device=want.device, dtype=want.dtype)
        for module, key, buffer in kept:
            module._buffers[key] = buffer.to(want.device)

    @property
    def parameters_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _device_dtype(self) -> tuple[torch.device, torch.dtype]:
        p = next(self.model.parameters())
        return p.device, p.dtype

    def _inputs(self, pil: Any, question: str) -> dict[str, Any]:
        """The processor's inputs for one image and question (module docstring)."""
        if getattr(self.processor, "chat_template", None):
            messages = [{"role": "user", "content": [{"type": "image", "image": pil}, {"type": "text", "text": question}]}]
            out = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                     return_tensors="pt", processor_kwargs=dict(self.processor_kwargs))
        else:
            out = self.processor(text=[self.placeholder + question], images=[pil], return_tensors="pt", **self.processor_kwargs)
        device, dtype = self._device_dtype()
        return {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) if isinstance(v, torch.Tensor) else v
                for k, v in dict(out).items()}

    def _layout(self, inputs: dict[str, Any], count: int) -> tuple[tuple[int, int], int, np.ndarray, slice]:
        """The image tokens' grid, the merge, the picture the tower saw, and which of the `count`
        image positions lie on the grid."""
        raise NotImplementedError

    def _most_image_tokens(self) -> int:
        """The most image tokens the processor puts in a prompt."""
        raise NotImplementedError

    def ask_shape(self, question: str, max_new_tokens: int) -> AskShape:
        """What `ask` runs (`vitviz.vlm.ask.AskShape`), from the configs, the processor's settings and
        the question's tokens: the prompt at most its text's tokens, the image tokens and three more
        (Idefics3's tokens around the image); the language model's blocks and output layer. Qwen2.5-VL's
        image tokens depend on the image's size: the most its processor's `max_pixels` allow."""
        text_config = getattr(self.model.config, "text_config", None) or self.model.config
        if getattr(self.processor, "chat_template", None):
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
            text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            text = self.placeholder + question
        image_tokens = self._most_image_tokens()
        decoder, head = self.model.get_decoder(), self.model.get_output_embeddings()
        params = sum(p.numel() for p in decoder.layers.parameters()) + head.weight.numel()
        return AskShape(layers=self.layers, heads=self.heads, width=int(text_config.hidden_size), mlp=int(text_config.intermediate_size),
                        vocab=int(text_config.vocab_size), params=params, image_tokens=image_tokens,
                        prompt_tokens=len(self.tokenizer(text)["input_ids"]) + image_tokens + 3, new_tokens=int(max_new_tokens), cache=True)

    def prompt(self, image: Any, question: str) -> Prompt:
        """The prompt for `question` about `image` (a path, PIL image or uint8 array), through the
        processor (module docstring)."""
        self._follow_tower()
        inputs = self._inputs(_pil(image), question)
        ids = inputs.pop("input_ids")[0]
        positions = (ids == self.image_token_id).nonzero().flatten()
        if positions.numel() == 0:
            raise ValueError(f"the processor put no image token (id {self.image_token_id}) in the prompt of {self.name}")
        grid, merge, shown, keep = self._layout(inputs, positions.numel())
        return Prompt(ids=ids, inputs=inputs, image_positions=positions[keep], token_grid=grid, merge=merge, image=shown)

    def _model_inputs(self, prompt: Prompt, length: int) -> dict[str, Any]:
        """The prompt's inputs for a sequence of `length` ids that starts with the prompt's: the
        per-token ones extended over the generated tokens (attended to, text)."""
        t = prompt.ids.numel()
        out = {}
        for k, v in prompt.inputs.items():
            if k in _SEQUENCE_INPUTS and isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == t and length != t:
                if length > t:
                    v = torch.cat([v, v.new_full((v.shape[0], length - t), _SEQUENCE_INPUTS[k])], dim=1)
                else:
                    v = v[:, :length]
            out[k] = v
        return out

    def forward(self, prompt: Prompt, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits [1, T', V] and the language model's attention at every layer [1, H, T', T'] over
        `ids` [1, T'] (the prompt's, then generated ones), on eager attention (module docstring)."""
        device, _ = self._device_dtype()
        ids = ids.to(device)
        inputs = self._model_inputs(prompt, ids.shape[1])
        with eager_attention(self.model), _embeddings_require_grad(self.model):
            out = self.model(input_ids=ids, **inputs, output_attentions=True, use_cache=False, return_dict=True)
        attentions = list(out.attentions or ())
        if len(attentions) != self.layers:
            raise RuntimeError(f"{self.name} returned {len(attentions)} attention maps for its {self.layers} layers")
        return out.logits, attentions

    def generate(self, prompt: Prompt, max_new_tokens: int) -> list[int]:
        """The model's own greedy generation (`generate(..., do_sample=False)`): the ids after the prompt."""
        ids = prompt.ids[None]
        out = self.model.generate(input_ids=ids, **prompt.inputs, max_new_tokens=max_new_tokens, do_sample=False)
        return [int(i) for i in out[0, ids.shape[1]:].tolist()]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def piece(self, token_id: int) -> str:
        """The text `token_id` adds after the plain token "a" (module docstring)."""
        if self._anchor is not None:
            before, both = self._decode([self._anchor]), self._decode([self._anchor, int(token_id)])
            if both.startswith(before):
                return both[len(before):]
        return self.tokenizer.convert_tokens_to_string([self.tokenizer.convert_ids_to_tokens(int(token_id))])


class _Idefics3(HFVLM):
    """Idefics3 / SmolVLM: one tile (image splitting off), pixel-shuffled."""

    processor_kwargs = {"do_image_splitting": False}

    def _layout(self, inputs: dict[str, Any], count: int) -> tuple[tuple[int, int], int, np.ndarray, slice]:
        pixels = inputs["pixel_values"]  # [1, images, 3, H, W]
        if pixels.dim() != 5 or pixels.shape[1] != 1:
            raise ValueError(f"{self.name}'s processor made {tuple(pixels.shape)} pixel values; one image of one tile is asked")
        p = int(self.model.config.vision_config.patch_size)
        r = int(self.model.config.scale_factor)
        h, w = pixels.shape[-2:]
        grid = (h // p // r, w // p // r)
        return grid, r, _shown(pixels[0, 0], self.processor.image_processor), slice(None)

    def _most_image_tokens(self) -> int:
        side = _sized(getattr(self.processor.image_processor, "max_image_size", None)).get("longest_edge")
        side = side or int(self.model.config.vision_config.image_size)
        return (side // int(self.model.config.vision_config.patch_size) // int(self.model.config.scale_factor)) ** 2


class _Qwen25(HFVLM):
    """Qwen2.5-VL: patches in merge-unit order, one token per 2 x 2 unit."""

    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"

    def _layout(self, inputs: dict[str, Any], count: int) -> tuple[tuple[int, int], int, np.ndarray, slice]:
        thw = inputs["image_grid_thw"]
        if thw.shape[0] != 1:
            raise ValueError(f"{self.name}'s processor made {thw.shape[0]} images; one is asked")
        t, gh, gw = (int(v) for v in thw[0])
        m = int(self.model.config.vision_config.spatial_merge_size)
        p = int(self.model.config.vision_config.patch_size)
        tp = int(self.model.config.vision_config.temporal_patch_size)
        # [t*gh*gw, 3*tp*p*p] in (t, gh/m, gw/m, m, m) order -> [3, gh*p, gw*p] of the first frame
        x = inputs["pixel_values"].reshape(t, gh // m, gw // m, m, m, 3, tp, p, p)[0, ..., 0, :, :]
        x = x.permute(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * p, gw * p)
        return (gh // m, gw // m), m, _shown(x, self.processor.image_processor), slice(None)

    def fit_pixels(self, area: int) -> None:
        """The processor bounded to `area` pixels an image (`max_pixels`, its size's "longest_edge"; the
        least, `min_pixels`, lowered to it where it was above): an image of that area or less keeps its
        size (rounded to multiples of a merge unit's pixels, 28 px), a larger one is shrunk to it, so that
        `ask_shape` prices what runs."""
        ip = self.processor.image_processor
        area = int(area)
        size = getattr(ip, "size", None)
        least = min(int(_sized(size).get("shortest_edge") or getattr(ip, "min_pixels", None) or area), area)
        if isinstance(size, dict):
            ip.size = dict(size, longest_edge=area, shortest_edge=least)
        elif dataclasses.is_dataclass(size):
            ip.size = dataclasses.replace(size, longest_edge=area, shortest_edge=least)
        else:
            ip.size = {"longest_edge": area, "shortest_edge": least}
        for attr, value in (("max_pixels", area), ("min_pixels", least)):
            if getattr(ip, attr, None) is not None:
                setattr(ip, attr, value)

    def _most_image_tokens(self) -> int:
        ip = self.processor.image_processor
        most = getattr(ip, "max_pixels", None) or _sized(getattr(ip, "size", None)).get("longest_edge")
        unit = int(self.model.config.vision_config.patch_size) * int(self.model.config.vision_config.spatial_merge_size)
        return int(most) // unit**2


class _Llava(HFVLM):
    """LLaVA: one token per patch."""

    def _layout(self, inputs: dict[str, Any], count: int) -> tuple[tuple[int, int], int, np.ndarray, slice]:
        pixels = inputs["pixel_values"]  # [1, 3, H, W]
        p = int(self.model.config.vision_config.patch_size)
        grid = (pixels.shape[-2] // p, pixels.shape[-1] // p)
        extra = count - grid[0] * grid[1]
        if extra not in (0, 1):
            raise ValueError(f"{self.name}'s prompt has {count} image tokens; its {grid[0]} x {grid[1]} patches make no grid of them")
        return grid, 1, _shown(pixels[0], self.processor.image_processor), slice(extra, None)

    def _most_image_tokens(self) -> int:
        ip = self.processor.image_processor
        crop = _sized(getattr(ip, "crop_size", None)) if getattr(ip, "do_center_crop", False) else {}
        size = _sized(getattr(ip, "size", None))
        h = crop.get("height") or size.get("height") or size.get("shortest_edge") or int(self.model.config.vision_config.image_size)
        w = crop.get("width") or size.get("width") or size.get("shortest_edge") or h
        p = int(self.model.config.vision_config.patch_size)
        extra = int(getattr(self.processor, "num_additional_image_tokens", 0) or 0)
        strategy = getattr(self.processor, "vision_feature_select_strategy", None) or self.model.config.vision_feature_select_strategy
        return (h // p) * (w // p) + extra - int(strategy == "default")


_ADAPTERS: dict[str, type[HFVLM]] = {"idefics3": _Idefics3, "smolvlm": _Idefics3, "qwen2_5_vl": _Qwen25, "llava": _Llava}


def hf_vlm(model: nn.Module, processor: Any = None, *, tower: nn.Module | None = None, follow: bool = False) -> HFVLM:
    """A transformers VLM as a `VLM` (module docstring), with `processor` (else the one attached as
    `model.processor`); a TypeError for a model of another class, a ValueError without a processor.

    Args:
        tower: the model's vision tower as a vitviz model (`HFVLM.tower`), when one is in hand.
        follow: the model moves to `tower`'s device and dtype when a prompt is made (module docstring).
    """
    family = _family(model)
    processor = processor if processor is not None else getattr(model, "processor", None)
    if processor is None:
        raise ValueError(f"asking a {type(model).__name__} needs its processor (a {_PROCESSORS[family]}): pass "
                         "hf_vlm(model, processor) or set model.processor")
    return _ADAPTERS[family](model, processor, tower=tower, follow=follow)


def load_vlm(repo: str, weights_path: str | Path | None = None) -> HFVLM:
    """A whole VLM and its processor as a `VLM` (`.model`, `.processor`), from the Hugging Face cache (or
    the hub when it is reachable and VITVIZ_OFFLINE / HF_HUB_OFFLINE are unset), or with `weights_path`
    from a folder saved with `save_pretrained` (the model's and the processor's files), read alone.

    Args:
        repo: a hub repository id ("org/name", an "hf:" prefix allowed), never a path; with
            `weights_path` only the model's name.
        weights_path: a folder saved with `save_pretrained`.
    """
    from vitviz.sources.base import WeightsUnavailableError
    from vitviz.sources.hf_common import _is_repo_id, _saved_folder
    from vitviz.sources.hub import cached_file, hub_offline, hub_reachable, missing_message

    transformers = _transformers()
    repo = str(repo).removeprefix("hf:")
    if not _is_repo_id(repo):
        raise ValueError(f"load_vlm takes a Hugging Face repository id such as HuggingFaceTB/SmolVLM-256M-Instruct, got {repo!r}; "
                         "a model saved on disk loads with load_vlm('<its repo id>', weights_path=<folder>)")
    hint = "with load_vlm: a folder saved with save_pretrained, the model's and the processor's"
    if weights_path is not None:
        source, local = str(_saved_folder(str(weights_path), f"hf:{repo}")), True
    else:
        source, local = repo, hub_offline() or not hub_reachable()
        if local and cached_file(repo, ("config.json",)) is None:
            why = "VITVIZ_OFFLINE or HF_HUB_OFFLINE is set" if hub_offline() else "huggingface.co cannot be reached"
            raise WeightsUnavailableError(missing_message(f"hf:{repo}", repo, why, weights_path_hint=hint))
    try:
        cfg = transformers.AutoConfig.from_pretrained(source, local_files_only=local)
        kind = getattr(cfg, "model_type", None)
        if kind not in HF_VLM_TYPES:
            raise ValueError(f"{repo} is a {kind} model; vitviz asks {_SUPPORTED}")
        model = getattr(transformers, HF_VLM_TYPES[kind]).from_pretrained(source, local_files_only=local).eval()
        processor = transformers.AutoProcessor.from_pretrained(source, local_files_only=local)
    except OSError as exc:
        if weights_path is not None:
            raise FileNotFoundError(f"hf:{repo}'s model or processor is missing from {source} ({type(exc).__name__}: {exc})") from exc
        raise WeightsUnavailableError(missing_message(f"hf:{repo}", repo, f"{type(exc).__name__}: {exc}", weights_path_hint=hint)) from exc
    return hf_vlm(model, processor)
