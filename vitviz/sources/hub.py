"""What the timm and Hugging Face sources share: the Hugging Face hub's cache and its offline switches.

Weights live in the hub's own cache (`$HF_HOME/hub`, `huggingface_hub`'s rules); `HF_HUB_OFFLINE=1`
or `VITVIZ_OFFLINE=1` means no download is tried. Without a cached copy and without a network the
hub client retries for about a minute, so a source looks first and says at once what to do.
"""

from __future__ import annotations

import os
import socket

__all__ = ["cached_file", "hub_offline", "hub_reachable", "missing_message"]


def hub_offline() -> bool:
    return bool(os.environ.get("VITVIZ_OFFLINE")) or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def hub_reachable(timeout: float = 1.5) -> bool:
    """Whether huggingface.co answers now (False when offline is asked for)."""
    if hub_offline():
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://", 1)[-1].split("/", 1)[0]
    host, _, port = endpoint.partition(":")
    try:
        with socket.create_connection((host, int(port or 443)), timeout=timeout):
            return True
    except OSError:
        return False


def cached_file(repo_id: str, filenames: tuple[str, ...]) -> str | None:
    """The path of the first of `filenames` in `repo_id` that the local hub cache holds, or None."""
    from huggingface_hub import try_to_load_from_cache

    for name in filenames:
        path = try_to_load_from_cache(repo_id=repo_id, filename=name)
        if isinstance(path, str):
            return path
    return None


def missing_message(name: str, repo_id: str, reason: str, *, weights_path_hint: str) -> str:
    from huggingface_hub.constants import HF_HUB_CACHE

    return (
        f"Weights for {name} are not in the Hugging Face cache and cannot be downloaded ({reason}): on a machine "
        f"with network run `hf download {repo_id}` (or `huggingface-cli download {repo_id}`) and copy its "
        f"models--{repo_id.replace('/', '--')} folder into {HF_HUB_CACHE} (set $HF_HOME to use another cache), "
        f"or pass weights_path= to load_model ({weights_path_hint})."
    )
