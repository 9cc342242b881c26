"""The folder a training writes (`python -m vitviz.concepts train ... --out DIR`), and reading it back.

    DIR/sae.safetensors     W_enc [F, D], b_enc [F], W_dec [D, F], b_dec [D] (float32)
    DIR/card.json           what was trained on what, how, and how well (`CARD_KEYS`)
    DIR/index.safetensors   top_values float32 [F, n], top_images int64 [F, n] (into card["images"], -1 where
                            fewer), top_tokens int64 [F, n] (the token's index in the model's order: prefix
                            tokens, then the patches row by row), class_means float32 [F, C] (without
                            classes: absent), frequency float32 [F]
    DIR/thumbs.png          the atlas: row f, column j = feature f's j-th strongest token, the model's input
                            crop of the 3 x 3 patches around its patch (the centre one outlined), `thumb` px a
                            side; blank where fewer

Each file is written whole or not at all (a temporary name, then `os.replace`); card.json last, so a
folder with a card is a finished one. safetensors (`pip install safetensors`, or vitviz[concepts]) is
imported only here, when a folder is written or read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from PIL import Image

from vitviz.concepts.sae import TopKSAE

__all__ = ["save_concepts", "read_concepts", "CARD_KEYS", "INDEX_KEYS", "ConceptsFolderError", "atlas_cell"]

CARD_KEYS = ("model", "layer", "tokens", "d_in", "features", "k", "seed", "data", "metrics", "top_n", "classes", "images", "thumb",
             "steps", "tokens_seen", "seconds", "command")
INDEX_KEYS = ("top_values", "top_images", "top_tokens", "frequency")  # and "class_means" with classes
SAE_KEYS = ("W_enc", "b_enc", "W_dec", "b_dec")


class ConceptsFolderError(ValueError):
    """A folder that is not (or not wholly) what `save_concepts` writes; the message says what is wrong."""


def _safetensors():
    try:
        from safetensors import torch as st
    except ImportError:
        raise ImportError("reading and writing a concepts folder needs safetensors: pip install safetensors "
                          "(or pip install 'vitviz[concepts]')") from None
    return st


def _replace(path: Path, write) -> None:
    """`write(temporary path)`, then the file moved to `path` at once."""
    part = path.with_name(path.name + ".part")
    write(part)
    os.replace(part, path)


def atlas_cell(atlas: Image.Image, feature: int, j: int, thumb: int) -> Image.Image:
    """The thumbnail of `feature`'s j-th strongest token: the atlas' cell at row `feature`, column `j`."""
    return atlas.crop((j * thumb, feature * thumb, (j + 1) * thumb, (feature + 1) * thumb))


def save_concepts(dir: str | os.PathLike, sae: TopKSAE, card: dict, index: dict[str, torch.Tensor], thumbs: Image.Image) -> None:
    """Writes the folder (the module's doc): the SAE's weights, the index, the atlas, then the card.

    Raises:
        ConceptsFolderError: a card without a key of `CARD_KEYS`, an index without a key of
            `INDEX_KEYS` or of another shape, an atlas that is not F x n cells of `thumb` px.
    """
    st = _safetensors()
    folder = Path(dir)
    missing = [key for key in CARD_KEYS if key not in card]
    if missing:
        raise ConceptsFolderError(f"the card lacks {', '.join(missing)}")
    _check_index(index, sae, card)
    _check_atlas(thumbs.size, card)
    folder.mkdir(parents=True, exist_ok=True)
    weights = {name: getattr(sae, name).detach().to("cpu", torch.float32).contiguous() for name in SAE_KEYS}
    _replace(folder / "sae.safetensors", lambda p: st.save_file(weights, str(p)))
    tensors = {name: t.detach().cpu().contiguous() for name, t in index.items()}
    _replace(folder / "index.safetensors", lambda p: st.save_file(tensors, str(p)))
    _replace(folder / "thumbs.png", lambda p: thumbs.convert("RGB").save(p, format="PNG"))
    _replace(folder / "card.json", lambda p: p.write_text(json.dumps(card, indent=1)))


def _check_index(index: dict[str, torch.Tensor], sae: TopKSAE, card: dict) -> None:
    f, n = sae.features, card["top_n"]
    classes = card["classes"]
    want = {"top_values": ((f, n), torch.float32), "top_images": ((f, n), torch.int64), "top_tokens": ((f, n), torch.int64),
            "frequency": ((f,), torch.float32)}
    if classes is not None:
        want["class_means"] = ((f, len(classes)), torch.float32)
    unexpected = sorted(set(index) - set(want))
    if unexpected:
        raise ConceptsFolderError(f"the index holds {', '.join(unexpected)}, which it does not keep"
                                  + (" (class_means is kept with classes only)" if "class_means" in unexpected else ""))
    for key, (shape, dtype) in want.items():
        if key not in index:
            raise ConceptsFolderError(f"the index lacks {key} ({dtype} {list(shape)})")
        t = index[key]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ConceptsFolderError(f"the index's {key} is {t.dtype} {list(t.shape)}, not {dtype} {list(shape)}")


def _check_atlas(size: tuple[int, int], card: dict) -> None:
    want = (card["top_n"] * card["thumb"], card["features"] * card["thumb"])
    if tuple(size) != want:
        raise ConceptsFolderError(f"the atlas is {size[0]}x{size[1]} px, not {want[0]}x{want[1]} ({card['features']} rows of "
                                  f"{card['top_n']} thumbnails of {card['thumb']} px)")


def read_concepts(dir: str | os.PathLike) -> tuple[TopKSAE, dict, dict[str, torch.Tensor], Image.Image]:
    """A folder written by `save_concepts` (a finished training): (the SAE, on the CPU, in eval mode;
    the card; the index {name: tensor}; the atlas, an RGB image).

    Raises:
        ConceptsFolderError: a folder without a card (not a concepts folder, or a training not
            finished), or whose files do not agree with it.
    """
    st = _safetensors()
    folder = Path(dir)
    card_path = folder / "card.json"
    if not card_path.is_file():
        why = ("its training has not finished: python -m vitviz.concepts train ... --resume goes on"
               if (folder / "checkpoint.pt").is_file() else "train one with python -m vitviz.concepts train DATA --model NAME "
               "--layer L --features F --k K --out DIR")
        raise ConceptsFolderError(f"{folder} holds no card.json, so it is no concepts folder: {why}")
    try:
        card = json.loads(card_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConceptsFolderError(f"{card_path} cannot be read ({exc})") from None
    missing = [key for key in CARD_KEYS if key not in card] if isinstance(card, dict) else list(CARD_KEYS)
    if missing:
        raise ConceptsFolderError(f"{card_path} is not a concepts card (it lacks {', '.join(missing)})")
    for name in ("sae.safetensors", "index.safetensors", "thumbs.png"):
        if not (folder / name).is_file():
            raise ConceptsFolderError(f"{folder} lacks {name}: the folder is not whole; train it again")
    weights = st.load_file(str(folder / "sae.safetensors"))
    d, f = card["d_in"], card["features"]
    shapes = {"W_enc": (f, d), "b_enc": (f,), "W_dec": (d, f), "b_dec": (d,)}
    for name, shape in shapes.items():
        if name not in weights or tuple(weights[name].shape) != shape:
            got = "nothing" if name not in weights else list(weights[name].shape)
            raise ConceptsFolderError(f"{folder / 'sae.safetensors'}: {name} is {got}, the card says {list(shape)}")
    sae = TopKSAE(d, f, card["k"])
    with torch.no_grad():
        for name in SAE_KEYS:
            getattr(sae, name).copy_(weights[name].float())
    index = st.load_file(str(folder / "index.safetensors"))
    _check_index(index, sae, card)
    atlas = Image.open(folder / "thumbs.png")
    _check_atlas(atlas.size, card)  # from the header, before the pixels are decoded
    atlas = atlas.convert("RGB")
    return sae.eval(), card, index, atlas
