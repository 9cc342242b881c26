"""What a request on a model variant costs, from its arguments alone, before anything runs.

Every figure is written from the architecture (`VariantSpec`: layers L, heads H, width D, MLP width
F, tokens N at the requested image size) and the work each kind of request does; `docs/serving.md`
sets each beside the peak resident memory measured for it (within 1.5x either way where the peak is
over the base, but for one over-priced request it names; `python -m vitviz.dev.bench --serving`). With
`layer = H N^2 x 4` bytes (one layer's attention for one image) and `A = L x layer` (the stack):

- "analyse": one recorded forward; keeps A, plus the tokens; the peak adds a few layers'
  transients and the rollout's L fused N x N maps; its work adds the rollout (2 L N^3), the
  distances and the position similarities its pictures draw.
- "explain": one forward and, for each target (a class, or each of `phrases` phrases), a backward
  to the attention maps with their gradient recorded (A each) and the activations autograd keeps per
  layer; with `layer_gradients` (LeGrad) `LEGRAD_LAYERS` layers differentiated on their own; then
  the maps: a rollout, and per target the gradient rule and gradient rollout (2 L N^3 each). The
  (image, phrase) pairs of phrases hold the stack once per phrase as well. A model without a
  classifier explained without a phrase gets the maps that need no gradient: an analysis' price.
- "faithfulness": "explain", then deletion and insertion forwards of (steps + 1) x 2 perturbed
  images per ordering (`orders`: each method's and a random one), one mode's images held at once,
  `batch` of them through the fused forward at a time (the batch is chosen to fit the budget).
- "export": the .npz written straight to its file (attention in float16 beyond
  `FLOAT32_ATTENTION_BYTES`, the N x N rollout only up to `FULL_ROLLOUT_TOKENS`); in memory, the
  float16 copy of the stack, the attention's bytes as they are written and the rollout; its work
  the rollout and the distances.
- "view": a view drawn again from a kept analysis with new options (a rollout).
- "ablate": two forwards of one image (with and without some heads), nothing recorded: in memory
  what a forward that records nothing holds while a block runs (`vitviz.patching.copy_bytes`, on
  the fused attention kernel no [H, N, N] layer; "importance", "patch_one", "registers" and
  "concepts" price their forwards by it too).
- "importance": a forward, then for each layer a batch of H copies of the image run from that
  layer on, one head switched off in each (`vitviz.inside.head_importance`).
- "patch": activation patching (`vitviz.patch`) of the kinds of site `patch_kinds` names: a clean
  and a corrupted forward (and for "pattern" a clean one recording the attention), then each site
  of layer l runs the L − l blocks from l on, S sites a layer (N, H or N·H a kind): its work
  (2 + S (L + 1) / 2) forwards (3 + ... with "pattern"); in memory a batch of copies (`vitviz.patching.copy_bytes` each,
  as many as `patch` fits in its memory, or in `budget`) and the cached runs' activations.
- "patch_one": one patched forward (`vitviz.patched_logits`): "ablate"'s two forwards, and the clean
  run's activations of the kinds `patch_kinds` names, kept at the site's layer (one site a kind;
  sites at several layers keep each layer's), and a pattern's row as it is written in.
- "registers": a test-time register (`vitviz.registers`) on one image: a forward that records every
  block's MLP hidden activations [L, N, M] and block outputs [L, N, D] (`register_neurons`), then an
  "analyse" of the model with one more token (the register; its rollout drawn), and the rollout of
  the analysis before it drawn again ("view") beside it.
- "explorer": the browser's file of the whole stack (8 bits a weight) when it fits `BROWSER_BYTES`
  (in memory, then copied as it is written), else of one layer ("explorer_layer", written when the
  browser asks for it), else nothing (the server draws the views): the layout of `explorer_layout`,
  by which the analysis writes it.
- "compare": `analyse` for each variant, all held at once.
- "concepts": a sparse autoencoder's features on one image (`vitviz.concepts.concept_map`): a forward
  through the blocks up to the SAE's layer (`sae` = (layer, features F, k)), then its encoding and
  decoding (2 N D F each); in memory one forward's activations and three [N, F] of codes; kept, each
  token's top-k.
- "ask": `vitviz.ask` of a vision–language model (`ask` = its `vitviz.vlm.ask.AskShape`): the vision
  tower's forward; the greedy answer (with a key-value cache, the prompt once and each new token
  alone; without, the whole sequence again for each token); then the prompt and the answer once more
  with every layer's attention kept, and a backward to the attention for each token (its relevance,
  a row through every layer). In memory the recorded forward's activations, attention and logits, a
  token's gradients, and the kept answer (`vitviz.vlm.ask.answer_bytes`).
- "concept_ablate": `vitviz.ablate` with features of an SAE edited: "ablate"'s two forwards, and at
  the SAE's layer in the second its encoding (2 N D F) and the edit W_dec (z' − z) (at most as much).
- "video": a video model (`vitviz.video.VideoSpec`) on one clip (the app's Video tab): one forward
  with every layer's attention recorded, whose logits are the prediction (the tubelet embedding, 2 x
  weights x N and the attention products: 4 L N^2 D for joint attention; for divided attention each
  block's time and space attentions over their own tokens), then the query's row of the space-time
  rollout (`space_time_rollout_row`: 2 L N^2, twice for divided attention). In memory one layer's
  attention (joint: H N^2 x 4 bytes) twice while its heads are averaged, the stack of the averaged
  layers (joint: L N^2 x 4) twice (recorded, then stacked), a rollout step's matrices and a forward's
  activations, and the browser's explorer data when it is within `VIDEO_BROWSER_BYTES`
  (`video_explorer_bytes`: its parts, joined, and in base64; while a layer is quantised, its Q x Q rows
  in float32 twice and in float64, 17 Q^2 bytes); kept, the stack and the frames.
- "video_relevance": "video" with the map of the top class by Chefer et al.'s rule in place of the
  rollout (`attention_and_relevance`, one row): one forward keeping every layer on the graph (the
  views' attention averaged from it) and a backward to the first layer's attention (the activations'
  gradients only, no weights': 2 forwards' work), the terms and the row; in memory each layer's attention and its gradient, its activations and one layer's term,
  and a tenth more.

A fixed `BASE_BYTES` covers what any request allocates whatever the model (buffers, the pictures),
and `COMPUTE_BYTES` besides what one that runs the model or draws a figure does (thread buffers,
the figure). Model work is counted in multiply-adds x 2 (`forward_flops`); `tests/test_prices.py` holds
each kind's to what the request runs (torch's FlopCounterMode) within 1.5x. Of that work, the
attention products (each head's scores and weighted values, 4 x N^2 x D a layer; a windowed layer's
window by window) are told apart (`Cost.products`): a head's products are narrow (N x D/H by D/H x
N) and run at another speed than the projections' wide ones, so their share of a request (1 % of a
forward of `vit_b_32`, 74 % of one of `shapes_p16@576`) says how fast its flops run. The server turns
work into seconds at the speeds it learned for the request's line of work (`Cost.line`: its kind and
family, `vitviz.server.guards.work.ModelWork`).

A windowed model (Swin: its config has `geometries`) holds each layer's attention window by window,
`[windows, heads, M², M²]`: linear in tokens. Its requests are priced from those shapes, layer by
layer (`_windowed_price`), with the same kinds and the same rules; its rollout and relevance through
the merges (`_network_flops`, memory-bound: `WINDOW_PASS_FLOPS`) are priced where they are drawn,
each its [N_last, N_0] result and the slices of columns it is taken in (`vitviz.swin_global.SLICE_ELEMENTS`);
"explorer" is the size of its windowed explorer file (`vitviz.server.pictures.swin_explorer`), all layers or
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from vitviz.explanations import METHODS
from vitviz.patching import _plan as _patch_plan, attention_layers, copy_bytes
from vitviz.recording import LEGRAD_START_LAYER
from vitviz.swin_global import SLICE_ELEMENTS

__all__ = [
    "Kind",
    "Cost",
    "price",
    "together",
    "forward_flops",
    "attention_flops",
    "attention_bytes",
    "export_plan",
    "BASE_BYTES",
    "FLOAT32_ATTENTION_BYTES",
    "FULL_ROLLOUT_TOKENS",
    "FAITHFULNESS_BATCH",
    "BROWSER_BYTES",
    "ExplorerLayout",
    "explorer_layout",
    "explorer_layout_of",
    "explorer_bytes",
    "VIDEO_BROWSER_BYTES",
    "video_explorer_bytes",
]

Kind = Literal["analyse", "explain", "faithfulness", "export", "explorer", "explorer_layer", "view", "ablate", "importance", "patch",
               "patch_one", "registers", "concepts", "concept_ablate", "ask", "video", "video_relevance"]

BASE_BYTES = 4 * 2**20  # any request: buffers, the pictures, a file's copy in memory beyond what each kind counts
COMPUTE_BYTES = 8 * 2**20  # besides, a request that runs the model or draws a figure: thread buffers, the figure
FLOAT32_ATTENTION_BYTES = 64 * 2**20  # an export keeps attention in float32 up to this size, float16 beyond
FULL_ROLLOUT_TOKENS = 1024  # an export holds the whole N x N rollout up to this many tokens, the prefix rows beyond
FAITHFULNESS_BATCH = 64  # perturbed images per forward, at most
BROWSER_BYTES = 24 * 2**20  # the explorer's data a browser is sent at once
VIDEO_BROWSER_BYTES = 4 * 2**20  # the Video tab's explorer data, sent inline with a run's outputs (base64: 4/3 of it)
FAITHFULNESS_ORDERS = len(METHODS) + 1  # the built-in methods' maps and a random order (`price(orders=)` counts plugins' too)
LEGRAD_LAYERS = -LEGRAD_START_LAYER  # the layers LeGrad differentiates by default (the last two)
# A windowed model's product through the network (rollout, relevance; `vitviz.swin_global._through_network`)
# moves each element of its [N_s, N_last] rows several times a layer (an index copy in, the window
# product, an index copy out, a division and a sum): memory-bound work, counted in flops at what an
# element cost beside a forward's multiply-adds on the 2-core test machine (shapes_swin@1824: a rollout
# of 2.7e8 elements took 22.8 s where the forward's 1.43e10 flops took 1.0 s; `python -m
# vitviz.dev.bench --serving`, docs/serving.md).
WINDOW_PASS_FLOPS = 1024


@dataclass(frozen=True)
class Cost:
    """What one request may take.

    Attributes:
        kind: the kind of request.
        variant: the variant's name (with its size suffix).
        tokens: N, tokens per image at the requested size.
        bytes: peak memory the request may take beyond the model's weights.
        kept_bytes: what stays afterwards (the analysis kept for a session; for "export" and
            "explorer", the bytes written to disk).
        flops: model work (forward and backward passes, multiply-adds x 2).
        batch: for "faithfulness", the perturbed images per forward the estimate assumes; for
            "patch", the patched copies per batched forward (`vitviz.patch(batch_size=...)`).
        family: "global" or "windowed" (a Swin): with `kind`, the line of work whose speed the
            server learns on its own (`line`; until it has run a large job, from its family's).
        products: of `flops`, the attention products' (each head's scores and weighted values,
            forward and backward; `attention_flops` a forward), which run at a speed of their own.
    """

    kind: str
    variant: str
    tokens: int
    bytes: int
    kept_bytes: int
    flops: float
    batch: int = 1
    family: str = "global"
    products: float = 0.0

    @property
    def line(self) -> str:
        """The line of work its time is estimated by: its kind and its family ("analyse/windowed")."""
        return f"{self.kind}/{self.family}"

    @property
    def mib(self) -> float:
        return self.bytes / 2**20


def together(costs: list[Cost], *, kind: str = "compare") -> Cost:
    """Requests run one after another whose results are all held at the end (a comparison)."""
    held, peak = 0, 0
    for c in costs:
        peak = max(peak, held + c.bytes)
        held += c.kept_bytes
    return Cost(kind, " and ".join(c.variant for c in costs), max(c.tokens for c in costs), peak, held, sum(c.flops for c in costs),
                products=sum(c.products for c in costs))


@dataclass(frozen=True)
class ExplorerLayout:
    """How an analysis goes to the browser: "stack" (one file), "layers" (a file per layer) or "server"
    (no file: the server draws the views).

    Attributes:
        mode: "stack", "layers" or "server".
        layers: L.
        views: H + 2 (the heads, their mean and their max).
        tokens: the queries, a row each (N, or N + 1 with a pooled query).
        patches: the keys a row holds (the patch tokens).
    """

    mode: str
    layers: int
    views: int
    tokens: int
    patches: int

    @property
    def layer_bytes(self) -> int:
        """One layer's block: float32 row maxima and 8-bit rows, per view and query."""
        return self.views * self.tokens * (4 + self.patches)

    @property
    def stack_bytes(self) -> int:
        """The whole stack's file: the shared maxima, then every layer's block."""
        return 4 * self.tokens + self.layers * self.layer_bytes

    @property
    def file_bytes(self) -> int:
        """The largest file written for it: the stack, a layer's file (the shared maxima and one
        block), or nothing."""
        return {"stack": self.stack_bytes, "layers": 4 * self.tokens + self.layer_bytes, "server": 0}[self.mode]


def explorer_layout(layers: int, heads: int, queries: int, patches: int, *, budget: int | None = None) -> ExplorerLayout:
    """The explorer's layout for `layers` layers of `heads` heads, a row for each of `queries` queries
    over `patches` patches, for a browser sent at most `budget` bytes at once (None: `BROWSER_BYTES`,
    as it is when called): one file when the stack fits, a file per layer when a layer does, else
    none ("server"). The one rule the analysis (`vitviz.server.pictures.explorer_data`) and `price` go by."""
    budget = BROWSER_BYTES if budget is None else budget
    stack = ExplorerLayout("stack", layers, heads + 2, queries, patches)
    if stack.stack_bytes <= budget:
        return stack
    return replace(stack, mode="layers" if 4 * stack.tokens + stack.layer_bytes <= budget else "server")


def explorer_layout_of(spec, *, budget: int | None = None) -> ExplorerLayout:
    """The explorer's layout of an analysis by the ViT or image–text model of `spec` (a `VariantSpec`,
    at the size it will be fed), before it runs: a row per token, and one for a mean-pooled model's
    "pool" query, over the patches (`explorer_layout`)."""
    n = spec.num_tokens
    return explorer_layout(spec.config.depth, spec.config.heads, n + int(spec.config.pooled_query), n - spec.num_prefix_tokens,
                           budget=budget)


def _shape(spec) -> tuple[int, int, int, int, int]:
    """(L, H, N, D, M), M the MLP's width as a plain MLP's: a gated MLP of width m (weights and
    multiply-adds 3 D m, activations 3 N m per layer) counts as a plain one of 1.5 m."""
    c = spec.config
    mlp = c.mlp_dim if getattr(c, "mlp", "plain") == "plain" else (3 * c.mlp_dim + 1) // 2
    return c.depth, c.heads, spec.num_tokens, c.width, mlp


def _windowed(spec) -> bool:
    """Whether the config's tokens attend within windows (priced window by window, `_windowed_price`)."""
    return spec.config.attention == "windowed"


@dataclass(frozen=True)
class _Layer:
    """One windowed layer at the size a request feeds: heads, real tokens N, windows x M² places
    (padding included), width and MLP width."""

    heads: int
    tokens: int
    windows: int
    area: int
    width: int
    hidden: int

    @property
    def places(self) -> int:
        return self.windows * self.area

    @property
    def attention(self) -> int:
        """Its attention's bytes for one image: [windows, heads, M², M²] float32."""
        return self.windows * self.heads * self.area * self.area * 4


def _layers(spec) -> list[_Layer]:
    c = spec.config
    out = []
    for s, g in zip(c.layer_stages, c.geometries(spec.grid)):
        out.append(_Layer(c.num_heads[s], g.num_tokens, g.num_windows, g.area, c.dims[s], int(c.mlp_ratio * c.dims[s])))
    return out


def attention_bytes(spec) -> int:
    """A: the float32 attention stack [L, H, N, N] of one image (a windowed model: every layer's
    [windows, heads, M², M²])."""
    if _windowed(spec):
        return sum(layer.attention for layer in _layers(spec))
    depth, heads, n, _, _ = _shape(spec)
    return depth * heads * n * n * 4


def forward_flops(spec) -> float:
    """Multiply-adds x 2 of one forward of one image: the patch embedding (and a hybrid's stem before
    it), the projections and MLPs (2 x weights x N), the two attention products (4 x L x N^2 x D;
    windowed: 4 x windows x M² x M² x D per layer) and the head."""
    if _windowed(spec):
        c, n0 = spec.config, spec.grid[0] * spec.grid[1]
        merges = sum(2.0 * 8 * c.dims[s - 1] ** 2 * g[0] * g[1] for s, g in enumerate(c.stage_grids(spec.grid)) if s)
        blocks = sum(2.0 * (4 * l.width**2 + 2 * l.width * l.hidden) * l.places + 4.0 * l.places * l.area * l.width for l in _layers(spec))
        return 2.0 * 3 * spec.patch_size**2 * c.embed_dim * n0 + merges + blocks
    depth, _, n, width, mlp = _shape(spec)
    block_weights = 4 * width * width + 2 * width * mlp
    patches = n - spec.num_prefix_tokens
    c = spec.config
    if getattr(c, "stem", None) is None:
        embed = 2.0 * 3 * spec.patch_size**2 * width * patches  # the patch embedding
    else:  # a hybrid: its convolutional stem, then the patch embedding over the stem's feature map
        embed = _stem_flops(c, spec.grid) + 2.0 * c.stem_channels * c.embed_patch_size**2 * width * patches
    return embed + 2.0 * depth * block_weights * n + 4.0 * depth * n * n * width + 2.0 * width * spec.num_classes


def attention_flops(spec) -> float:
    """Of `forward_flops`, the attention products': each head's scores and weighted values, 4 x L x
    N^2 x D (windowed: 4 x windows x M² x M² x D per layer)."""
    if _windowed(spec):
        return sum(4.0 * l.places * l.area * l.width for l in _layers(spec))
    depth, _, n, width, _ = _shape(spec)
    return 4.0 * depth * n * n * width


def _stem_flops(c, grid: tuple[int, int]) -> float:
    """Multiply-adds x 2 of a hybrid's convolutional stem (`ViTConfig.stem`) on an image of `grid`
    tokens: each convolution's inputs x outputs x k² per pixel of its output (norms, activations and
    pools left out, as in the blocks)."""
    pixels = grid[0] * grid[1] * c.patch_size**2  # of the image
    if c.stem == "conv":
        total, into, stride = 0.0, 3, 1
        for width, s in zip(c.stem_widths, c.stem_strides):
            stride *= s
            total += into * width * s * s * pixels / stride**2
            into = width
        return 2.0 * total
    root = 3 * 64 * 49 if c.stem == "bit" else 9 * (3 * 32 + 32 * 32 + 32 * 64)  # at a stride of 2
    total, into = root * pixels / 4, 64
    for i, blocks in enumerate(c.stem_depths):
        out, at = 256 * 2**i, pixels / (4 * 2**i) ** 2  # the stage's output channels and pixels
        mid = out // 4
        first = into * mid * at * (4 if i else 1)  # the first block's 1x1 convolution, before its stride
        total += first + (into * out + (blocks - 1) * out * mid + blocks * (9 * mid * mid + mid * out)) * at
        into = out
    return 2.0 * total


def export_plan(spec, *, attentions: bool = True) -> dict:
    """What an .npz export of an analysis holds: {"attention_dtype", "attention_bytes" (the attention
    stack as saved), "rollout_rows", "bytes"} (`attentions=False`: without the attention stack). A windowed model's: every layer's window
    attention and relative position bias, the rollout's N_last rows onto the finest grid."""
    if _windowed(spec):
        layers, n0 = _layers(spec), spec.grid[0] * spec.grid[1]
        a32 = attention_bytes(spec)
        dtype = "float32" if a32 <= FLOAT32_ATTENTION_BYTES else "float16"
        attention = 0 if not attentions else a32 if dtype == "float32" else a32 // 2
        biases = sum(l.heads * l.area * l.area * 4 for l in layers)
        rows = layers[-1].tokens
        other = rows * n0 * 4 + n0 * 4 + len(layers) * (max(l.heads for l in layers) + 8) * 8 + biases + 4 * spec.num_classes
        return {"attention_dtype": dtype, "attention_bytes": attention, "rollout_rows": rows,
                "bytes": attention + other + 3 * spec.image_size**2 + 64 * 1024}
    depth, heads, n, width, _ = _shape(spec)
    a32 = attention_bytes(spec)
    dtype = "float32" if a32 <= FLOAT32_ATTENTION_BYTES else "float16"
    attention = 0 if not attentions else a32 if dtype == "float32" else a32 // 2
    rows = n if n <= FULL_ROLLOUT_TOKENS else spec.num_prefix_tokens
    side = spec.image_size
    other = rows * n * 4 + n * 4 + depth * heads * 8 + 4 * spec.num_classes + 3 * side * side + 64 * 1024
    return {"attention_dtype": dtype, "attention_bytes": attention, "rollout_rows": rows, "bytes": attention + other}


def _forward_bytes(spec, *, explicit: bool = False) -> int:
    """What a forward of `spec`'s ViT that records nothing holds at once while a block runs
    (`vitviz.patching.copy_bytes`): on the fused attention kernel no [H, N, N] layer; on the explicit
    path (`explicit`: a hook observes the softmax) the logits and the weights; a relative position
    bias adds its mask, and on the CPU its [H, N, N] float mask takes the kernel's explicit path too."""
    c = spec.config
    return copy_bytes(tokens=spec.num_tokens, width=c.width, mlp=c.mlp_dim, heads=c.heads, gated=c.mlp == "gated",
                      attention=attention_layers(explicit=explicit, bias=c.rel_pos_bias))


def price(spec, kind: Kind, *, steps: int = 16, budget: int | None = None, attentions: bool = True,
          layer_gradients: bool = False, orders: int = FAITHFULNESS_ORDERS, phrases: int = 0,
          patch_kinds: Sequence[str] = ("resid_pre",), sae: tuple[int, int, int] | None = None, ask=None) -> Cost:
    """The cost of a request of `kind` on `spec` (a `VariantSpec`, at the size it will be fed).

    Args:
        spec: the variant.
        kind: what is asked (see the module's doc).
        steps: deletion and insertion steps ("faithfulness").
        budget: bytes the request may take; "faithfulness" picks the largest batch that fits it.
        attentions: whether an "export" holds the attention stack.
        layer_gradients: an "explain" or "faithfulness" whose methods need each layer's own gradient
            (`Method.needs_layer_gradients`: LeGrad, `LEGRAD_LAYERS` of them).
        orders: "faithfulness": the orderings measured (the methods' maps and a random one).
        phrases: "explain" of an image–text model: the phrases explained at once (one forward, a
            backward for each: their gradients are held together); 0: a class of a classifier, or
            for a model without one the maps that need no gradient.
        patch_kinds: "patch" and "patch_one": the kinds of site patched (`vitviz.patching.KINDS`).
        sae: "concepts" and "concept_ablate": the sparse autoencoder's (layer, features, k).
        ask: "ask": the `vitviz.vlm.ask.AskShape` of the question asked.
    """
    if orders < 1 or phrases < 0:
        raise ValueError(f"orders are 1 or more and phrases 0 or more, got {orders} and {phrases}")
    if kind in ("concepts", "concept_ablate"):
        return _concepts_price(spec, kind, sae)
    if kind == "ask":
        return _ask_price(spec, ask)
    if kind in ("video", "video_relevance"):
        return _video_price(spec, kind)
    if kind in ("patch", "patch_one") and _windowed(spec):
        raise ValueError(f"activation patching runs on ViT towers; {spec.name} is a windowed model")
    if kind == "registers" and (_windowed(spec) or spec.config.rel_pos_bias):
        raise ValueError(f"a test-time register is one more token of a ViT with global attention and no relative position bias; "
                         f"{spec.name} has no place for one")
    if _windowed(spec):
        return _windowed_price(spec, kind, steps=steps, budget=budget, attentions=attentions, orders=orders, phrases=max(phrases, 1))
    depth, heads, n, width, mlp = _shape(spec)
    layer = heads * n * n * 4
    stack = depth * layer
    token_row = n * width * 4
    kept = stack + token_row + depth * n * 4 + 3 * spec.image_size**2
    analyse = stack + 4 * layer + 2 * depth * n * n * 4 + 2 * depth * token_row + BASE_BYTES + COMPUTE_BYTES
    own = min(depth, LEGRAD_LAYERS) if layer_gradients else 0  # layers differentiated on their own (LeGrad)
    # per target: its gradient of every layer's attention, the backward's activations, LeGrad's own layers; the
    # (image, phrase) pairs of phrases hold each layer's attention once more for each phrase
    per_target = (2 if phrases else 1) * stack + depth * (layer + 12 * token_row + 2 * n * mlp * 4) + 2 * own * layer
    targets = max(phrases, 1)
    differentiated = bool(phrases) or spec.has_head  # a phrase or a class to explain (else no backward runs)
    if differentiated:
        explain = stack + targets * per_target + BASE_BYTES + COMPUTE_BYTES
    else:  # nothing to differentiate (an image–text model's maps without a phrase): a recorded forward and a rollout
        explain = analyse
    flops, products = forward_flops(spec), attention_flops(spec)
    rollout = 2.0 * depth * n**3  # R = Â_L ··· Â_1, N x N each
    patches = n - spec.num_prefix_tokens
    pictures = 2.0 * depth * heads * n * n + 2.0 * patches * patches * width  # the distances, the position similarities
    # the backward runs to the attention maps only (no weight's gradient): the projections' input gradients
    # (one forward's) and three attention products for two (1.5 forwards at most); LeGrad's own layers one
    # block each; then the maps: rollout, and per target the gradient rule and gradient rollout
    passes = 1 + (targets * (1.5 + own / depth) if differentiated else 0)  # forwards' work in all (and of their products)
    explain_flops = passes * flops + rollout + (targets * 2 * rollout if differentiated else 0)
    if kind == "analyse":
        return Cost(kind, spec.name, n, analyse, kept, flops + rollout + pictures, products=products)
    if kind == "explain":
        return Cost(kind, spec.name, n, explain, 0, explain_flops, products=passes * products)
    fused = _forward_bytes(spec)  # what a forward that records nothing holds at once
    if kind == "faithfulness":
        per_image = fused  # each perturbed image's forward through the fused attention
        images = _perturbed_bytes(spec, orders, steps)
        room = (budget - BASE_BYTES - COMPUTE_BYTES - images) // per_image if budget is not None else FAITHFULNESS_BATCH
        batch = int(max(1, min(FAITHFULNESS_BATCH, room)))
        forwards = (steps + 1) * 2 * orders
        peak = max(explain, batch * per_image + images + BASE_BYTES + COMPUTE_BYTES)
        return Cost(kind, spec.name, n, peak, 0, explain_flops + forwards * flops, batch, products=(passes + forwards) * products)
    if kind == "export":
        plan = export_plan(spec, attentions=attentions)
        saved = plan["attention_bytes"]
        converted = saved if plan["attention_dtype"] == "float16" else 0
        # the float16 copy, the rollout's products, and the attention's bytes copied as they are written
        return Cost(kind, spec.name, n, converted + saved + 2 * depth * n * n * 4 + BASE_BYTES, plan["bytes"], rollout + 2.0 * depth * heads * n * n)
    if kind == "ablate":  # two forwards, with and without the heads, nothing recorded
        return Cost(kind, spec.name, n, fused + BASE_BYTES + COMPUTE_BYTES, 0, 2 * flops, products=2 * products)
    if kind == "importance":  # a forward, then per layer a batch of H copies run from that layer on
        per_copy = fused
        forwards = 1 + heads * (depth + 1) / 2
        return Cost(kind, spec.name, n, heads * per_copy + (depth + 1) * token_row + BASE_BYTES + COMPUTE_BYTES, 0,
                    forwards * flops, heads, products=forwards * products)
    if kind in ("patch", "patch_one"):
        plan = _patch_plan(spec, patch_kinds)
        if kind == "patch_one":  # two forwards, the clean one keeping what the site of each kind replaces, at its layer
            held = _forward_bytes(spec, explicit="pattern" in plan.kinds)  # (a pattern patched: the softmax observed)
            written = n * n * 4 if "pattern" in plan.kinds else 0  # (the clean pattern's row written in: a copy)
            return Cost(kind, spec.name, n, held + plan.one_site + written + BASE_BYTES + COMPUTE_BYTES, 0, 2 * flops,
                        products=2 * products)
        if budget is not None:  # the batch that fits the budget beside the cached runs
            plan = _patch_plan(spec, patch_kinds, memory=max(0, budget - plan.cached - BASE_BYTES - COMPUTE_BYTES))
        runs = 2 + ("pattern" in plan.kinds)  # the clean and corrupted forwards (and the clean patterns' own)
        # a site of layer l runs the L − l blocks from l on: S sites a layer, S (L + 1) / 2 forwards' blocks in all
        forwards = runs + plan.sites * (depth + 1) / 2
        return Cost(kind, spec.name, n, plan.batch * plan.per_copy + plan.cached + BASE_BYTES + COMPUTE_BYTES, 0,
                    forwards * flops, plan.batch, products=forwards * products)
    if kind == "registers":  # the neurons found, then the model with its register analysed; the rollout before drawn again
        find = depth * n * (mlp + width) * 4 + fused + BASE_BYTES + COMPUTE_BYTES
        after = price(replace(spec, config=spec.config.replace(register_neurons=((0, 0),))), "analyse", budget=budget)
        before = 3 * depth * n * n * 4
        return Cost(kind, spec.name, after.tokens, max(find, after.bytes + before), after.kept_bytes, flops + after.flops + rollout,
                    products=products + after.products)
    if kind == "view":  # a view drawn again from a kept analysis: a rollout (L fused N x N maps and the products)
        return Cost(kind, spec.name, n, 3 * depth * n * n * 4 + BASE_BYTES + COMPUTE_BYTES, 0, rollout)
    if kind in ("explorer", "explorer_layer"):
        layout = explorer_layout_of(spec)
        if kind == "explorer_layer":
            layout = replace(layout, mode="layers")
        written = layout.file_bytes
        if kind == "explorer" and layout.mode == "layers":  # the analysis writes the pictures; a layer's file when it is asked for
            return Cost(kind, spec.name, n, BASE_BYTES, written, 0.0)  # ("explorer_layer"; its room on disk is kept for it)
        # the file in memory and its copy as it is written; a layer's rows in float32, then float64 while quantised
        transient = layout.views * layout.tokens * n * (4 + 8 + 8) if written else 0
        return Cost(kind, spec.name, n, 2 * written + transient + BASE_BYTES, written, 0.0)
    raise ValueError(f"unknown kind of request {kind!r}")


def explorer_bytes(spec) -> int:
    """The windowed explorer's file for one image (`vitviz.server.pictures.swin_explorer`): per layer, each
    window's tokens (int32 [windows, M²]), each token's window and mask region (int32 [N] twice),
    then per view (the heads, their mean and max) each query's row over its window (float32 maxima
    [V, N], uint8 [V, N, M²]) and the pooled query's row over the grid (float32 [V], uint8 [V, N])."""
    return sum(l.places * 4 + 8 * l.tokens + (l.heads + 2) * (l.tokens * (4 + l.area) + 4 + l.tokens) for l in _layers(spec))


def video_explorer_bytes(*, depth: int, grid: tuple[int, int, int], frames: int, image_size: int) -> int:
    """The Video tab's explorer data for one clip (`vitviz.server.pictures.video_explorer`) of a model of
    `depth` layers and token `grid` (t, h, w), `frames` frames of `image_size` px: per layer, each patch
    query's head-averaged row over the patches (float32 maxima [L, Q], uint8 [L, Q, Q], Q = t*h*w), and
    each frame as the model sees it (an `rgb_file`: 8 + 3 S² bytes)."""
    t, h, w = grid
    q = t * h * w
    return depth * q * (4 + q) + frames * (8 + 3 * image_size**2)


def _windowed_price(spec, kind: Kind, *, steps: int, budget: int | None, attentions: bool, orders: int, phrases: int) -> Cost:
    """`price` for a windowed model: the same kinds, from each layer's own shapes (`_layers`); its
    rollout through the merges (drawn by an analysis, a view and an export) and its relevance (in an
    explanation) each cost one product through the network (`_network_flops`)."""
    layers, n0 = _layers(spec), spec.grid[0] * spec.grid[1]
    stack, layer, n = attention_bytes(spec), max(l.attention for l in layers), n0
    last = layers[-1]
    biases = sum(l.heads * l.area * l.area * 4 for l in layers)
    # what the analysis keeps (`SwinAnalysis.nbytes`): window attention, biases, each block's token norms, final tokens,
    # probabilities, the crop
    norms = sum(l.tokens * 4 for l in layers)
    kept = stack + biases + norms + last.tokens * last.width * 4 + 4 * spec.num_classes + 3 * spec.image_size**2
    result = last.tokens * n0 * 4  # a product through the network: [N_last, N_0]
    # taken a slice of columns at a time: the slice, scaled, its window product in and out of the windows
    slices = 5 * min(SLICE_ELEMENTS, last.tokens * n0) * 4
    activations = sum(l.tokens * l.width * 4 for l in layers)
    analyse = stack + activations + max(4 * layer + activations, result + slices) + BASE_BYTES + COMPUTE_BYTES
    backward = sum(2 * l.attention + 12 * l.tokens * l.width * 4 + 2 * l.places * l.hidden * 4 for l in layers)
    # the gradients, the backward, then the rollout, the relevance and the gradient rollout held, one product's slices at a time
    explain = stack + phrases * (stack + backward) + 3 * result + slices + BASE_BYTES + COMPUTE_BYTES
    flops, products = forward_flops(spec), attention_flops(spec)
    network = _network_flops(layers)
    explain_flops = flops + network + phrases * (flops + 2 * network)  # rollout; per phrase a backward, its relevance and gradient rollout

    def cost(*args, **kwargs) -> Cost:
        return Cost(*args, **kwargs, family="windowed")

    if kind == "analyse":
        return cost(kind, spec.name, n, analyse, kept, flops + network, products=products)
    if kind == "explain":
        return cost(kind, spec.name, n, explain, 0, explain_flops, products=(1 + phrases) * products)
    if kind == "faithfulness":
        per_image = 2 * layer + 8 * max(l.tokens * l.width * 4 for l in layers) + 2 * max(l.places * l.hidden for l in layers) * 4
        images = _perturbed_bytes(spec, orders, steps)
        room = (budget - BASE_BYTES - COMPUTE_BYTES - images) // per_image if budget is not None else FAITHFULNESS_BATCH
        batch = int(max(1, min(FAITHFULNESS_BATCH, room)))
        forwards = (steps + 1) * 2 * orders
        return cost(kind, spec.name, n, max(explain, batch * per_image + images + BASE_BYTES + COMPUTE_BYTES), 0,
                    explain_flops + forwards * flops, batch, products=(1 + phrases + forwards) * products)
    if kind == "export":
        plan = export_plan(spec, attentions=attentions)
        saved = plan["attention_bytes"]
        converted = saved if plan["attention_dtype"] == "float16" else 0
        # the rollout (one product's slices at a time), its rows and the attention copied as they are written
        return cost(kind, spec.name, n, converted + saved + 2 * result + slices + BASE_BYTES, plan["bytes"], network)
    if kind == "view":
        return cost(kind, spec.name, n, result + slices + BASE_BYTES + COMPUTE_BYTES, 0, network)
    if kind in ("explorer", "explorer_layer"):  # all layers in one file when the browser can hold it, else the server draws
        whole = explorer_bytes(spec)
        written = whole if whole <= BROWSER_BYTES else 0
        transient = max((l.heads + 2) * l.tokens * l.area * (4 + 8 + 8) for l in layers) if written else 0
        return cost(kind, spec.name, n, 2 * written + transient + BASE_BYTES, written, 0.0)
    raise ValueError(f"unknown kind of request {kind!r}")


def _perturbed_bytes(spec, orders: int, steps: int) -> int:
    """The perturbed images of one mode (deletion, then insertion), every ordering's steps at once:
    float32 pixels [orders, steps + 1, 3, S, S], the float32 mask they are multiplied by and two boolean
    masks, 18 bytes a pixel (`vitviz.faithfulness.perturbation_curves`)."""
    return orders * (steps + 1) * spec.image_size**2 * (3 * 4 + 4 + 2)


def _network_flops(layers: list[_Layer]) -> float:
    """One product through a windowed network (`vitviz.swin_global._through_network`): per layer, the final
    tokens' rows over its tokens' places, each window's M² x M² product (2 M² flops an element) and
    the element's passes through memory (`WINDOW_PASS_FLOPS`)."""
    rows = layers[-1].tokens
    return float(sum(rows * l.places * (2 * l.area + WINDOW_PASS_FLOPS) for l in layers))


def _concepts_price(spec, kind: str, sae: tuple[int, int, int] | None) -> Cost:
    """"concepts" and "concept_ablate" (see the module's doc) of a sparse autoencoder `sae` = (layer,
    features F, k) reading the stream of `spec`'s ViT after block `layer`."""
    if _windowed(spec):
        raise ValueError(f"a sparse autoencoder reads a ViT's residual stream after a block; {spec.name} is a windowed model")
    if sae is None or len(sae) != 3:
        raise ValueError(f'"{kind}" is priced with sae=(layer, features, k) of its sparse autoencoder')
    layer, features, k = (int(v) for v in sae)
    depth, heads, n, width, mlp = _shape(spec)
    if not (0 <= layer < depth and 1 <= k <= features):
        raise ValueError(f"an SAE after block {layer} of {depth}, k {k} of {features} features: outside {spec.name}")
    flops, products = forward_flops(spec), attention_flops(spec)
    block = 2.0 * (4 * width * width + 2 * width * mlp) * n + 4.0 * n * n * width  # one block's multiply-adds x 2
    encode = 2.0 * n * width * features  # W_enc (x − b_dec), [N, D] x [D, F]; decoding z W_decᵀ as much
    transients = _forward_bytes(spec)  # one forward's, nothing recorded (as "ablate")
    codes = 3 * n * features * 4  # the pre-activations, their top-k and z, [N, F] float32
    if kind == "concepts":  # the blocks after the layer and the head do not run
        to_layer = flops - (depth - 1 - layer) * block - 2.0 * width * spec.num_classes
        kept = n * (12 * k + 8)  # each token's top-k (int64 indices, float32 values), its error and norm
        return Cost(kind, spec.name, n, transients + codes + n * width * 4 + BASE_BYTES + COMPUTE_BYTES, kept, to_layer + 2 * encode,
                    products=products * (layer + 1) / depth)
    # the change W_dec (z' − z) of the edited features: at most all F columns, as much as a decoding
    return Cost(kind, spec.name, n, transients + codes + BASE_BYTES + COMPUTE_BYTES, 0, 2 * flops + 2 * encode, products=2 * products)


def _ask_price(spec, shape) -> Cost:
    """"ask" (see the module's doc) of a VLM whose vision tower is `spec`, asked as `shape` says."""
    from vitviz.vlm.ask import answer_bytes

    if shape is None:
        raise ValueError('"ask" is priced with ask=, the AskShape of the question (VLM.ask_shape)')
    s = shape
    t, p, n = s.tokens, s.prompt_tokens, max(1, s.new_tokens)

    def run(tokens: int, context: int) -> float:  # `tokens` new positions over `context` keys: multiply-adds x 2
        return 2.0 * s.params * tokens + 4.0 * s.layers * s.width * tokens * context

    if s.cache:
        generate = run(p, p) + sum(run(1, p + i) for i in range(1, n))
    else:
        generate = sum(run(p + i, p + i) for i in range(n))
    recorded = run(t, t)
    # each token's backward to the attention: the projections' input gradients and the attention products (as "explain")
    backward = n * 1.5 * recorded
    relevance = n * s.layers * (s.heads + 2) * 2.0 * t * t  # (∇A ⊙ A)⁺ over the heads and a row through each layer
    tower = forward_flops(spec)
    attention = s.layers * s.heads * t * t * 4
    activations = s.layers * t * (12 * s.width + 3 * s.mlp) * 4  # what the backward reads, layer by layer
    logits = 2 * t * s.vocab * 4
    kept = answer_bytes(n, s.layers, s.heads, s.image_tokens)
    peak = 3 * attention + activations + logits + kept + attention_bytes(spec) + BASE_BYTES + COMPUTE_BYTES
    # the tower's and the language model's attention products (a context of c keys: 4 x width x c a position and layer)
    if s.cache:
        generated = 4.0 * s.layers * s.width * (p * p + sum(p + i for i in range(1, n)))
    else:
        generated = 4.0 * s.layers * s.width * sum((p + i) ** 2 for i in range(n))
    attended = 4.0 * s.layers * s.width * t * t * (1 + n * 1.5)  # the recorded forward and each token's backward
    return Cost("ask", spec.name, t, peak, kept, tower + generate + recorded + backward + relevance,
                products=attention_flops(spec) + generated + attended)


def _video_price(spec, kind: str = "video") -> Cost:
    """"video" or "video_relevance" (see the module's doc) of a video model `spec` (a `vitviz.video.VideoSpec`) on one clip."""
    c = spec.config
    t, h, w = c.grid
    p = c.num_prefix_tokens
    n = c.num_tokens
    depth, heads, width = c.depth, c.heads, c.width
    patches = t * h * w
    block_weights = 4 * width * width + 2 * width * c.mlp_dim
    embed = 2.0 * 3 * c.tubelet * c.patch_size**2 * width * patches
    if c.attention == "joint":
        products = 4.0 * depth * n * n * width
        layer = heads * n * n * 4
    else:  # each block: time attention over t tokens at each position, then space attention within each frame
        block_weights += 4 * width * width
        products = 4.0 * depth * width * (h * w * t * t + t * (p + h * w) ** 2)
        layer = heads * (h * w * t * t + t * (p + h * w) ** 2) * 4
    stack = depth * layer // heads  # each layer's heads averaged as it is recorded
    head = 2.0 * width * spec.num_classes
    forward = embed + 2.0 * depth * block_weights * n + products + head
    joint = c.attention == "joint"
    rollout = 2.0 * depth * n * n * (1 if joint else 2)  # a query's row: a vector times each step (`space_time_rollout_row`)
    fused = 2 * n * n * 4  # a step's matrices (divided: a block's two, dense)
    frames = spec.frames * 3 * spec.image_size**2 * 4
    activations = copy_bytes(tokens=n, width=width, mlp=c.mlp_dim, heads=heads, attention=0)  # a forward's, fused
    kept = stack + frames
    explorer = video_explorer_bytes(depth=depth, grid=c.grid, frames=spec.frames, image_size=spec.image_size)
    # its bytes, joined, then in base64; while a layer is quantised, its rows in float32 (twice) and float64 and its bytes
    explorer = explorer * 10 // 3 + 17 * patches * patches if explorer <= VIDEO_BROWSER_BYTES else 0
    peak = 2 * stack + 2 * layer + fused + activations + frames + explorer + BASE_BYTES + COMPUTE_BYTES
    if kind == "video":
        return Cost(kind, spec.name, n, peak, kept, forward + rollout, products=products)
    # "video_relevance": one forward keeping every layer on the graph (its attention and activations; each layer's heads
    # averaged from it for the views), a backward to the first layer's attention (the activations' gradients: a
    # forward's products again, no weights' gradients), each layer's gradient beside its attention, and a
    # query's row through each layer's term (a layer's attention-sized term at a time); a tenth more for what the
    # allocator keeps besides (measured: within 4 % without it)
    graph = 11 * (depth * (2 * layer + activations) + layer) // 10
    terms = depth * layer / 4 + rollout  # (G ⊙ A)⁺ averaged over heads, then the row through each term
    fusing = depth * layer / 4  # each layer's heads averaged
    return Cost(kind, spec.name, n, max(peak, graph + stack + frames + explorer + BASE_BYTES + COMPUTE_BYTES), kept,
                2.0 * forward + terms + fusing, products=2.0 * products)
