"""The explorer's data, as the browser holds it, and the one rule both sides draw it by.

Every row of attention a view can show — layer l, head h (the heads, then their mean and their
max), query q (`Analysis.query_names`, then the patches: for a pooled model the "pool" row, the mean
of the patch tokens' rows, sits after the prefix tokens'), over the patch keys — is kept as 8 bits
relative to the row's own maximum:
q8 = floor(a / max x 255 + 1/2), read back as q8 x max / 255. A view's heat is then coloured by
`vitviz.plots.heat_indices` and blended by `vitviz.plots.overlay_many`'s integer rule. The server's
views (`vitviz.server.pictures.views`) and the browser's (`explorer.js`) do exactly this, in float64, so the
two give the same pixels for the same view.

What the browser gets, per analysis, in one binary file (little-endian):

    float32 shared_max[Q]                       the largest weight query q gives a patch, any layer or head
    then per layer: float32 row_max[H + 2, Q]   each row's maximum
                    uint8   rows[H + 2, Q, M]   the rows, 8 bits each

(Q = `Analysis.num_queries`: N, or N + 1 with the pooled query.)

And two pictures, written from the crop before the forward (`write_pictures`), each as `rgb_file`:
uint32 width, uint32 height, then uint8 RGB rows. "base" is the crop the model sees; the browser
shows each of its pixels `scale` x `scale` times, as `vitviz.server.pictures.views.display_of` does.
"tile_base" is the crop at a mosaic tile's size. Raw rows cost the server no encoding and the
browser no decoding, on the way to the first view.

All layers in one file when that fits in the browser's budget (`vitviz.cost.BROWSER_BYTES`; ViT-B/16:
6.5 MB); otherwise one file per layer, fetched when the layer is shown (when one layer fits; DINO S/8:
4.9 MB a layer); otherwise the views are the server's (ViT-H/14 at 518 px: 34 MB a layer). The rule is
`vitviz.cost.explorer_layout`, the one `vitviz.cost.price` goes by.
"""

from __future__ import annotations

import base64
import functools
import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vitviz.analysis import pooled_row, query_row, with_pooled_query
from vitviz.cost import ExplorerLayout, explorer_layout
from vitviz.pipeline import Analysis
from vitviz.plots import CMAP, lut

__all__ = ["layout_of", "fused_rows", "query_rows",
           "quantise_rows", "dequantise", "row_values", "shared_max", "layer_block", "block_of", "stack_file",
           "StackStream", "value_of", "write_payload", "PICTURES", "picture_path", "pictures_bytes", "rgb_file",
           "read_rgb_file", "write_pictures", "first_shown", "layer_path", "write_layer", "mosaic_tile_px", "mosaic_tile", "widget_files"]

_BILINEAR = Image.BILINEAR


def mosaic_tile(grid: tuple[int, int], target: int = 160) -> tuple[int, int]:
    """A mosaic tile's (width, height): its longer side near `target` px, each side a multiple of
    the patch grid's (k px a patch), so that the grid divides it and it keeps the image's shape."""
    gh, gw = grid
    k = max(1, -(-target // max(gh, gw)))
    return gw * k, gh * k


def mosaic_tile_px(grid: tuple[int, int], target: int = 160) -> int:
    """A mosaic tile's width (`mosaic_tile`; its side, for a square grid)."""
    return mosaic_tile(grid, target)[0]


@functools.lru_cache(maxsize=64)
def _largest_tile(max_patches: int) -> int:
    """The most pixels a mosaic tile has over every grid of at most `max_patches` patches."""
    return max(gh * gw * max(1, -(-160 // max(gh, gw))) ** 2 for gh in range(1, max_patches + 1) for gw in range(1, max_patches // gh + 1))


def fused_rows(attn_layer: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """One layer's rows for every view: the heads, then their mean and max: [H, Q, N] -> float32 [H + 2, Q, M]."""
    rows = attn_layer[:, :, num_prefix_tokens:].float()
    return torch.cat([rows, rows.mean(dim=0, keepdim=True), rows.amax(dim=0, keepdim=True)])


def quantise_rows(rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """float rows [..., M] -> (uint8 [..., M], float32 row maxima [...]): floor(a / max x 255 + 1/2)."""
    q, top = _quantised(rows)
    return q.numpy(), top.numpy()


def _quantised(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantise_rows` as tensors: each step in float64, in the rule's order (a / max, x 255, + 1/2,
    floor), so the bytes are those of the rule computed in float64 anywhere."""
    r = rows.detach().cpu().float()
    top = r.amax(dim=-1)
    safe = torch.where(top > 0, top, torch.ones_like(top)).double()
    # (float32 rows over float64 maxima divide in float64, each row value widened exactly: no float64 copy first)
    q = torch.div(r, safe.unsqueeze(-1)).mul_(255.0).add_(0.5).floor_().clamp_(0, 255)
    return q.to(torch.uint8), top


def dequantise(q: np.ndarray, top: np.ndarray) -> np.ndarray:
    """uint8 [..., M] and float32 maxima [...] -> float64 values: q x max / 255 (in that order)."""
    return q.astype(np.float64) * top.astype(np.float64)[..., None] / 255.0


def query_rows(a: Analysis, layer: int) -> torch.Tensor:
    """Every query's row of one layer (0-based), each head: [H, Q, N]."""
    if a.pooled_query:
        return with_pooled_query(a.attentions[layer], num_prefix_tokens=a.num_prefix_tokens, pool_weights=a.pool_weights)
    return a.attentions[layer]


def row_values(a: Analysis, *, layer: int, head: int, query: int) -> np.ndarray:
    """The values a view of layer `layer` (0-based), head `head` (0..H-1, H: mean, H+1: max) and query
    `query` (an index of `Analysis.query_token`) shows over the patches: float64 [M], exactly as the
    browser reads them."""
    row = query_row(a.attentions[layer], query=a.query_token(query), num_prefix_tokens=a.num_prefix_tokens, pool_weights=a.pool_weights)  # [H, N]
    rows = fused_rows(row.unsqueeze(1), a.num_prefix_tokens)[head, 0]
    q, top = quantise_rows(rows)
    return dequantise(q, np.asarray(top))


def shared_max(a: Analysis) -> np.ndarray:
    """float32 [Q]: the largest weight each query gives a patch, in any layer and head (the top of the
    shared colour scale)."""
    p = a.num_prefix_tokens
    top = a.attentions[:, :, :, p:].amax(dim=(0, 1, 3))
    if a.pooled_query:  # the pooled rows alone: [L, H, M], not a second copy of the stack
        pooled = pooled_row(a.attentions, num_prefix_tokens=p, weights=a.pool_weights)[..., p:].amax().reshape(1)
        top = torch.cat([top[:p], pooled, top[p:]])
    return top.float().numpy().astype(np.float32)


def layout_of(a: Analysis, *, budget: int | None = None) -> ExplorerLayout:
    """`a`'s layout (`vitviz.cost.explorer_layout`; `budget` None: `vitviz.cost.BROWSER_BYTES`): a row
    per query, a mean-pooled model's "pool" too, as in `stack_file`."""
    depth, heads, n, _ = a.attentions.shape
    return explorer_layout(depth, heads, a.num_queries, n - a.num_prefix_tokens, budget=budget)


def layer_block(a: Analysis, layer: int) -> bytes:
    """One layer as the browser reads it: float32 row maxima [H + 2, N], then uint8 rows [H + 2, N, M]."""
    return block_of(query_rows(a, layer), a.num_prefix_tokens)


def block_of(rows: torch.Tensor, num_prefix_tokens: int) -> bytes:
    """One layer's block from every query's row of it, each head [H, Q, N]: float32 row maxima
    [H + 2, Q], then uint8 rows [H + 2, Q, M] (little-endian)."""
    return b"".join(_block_parts(rows, num_prefix_tokens)[1])


def _block_parts(rows: torch.Tensor, num_prefix_tokens: int) -> tuple[torch.Tensor, tuple[np.ndarray, np.ndarray]]:
    """`block_of` as its two arrays, the row maxima (little-endian float32) and the rows, with the
    row maxima [H + 2, Q] as a tensor too."""
    q, top = _quantised(fused_rows(rows, num_prefix_tokens))
    return top, (top.numpy().astype("<f4"), q.numpy())


def stack_file(a: Analysis, layers: range | list[int]) -> bytes:
    """The file for `layers`: float32 shared maxima [N], then each layer's block."""
    buf = io.BytesIO()
    buf.write(shared_max(a).astype("<f4").tobytes())
    for layer in layers:
        buf.write(layer_block(a, layer))
    return buf.getvalue()


class StackStream:
    """The "stack" file written while the forward runs (`vitviz.pipeline.analyze`'s `on_layer`): each
    layer's block goes to its final offset as soon as the layer is computed, and the shared maxima,
    the largest row maximum of each query over the layers so far, go to the start of the file when
    the last layer is written. The file keeps a temporary name until it is complete, so no half file
    is ever under `path`; it is complete as the forward's last attention is (`on_complete` is then
    called with the layout and `path`, while the forward goes on), or at `finish` for the blocks
    that need the finished analysis. `abort` removes it, complete or not.

    Nothing is streamed when the stack is over `budget` (the "layers" and "server" layouts write
    their files as they are asked for) or when the pooled query's row weighs the tokens by the
    attention pooling's probe, which runs after every block (`finish` writes those blocks then).

    Args:
        path: the file's final name.
        depth: L, the layers the forward will run.
        num_prefix_tokens: p.
        pooled_query: the model has the pooled query "pool" (its row sits at index p).
        pool_weighted: that query's row is weighted by the attention pooling's probe.
        budget: the most bytes the browser is sent at once (None: `vitviz.cost.BROWSER_BYTES`).
        on_complete: called with (`vitviz.cost.ExplorerLayout`, `path`) once the file is complete under its name.
    """

    def __init__(self, path, *, depth: int, num_prefix_tokens: int, pooled_query: bool = False, pool_weighted: bool = False,
                 budget: int | None = None, on_complete=None) -> None:
        self.path = Path(path)
        self.part = self.path.with_name(self.path.name + ".part")
        self.depth, self.prefix, self.pooled, self.deferred = depth, num_prefix_tokens, pooled_query, pool_weighted
        self.budget = budget
        self.on_complete = on_complete
        self.layout: ExplorerLayout | None = None
        self.written: set[int] = set()
        self.complete = False
        self._top: torch.Tensor | None = None  # the shared maxima of the layers written
        self._file = None

    def on_layer(self, layer: int, attn: torch.Tensor) -> None:
        """Layer `layer`'s (0-based) attention [H, N, N], as the forward computed it: its block written."""
        if self.layout is None:
            heads, n = attn.shape[0], attn.shape[-1]
            q = n + int(self.pooled)
            self.layout = explorer_layout(self.depth, heads, q, n - self.prefix, budget=self.budget)
            if self.layout.mode == "stack":
                self.part.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.part, "wb", buffering=0)  # each block reaches the file as it is written
        if self._file is None or self.deferred:
            return
        rows = with_pooled_query(attn, num_prefix_tokens=self.prefix) if self.pooled else attn
        self._write(layer, rows)
        if len(self.written) == self.depth:
            self._complete()

    def _write(self, layer: int, rows: torch.Tensor) -> None:
        if not 0 <= layer < self.depth or layer in self.written:
            raise RuntimeError(f"the forward gave layer {layer + 1} of {self.depth} of the explorer's file twice or out of range")
        top, parts = _block_parts(rows, self.prefix)
        self._file.seek(4 * self.layout.tokens + layer * self.layout.layer_bytes)
        for part in parts:
            _write_all(self._file, part)
        self.written.add(layer)
        # the heads' max view: each row's maximum is the largest of the heads' (max is exact)
        self._top = top[-1] if self._top is None else torch.maximum(self._top, top[-1])

    def _complete(self) -> None:
        self._file.seek(0)
        _write_all(self._file, self._top.numpy().astype("<f4"))
        self._file.close()
        self._file = None
        self.part.replace(self.path)
        self.complete = True
        if self.on_complete is not None:
            self.on_complete(self.layout, self.path)

    def finish(self, a: Analysis) -> Path | None:
        """The file complete under its name (for a probe-weighted pooled query, with the blocks of the
        finished analysis `a`); None when nothing was streamed."""
        try:
            if self.complete:
                if a.attentions.shape[0] != self.depth:
                    raise RuntimeError(f"the explorer's file has {self.depth} layers, the analysis {a.attentions.shape[0]}")
                return self.path
            if self._file is None:
                return None
            if self.deferred:
                for layer in range(self.depth):
                    self._write(layer, query_rows(a, layer))
            if self.written != set(range(self.depth)) or a.attentions.shape[0] != self.depth:
                raise RuntimeError(f"the forward wrote {len(self.written)} of {self.depth} layers of the explorer's file")
            self._complete()
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        """Stops and removes the file, complete or not (the forward, or what came after it, failed)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self.part.unlink(missing_ok=True)
        if self.complete:
            self.path.unlink(missing_ok=True)
            self.complete = False


def _write_all(file: io.RawIOBase, array: np.ndarray) -> None:
    """All of `array`'s bytes, in C order, to an unbuffered `file` (whose `write` may take less than
    it is given)."""
    data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    while data:
        data = data[file.write(data):]


def windows_of(config, depth: int) -> list[int]:
    """Each block's attention window, its side in patches (0: the block attends over the whole image):
    a model whose blocks attend within windows of the grid (`ViTConfig.attn_window`, but in
    `global_blocks`: Qwen2.5-VL's tower), which the explorer outlines around the query."""
    side = getattr(config, "attn_window", None) or 0
    every = set(getattr(config, "global_blocks", ()) or ())
    return [0 if layer in every else int(side) for layer in range(depth)]


def value_of(layout: ExplorerLayout, *, key: str, variant: str, grid: tuple[int, int], query_names: tuple[str, ...], patch_px: int,
             windows: list[int] | None = None, pictures: dict | None = None, data=None) -> dict:
    """The explorer's value for an analysis of `layout` by `variant`, named `key`: what the page draws
    it by. The one function that makes it, from the finished analysis (`write_payload`, the analysis'
    outputs) and from the spec and the crop while the forward runs (the value published early,
    `vitviz.server.runtime`), so the two are the same value. `query_names`: `Analysis.query_names`;
    `patch_px`: a patch's side in display pixels; `windows`: each layer's window (`windows_of`);
    `pictures`: `write_pictures`' answer (none in the "server" layout); `data`: the "stack" file's path."""
    heads = layout.views - 2
    value = dict(
        id=key, mode=layout.mode, depth=layout.layers, heads=heads, views=layout.views, tokens=layout.tokens, patches=layout.patches,
        grid=list(grid), prefix=list(query_names), patch_px=int(patch_px),
        windows=list(windows) if windows is not None else [0] * layout.layers,
        lut=lut(CMAP).reshape(-1).tolist(),
    )
    if layout.mode == "server":
        value["note"] = (
            f"{variant}'s attention is too large to hold in the browser ({layout.layer_bytes / 2**20:.0f} MB a layer); "
            "the views below are drawn by the server."
        )
    if pictures is not None:
        value.update(pictures)
    if data is not None:
        value["data"] = str(data)
    return value


def write_payload(exp, *, key: str, folder, budget: int | None = None) -> dict:
    """Writes what the browser needs for `exp` (an `Exploration`) into `folder`, under names made
    from `key` (the session's secret): the pictures, and the "stack" file unless the forward wrote it
    there already; returns the explorer's value (`value_of`): its layout, the files' paths and the
    colour map."""
    a = exp.analysis
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    layout = layout_of(a, budget=budget)
    pictures = data = None
    if layout.mode != "server":
        pictures = write_pictures(a.image, scale=exp.scale, grid=a.grid, key=key, folder=folder)
    if layout.mode == "stack":
        data = folder / f"{key}-stack.bin"
        _write_once(data, lambda: stack_file(a, range(layout.layers)))  # one analysis, one key: written once
    return value_of(layout, key=key, variant=a.variant, grid=a.grid, query_names=a.query_names, patch_px=a.patch_size * exp.scale,
                    windows=windows_of(exp.facts.spec.config, layout.layers), pictures=pictures, data=data)


PICTURES = ("base", "tile_base")


def picture_path(folder, key: str, name: str) -> Path:
    """Where picture `name` (one of `PICTURES`) of the analysis named `key` is written."""
    return Path(folder) / f"{key}-{name}.rgb"


def rgb_file(image: Image.Image) -> bytes:
    """A picture as the browser reads it: uint32 width, uint32 height (little-endian), then the
    uint8 RGB rows, top row first."""
    rgb = np.asarray(image.convert("RGB"), dtype=np.uint8)
    return np.array([rgb.shape[1], rgb.shape[0]], dtype="<u4").tobytes() + rgb.tobytes()


def read_rgb_file(data: bytes) -> Image.Image:
    """`rgb_file`'s picture back."""
    width, height = np.frombuffer(data[:8], dtype="<u4").tolist()
    if len(data) != 8 + 3 * width * height:
        raise ValueError(f"a {width}x{height} picture has {8 + 3 * width * height} bytes, not {len(data)}")
    return Image.fromarray(np.frombuffer(data[8:], dtype=np.uint8).reshape(height, width, 3))


def pictures_bytes(image_size: int, grid: tuple[int, int], *, max_patches: int | None = None) -> int:
    """The two pictures' bytes on disk for a crop of `image_size` px and its patch `grid`; with
    `max_patches`, the most for any crop of at most so many patches and image_size² pixels (an image
    of any aspect ratio: `Preprocessing` mode "fit")."""
    tw, th = mosaic_tile(grid)
    tile = th * tw if max_patches is None else _largest_tile(max_patches)
    return 16 + 3 * (image_size * image_size + tile)


def write_pictures(crop: Image.Image, *, scale: int, grid: tuple[int, int], key: str, folder) -> dict:
    """The explorer's two pictures, from the crop the model sees, as `rgb_file`s: "base", the crop
    itself, shown `scale` times as wide (`vitviz.server.pictures.views.display_of`), and "tile_base", a mosaic
    tile's (`mosaic_tile_px`); written once per key. Returns their paths and `scale`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tile = mosaic_tile(grid)
    value: dict = {"scale": int(scale)}
    for name, draw in (("base", lambda: crop), ("tile_base", lambda: crop.resize(tile, _BILINEAR))):
        path = picture_path(folder, key, name)
        _write_once(path, lambda: rgb_file(draw()))
        value[name] = str(path)
    return value


def _write_once(path: Path, data) -> None:
    """`data()`'s bytes written to `path` unless it exists, under a temporary name until complete: a
    failed write leaves no half file."""
    if path.exists():
        return
    part = path.with_name(path.name + ".part")
    try:
        part.write_bytes(data())
        part.replace(path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def first_shown(value: dict, query: int = 0) -> str:
    """What the first view of an explorer's value (`write_payload`, "stack" file) needs, in base64:
    the shared maxima (float32 [N]), the last layer's row maxima (float32 [V, N]; the layer shown
    first) and that layer's row of token `query` in every view (uint8 [V, M]; the page shows token
    0 first). For ViT-B/16, 3.6 kB of the layer's 552 kB: the page fetches the rest from the file."""
    layout = ExplorerLayout("stack", value["depth"], value["views"], value["tokens"], value["patches"])
    v, n, m = layout.views, layout.tokens, layout.patches
    if not 0 <= query < n:
        raise ValueError(f"query {query} is not a token of the explorer (0 to {n - 1})")
    with open(value["data"], "rb") as f:
        head = f.read(4 * n)
        f.seek(4 * n + (layout.layers - 1) * layout.layer_bytes)
        block = f.read(layout.layer_bytes)
    if len(head) != 4 * n or len(block) != layout.layer_bytes:
        raise ValueError(f"{value['data']} is shorter than its layout")
    rows = np.frombuffer(block, dtype=np.uint8, offset=4 * v * n).reshape(v, n, m)[:, query]
    return base64.b64encode(head + block[: 4 * v * n] + rows.tobytes()).decode("ascii")


def layer_path(folder, key: str, layer: int) -> Path:
    """Where the file of layer `layer` (1-based) of the analysis named `key` is written ("layers")."""
    return Path(folder) / f"{key}-layer{layer}.bin"


def write_layer(exp, *, key: str, layer: int, folder) -> str:
    """The file of one layer (1-based) for the "layers" layout, written once; returns its path."""
    path = layer_path(folder, key, layer)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_once(path, lambda: stack_file(exp.analysis, [layer - 1]))
    return str(path)


def widget_files() -> dict[str, str]:
    """The browser side: {"js": ..., "html": ..., "css": ...} (explorer.js after explorer_common.js, which
    the windowed explorer loads too; explorer.html, .css of this package)."""
    from importlib import resources

    folder = resources.files("vitviz.server")
    files = {kind: (folder / f"explorer.{kind}").read_text() for kind in ("js", "html", "css")}
    files["js"] = (folder / "explorer_common.js").read_text() + "\n" + files["js"]
    return files
