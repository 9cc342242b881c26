"""What the Hugging Face modules of vitviz share, below all of them: transformers imported with a clear
error, an image processor's size read, a hub repository id checked, a `save_pretrained` folder found.
`vitviz.sources.hf` (the weights source) and `vitviz.vlm.hf` (asking a VLM) both stand on it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

__all__ = ["_transformers", "_size", "_is_repo_id", "_saved_folder", "_NOT_A_REPO"]


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("Hugging Face models need transformers: pip install 'vitviz[hf]' (or pip install transformers)") from None
    return transformers


def _size(value: Any, key: str) -> dict[str, int]:
    """An image processor's size (a dict, transformers' SizeDict, or one number) as a dict."""
    if value is None:
        return {}
    if isinstance(value, (int, float)):
        return {key: int(value), "width": int(value)} if key == "height" else {key: int(value)}
    keys = ("height", "width", "shortest_edge", "longest_edge")
    get = value.get if isinstance(value, dict) else (lambda k: getattr(value, k, None))
    return {k: int(get(k)) for k in keys if get(k)}


def _saved_folder(weights_path: str, name: str) -> Path:
    """`weights_path` as a folder saved with `save_pretrained` (absolute), or a clear error."""
    folder = Path(weights_path).expanduser().absolute()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"weights_path for {name} is a folder saved with save_pretrained (config.json beside the weights); {folder} "
            + ("has no config.json" if folder.is_dir() else "is not a folder")
        )
    return folder


_REPO_PART = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")
_NOT_A_REPO = (
    "hf:<repo id> takes a Hugging Face repository id such as google/vit-base-patch16-224 (an owner and a name, or a name: "
    "letters, digits, -, _ and ., at most 96 characters each), optionally with @<pixels>; a model saved on disk loads "
    "with load_model('hf:<its repo id>', weights_path=<folder>)"
)


def _is_repo_id(repo: str) -> bool:
    """Whether `repo` is a hub repository id: never a path, so nothing on this machine is looked up by it."""
    parts = repo.split("/")
    return len(parts) <= 2 and all(_REPO_PART.fullmatch(p) and ".." not in p and "--" not in p for p in parts)
