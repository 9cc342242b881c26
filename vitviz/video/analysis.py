"""Space-time readings of a video transformer's attention (`VideoAttention`, one clip).

Tokens: p prefix tokens (the cls token, where there is one), then the patches of the (t, h, w) grid
frame by frame, row by row: patch (t, y, x) is token p + t*h*w + y*w + x, N = p + t*h*w. A map over
a clip is [t, h, w].

Rollout (Abnar & Zuidema 2020) for every model as vitviz's image rollout: each attention step is
A ↦ Â = 0.5·A + 0.5·I (the residual stream's equal share; rows of A sum to 1, so this is rownorm(A + I)),
heads fused first (mean by default), and R = Â_L ··· Â_1. For TimeSformer's divided attention, each
block is two such steps, each an N x N matrix (`space_time_rollout`).

Gradient relevance (Chefer et al. 2021) of a model with a head, as vitviz's image rule over all N
tokens (`space_time_relevance`); for divided attention each block is two steps of the rule, placed
on the N tokens as the rollout places them.
"""

from __future__ import annotations

import torch

from vitviz import steps
from vitviz.analysis import POOL, HeadFusion, Query, attention_rollout, fuse_heads, query_row
from vitviz.hooks import record_attention
from vitviz.relevance import gradient_relevance, relevance_from_layers, relevance_layer
from vitviz.video.model import VideoAttention, VideoViT, pool_row

__all__ = [
    "space_time_rollout",
    "space_time_rollout_row",
    "divided_step_matrices",
    "frame_maps",
    "attention_across_frames",
    "attention_across_frames_all",
    "mean_attention_distance_space_time",
    "token_coordinates",
    "space_time_relevance",
    "attention_and_relevance",
]


def token_coordinates(grid: tuple[int, int, int], device: torch.device | str | None = None) -> torch.Tensor:
    """(t, y, x) of each patch token, frame by frame, row by row: [t*h*w, 3], long."""
    t, h, w = grid
    tt, yy, xx = torch.meshgrid(torch.arange(t, device=device), torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    return torch.stack([tt.flatten(), yy.flatten(), xx.flatten()], dim=-1)


def divided_step_matrices(time: torch.Tensor, space: torch.Tensor, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One divided block's two token-mixing matrices, [N, N] each (N = 1 + t*h*w), heads already fused.

    Args:
        time: [h*w, t, t], the time attention at each position s = y*w + x.
        space: [t, 1 + h*w, 1 + h*w], the space attention in each frame (the cls token first).

    Returns:
        (T, S): T[(t, s), (t', s)] = time[s, t, t'], zero elsewhere in a patch's row; T's cls row is e_0
        (the cls token skips the time attention). S[(t, s), 0] = space[t, 1 + s, 0],
        S[(t, s), (t, s')] = space[t, 1 + s, 1 + s'] (a patch attends within its own frame and to the cls
        token); S's cls row is the mean over frames of its rows there: S[0, 0] = mean_t space[t, 0, 0],
        S[0, (t, s')] = space[t, 0, 1 + s'] / t (its t outputs are averaged). Rows of both sum to 1.
    """
    t, h, w = grid
    s = h * w
    n = 1 + t * s
    index = 1 + torch.arange(t * s, device=time.device).reshape(t, s)  # index[t, s]: the token of patch s of frame t
    steps_t = torch.zeros(n, n, dtype=time.dtype, device=time.device)
    steps_t[0, 0] = 1.0
    rows = index[:, None, :].expand(t, t, s)  # [t, t', s]: query (t, s)
    cols = index[None, :, :].expand(t, t, s)  # [t, t', s]: key (t', s)
    steps_t[rows, cols] = time.permute(1, 2, 0)  # time[s, t, t'] at [t, t', s]
    steps_s = torch.zeros(n, n, dtype=space.dtype, device=space.device)
    frame_cols = torch.cat([torch.zeros(t, 1, dtype=torch.long, device=space.device), index], dim=1)  # [t, 1 + s]
    steps_s[index[:, :, None].expand(t, s, 1 + s), frame_cols[:, None, :].expand(t, s, 1 + s)] = space[:, 1:, :]
    steps_s[0, 0] = space[:, 0, 0].mean()
    steps_s[0, index.flatten()] = (space[:, 0, 1:] / t).flatten()
    return steps_t, steps_s


def space_time_rollout(attention: VideoAttention, *, head_fusion: HeadFusion = "mean") -> torch.Tensor:
    """Attention rollout over all N tokens of a clip: R [N, N], R[i, j] how much token i after the last
    block draws on token j at the input; rows sum to 1.

    Joint attention: vitviz's rollout (`vitviz.analysis.attention_rollout`): R = Â_L ··· Â_1, Â = 0.5·A + 0.5·I
    of the head-fused attention.

    Divided attention (TimeSformer): each block is a time step then a space step, each an N x N matrix
    (`divided_step_matrices`, from the heads fused per module):

        T_l: a patch's row is the time attention over the tokens at its own position (y, x) in every
             frame; the cls token's row is e_0, since the cls token skips the time attention
        S_l: a patch's row is its frame's space attention, over the cls token and that frame's patches;
             the cls token's row is the average over the t frames of its row in each frame's space
             attention, since its t outputs are averaged

    each with its residual, T̂ = 0.5·T + 0.5·I and Ŝ = 0.5·S + 0.5·I, and R = Ŝ_L T̂_L ··· Ŝ_1 T̂_1 (the time
    step first in each block, as in the forward). The cls token's time row gives T̂'s cls row e_0. For a
    single frame (t = 1) every T_l is the identity and S_l the frame's attention, so R is the image rollout.
    The residuals' equal weights are the rollout's convention, not the model's (whose branches carry
    their own projections and norms).
    """
    if attention.kind == "joint":
        return attention_rollout(attention.joint, head_fusion=head_fusion, num_prefix_tokens=attention.num_prefix_tokens)
    n = attention.num_tokens
    eye = torch.eye(n, dtype=attention.space.dtype, device=attention.space.device)
    rollout = eye.clone()
    for time, space in zip(attention.time, attention.space):
        t_step, s_step = divided_step_matrices(fuse_heads(time, head_fusion, dim=0), fuse_heads(space, head_fusion, dim=0), attention.grid)
        rollout = (0.5 * s_step + 0.5 * eye) @ ((0.5 * t_step + 0.5 * eye) @ rollout)
        steps.step()
    return rollout


def _query_vector(query: Query, n: int, p: int, like: torch.Tensor) -> torch.Tensor:
    """The weights a query's row takes of a matrix's rows, [N]: one-hot, or for "pool" the patches'
    mean (`vitviz.analysis.query_row`'s rows, as weights)."""
    v = torch.zeros(n, dtype=like.dtype, device=like.device)
    if query == POOL:
        v[p:] = 1.0 / (n - p)
    elif isinstance(query, int) and not isinstance(query, bool) and 0 <= query < n:
        v[query] = 1.0
    else:
        raise ValueError(f"a query is a token index below {n} or {POOL!r}, got {query!r}")
    return v


def space_time_rollout_row(attention: VideoAttention, *, query: Query = 0, head_fusion: HeadFusion = "mean") -> torch.Tensor:
    """One query's row of `space_time_rollout(attention)`, [N] (0: the cls token's, or token 0's; "pool":
    the mean of the patches' rows), without the N x N product: the query's weights times each step,
    the last block's first (q·R = ((q·Â_L)·Â_(L-1))···Â_1: N² a step instead of N³). Equal to the
    matrix's row to float rounding (tested)."""
    n, p = attention.num_tokens, attention.num_prefix_tokens
    if attention.kind == "joint":
        fused = fuse_heads(attention.joint, head_fusion, dim=1)  # [L, N, N]
        v = _query_vector(query, n, p, fused)
        for a in reversed(fused):  # Â = rownorm(A + I) (`vitviz.analysis.rollout_fused`): v·Â = (v / d)·A + v / d
            w = v / (a.sum(dim=-1) + 1.0)
            v = w @ a + w
            steps.step()
        return v
    v = _query_vector(query, n, p, attention.space)
    for time, space in zip(reversed(attention.time), reversed(attention.space)):  # R = Ŝ_L T̂_L ··· Ŝ_1 T̂_1, from the left
        t_step, s_step = divided_step_matrices(fuse_heads(time, head_fusion, dim=0), fuse_heads(space, head_fusion, dim=0), attention.grid)
        v = 0.5 * (v @ s_step) + 0.5 * v
        v = 0.5 * (v @ t_step) + 0.5 * v
        steps.step()
    return v


def frame_maps(rollout: torch.Tensor, grid: tuple[int, int, int], query: Query = 0) -> torch.Tensor:
    """The query's row of a token-by-token matrix over the patches, frame by frame: [t, h, w].

    Args:
        rollout: [N, N] (a rollout, or one layer's head-fused attention), N = p + t*h*w; or one row of
            such a matrix [N] (`space_time_rollout_row`), whose patches' part is returned (`query` unread).
        query: a token's index (0 the cls token, where there is one), or "pool": the mean of the patches' rows.

    The maps sum to 1 − (the row's weight on the prefix tokens) for a matrix whose rows sum to 1.
    """
    t, h, w = grid
    if rollout.ndim == 1 and rollout.shape[0] >= t * h * w:  # a query's row already (`space_time_rollout_row`)
        return rollout[rollout.shape[0] - t * h * w :].reshape(t, h, w)
    if rollout.ndim != 2 or rollout.shape[0] != rollout.shape[1] or rollout.shape[-1] < t * h * w:
        raise ValueError(f"rollout must be [N, N] with N >= {t * h * w} for the grid {tuple(grid)}, got {list(rollout.shape)}")
    p = rollout.shape[-1] - t * h * w
    return query_row(rollout, query=query, num_prefix_tokens=p)[p:].reshape(t, h, w)


def attention_across_frames(attention: VideoAttention, layer: int, query_t: int, query_y: int, query_x: int) -> torch.Tensor:
    """Where patch (query_t, query_y, query_x) looks in one layer, every head: [H, t, h, w].

    Joint attention: the token's row over the patches (the prefix columns left out), frame by frame.

    Divided attention: the block's two attentions in one map. Frame query_t holds the space attention
    of the query over its own frame's patches (the cls column left out); every other frame t' is zero but
    at (query_y, query_x), where it holds the time attention from the query's frame to frame t' at that
    position (the time attention's weight on the query's own frame is 1 − the sum of those).
    """
    t, h, w = attention.grid
    if not (0 <= layer < attention.depth and 0 <= query_t < t and 0 <= query_y < h and 0 <= query_x < w):
        raise ValueError(f"layer {layer} and patch ({query_t}, {query_y}, {query_x}) must lie within {attention.depth} layers "
                         f"and the grid {t}x{h}x{w}")
    p, s = attention.num_prefix_tokens, query_y * w + query_x
    if attention.kind == "joint":
        return attention.joint[layer, :, p + query_t * h * w + s, p:].reshape(-1, t, h, w)
    heads = attention.space.shape[1]
    out = attention.space.new_zeros(heads, t, h * w)
    out[:, :, s] = attention.time[layer, :, s, query_t, :]
    out[:, query_t] = attention.space[layer, :, query_t, p + s, p:]
    return out.reshape(heads, t, h, w)


def attention_across_frames_all(attention: VideoAttention, layer: int) -> torch.Tensor:
    """`attention_across_frames` of every patch query of one layer at once, every head:
    [H, t*h*w, t, h, w], query q = t_q*h*w + y_q*w + x_q (the patches' token order, prefix left out).

    Joint attention: the layer's rows of the patches over the patches. Divided attention: for query
    (t_q, s_q), s_q = y_q*w + x_q, each frame t' holds the time attention time[s_q, t_q, t'] at s_q, then
    frame t_q is overwritten with the space attention over its patches, as `attention_across_frames` builds it.
    """
    t, h, w = attention.grid
    if not 0 <= layer < attention.depth:
        raise ValueError(f"layer {layer} must lie within the {attention.depth} layers")
    p, s = attention.num_prefix_tokens, h * w
    if attention.kind == "joint":
        return attention.joint[layer, :, p:, p:].reshape(-1, t * s, t, h, w)
    heads = attention.space.shape[1]
    out = attention.space.new_zeros(heads, t, s, t, s)  # [H, t_q, s_q, t', s']
    at = torch.arange(s, device=out.device)
    out[:, :, at, :, at] = attention.time[layer].transpose(0, 1)  # [s_q, H, t_q, t']: time[H, s_q, t_q, t'] at s' = s_q
    frames = torch.arange(t, device=out.device)
    out[:, frames, :, frames, :] = attention.space[layer, :, :, p:, p:].transpose(0, 1)  # [t_q, H, s_q, s'] at t' = t_q
    return out.reshape(heads, t * s, t, h, w)


def _weighted_mean(attn: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    """mean over queries of Σ_j A_ij d_ij / Σ_j A_ij: [..., M, M] with [M, M] -> [...]."""
    mass = attn.sum(dim=-1).clamp_min(torch.finfo(attn.dtype).tiny)
    return ((attn * distance).sum(dim=-1) / mass).mean(dim=-1)


def mean_attention_distance_space_time(
    attention: VideoAttention, grid: tuple[int, int, int], patch_size: int, tubelet: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean attention distance in space (pixels) and in time (frames), per layer and head: ([L, H], [L, H]).

    Over patch queries i and patch keys j, the attention's rows renormalised over the patches (the
    prefix's share left out, as `vitviz.analysis.mean_attention_distance`): MAD = mean_i Σ_j A_ij d(i, j),
    the space distance P·|(y_i, x_i) − (y_j, x_j)| (Euclidean, between patch centres) and the time
    distance τ·|t_i − t_j| (τ = `tubelet` frames a token).

    Joint attention: both from the one attention over all patches. Divided attention: the space distance
    from the space attention (within each frame, mean over frames and queries), the time distance from
    the time attention (at each position, mean over positions and queries); each step moves along its
    own axis only.
    """
    if tuple(grid) != tuple(attention.grid):
        raise ValueError(f"grid {tuple(grid)} is not the attention's {tuple(attention.grid)}")
    t, h, w = grid
    p = attention.num_prefix_tokens
    if attention.kind == "joint":
        attn = attention.joint[..., p:, p:].double()
        coords = token_coordinates(grid, attn.device).double()
        space_d = torch.cdist(coords[:, 1:], coords[:, 1:]) * patch_size
        time_d = (coords[:, None, 0] - coords[None, :, 0]).abs() * tubelet
        return _weighted_mean(attn, space_d).float(), _weighted_mean(attn, time_d).float()
    space = attention.space[..., p:, p:].double()  # [L, H, t, s, s]
    coords = token_coordinates((1, h, w), space.device).double()
    space_d = torch.cdist(coords[:, 1:], coords[:, 1:]) * patch_size
    frames = torch.arange(t, device=space.device, dtype=torch.float64)
    time_d = (frames[:, None] - frames[None, :]).abs() * tubelet
    return _weighted_mean(space, space_d).mean(dim=-1).float(), _weighted_mean(attention.time.double(), time_d).mean(dim=-1).float()


def _divided_steps(attn: list[torch.Tensor], grads: list[torch.Tensor], grid: tuple[int, int, int], b: int):
    """Each block's (time, space) terms of the rule for divided attention, in forward order, as the
    attentions are shaped: mean_h (G ⊙ A)⁺, time [B, s, t, t] (position s's rows over the frames),
    space [B, t, 1 + s, 1 + s] (frame t's rows over the cls token and its patches)."""
    t, h, w = grid
    s = h * w
    for time_a, time_g, space_a, space_g in zip(attn[0::2], grads[0::2], attn[1::2], grads[1::2]):
        yield (relevance_layer(time_a.detach().float(), time_g.float()).reshape(b, s, t, t),
               relevance_layer(space_a.detach().float(), space_g.float()).reshape(b, t, 1 + s, 1 + s))


def _divided_terms(attn: list[torch.Tensor], grads: list[torch.Tensor], grid: tuple[int, int, int], b: int) -> list[torch.Tensor]:
    """Each step's term on all N tokens, [B, N, N], in forward order (a block's time step, then its space
    step), placed as `divided_step_matrices` places the attention, but for the cls token's rows: the
    time term's is 0 (the cls token takes no part in the time attention), the space term's the SUM
    over frames of its rows (the gradient of each frame's cls row already carries the 1/t of the mean
    that makes its update, so each frame's G ⊙ A is that frame's whole share; the rollout, reading the
    attention alone, takes their mean)."""
    t = grid[0]
    terms = []
    for time, space in _divided_steps(attn, grads, grid, b):
        pairs = [divided_step_matrices(time[i], space[i], grid) for i in range(b)]
        time_terms = torch.stack([pair[0] for pair in pairs])
        time_terms[:, 0, 0] = 0.0
        space_terms = torch.stack([pair[1] for pair in pairs])
        space_terms[:, 0] *= t
        terms += [time_terms, space_terms]
    return terms


def _row_time(v: torch.Tensor, time: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """v·T for rows v [B, N] and a block's time term [B, s, t, t] (`_divided_steps`), without the N x N
    matrix: Σ_f v[(f, p)] time[p, f, g] at patch (g, p); 0 at the cls token (T's cls column is 0)."""
    t, h, w = grid
    b, s = v.shape[0], h * w
    by_time = torch.einsum("bfp,bpfg->bgp", v[:, 1:].reshape(b, t, s), time).reshape(b, t * s)
    return torch.cat([torch.zeros_like(v[:, :1]), by_time], dim=1)


def _row_space(v: torch.Tensor, space: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """v·S for rows v [B, N] and a block's space term [B, t, 1 + s, 1 + s], S as `_divided_terms` places
    it (the cls token's row the sum over frames of its rows), without the N x N matrix."""
    t, h, w = grid
    b, s = v.shape[0], h * w
    weights = torch.cat([v[:, None, :1].expand(b, t, 1), v[:, 1:].reshape(b, t, s)], dim=2)  # frame f's rows: [cls, its patches]
    out = torch.einsum("bfj,bfjk->bfk", weights, space)  # [B, t, 1 + s]
    return torch.cat([out[:, :, 0].sum(dim=1, keepdim=True), out[:, :, 1:].reshape(b, t * s)], dim=1)


def space_time_relevance(model: VideoViT, videos: torch.Tensor, target: int | torch.Tensor | None = None, *,
                         query: Query | None = None) -> torch.Tensor:
    """Chefer et al. 2021's gradient relevance over all N tokens of each clip, R [B, N, N], of a `VideoViT`
    with a head.

    With A_l block l's softmax output [B, H, N, N] and G_l = dy_c/dA_l the gradient of the target logit
    y_c with respect to that same A_l: R = I, then for l = 1..L in forward order R <- R + mean_h (G_l ⊙ A_l)⁺ R
    (`vitviz.relevance.gradient_relevance`). Row 0 is the cls token's; `frame_maps(R[b], grid)` its map
    per tubelet. The gradients are taken with `torch.autograd.grad` from one forward: the parameters'
    `.grad` are left as they are.

    Divided attention (TimeSformer): each block is two steps of the rule, its time attention's then its
    space attention's, each term mean_h (G ⊙ A)⁺ of that attention placed on the N tokens as the
    rollout places the attention (`divided_step_matrices`: a patch's time row over its own position in
    every frame, its space row over its frame and the cls token), but for the cls token's rows: the
    time term's is 0 (the cls token takes no part in it) and the space term's the sum over frames of
    its rows (each frame's gradient already carries the 1/t of the mean that makes the cls token's
    update): R <- R + T_l R, then R <- R + S_l R.

    Args:
        videos: [B, T, 3, H, W] or one clip [T, 3, H, W] (then B = 1), prepared as the model's spec says.
        target: the class explained: one index for every clip, or one per clip [B]; None: each clip's
            predicted class.
        query: None: the whole R [B, N, N]; a token (0) or "pool": that query's row of R only, [B, N],
            as a vector times each layer's term from the last (q·R = q·(I + Ā_L)···(I + Ā_1): N² a layer
            instead of N³).
    """
    logits, attn, grads, grid = _relevance_pass(model, videos, target)
    return _relevance_of(model, attn, grads, grid, query, logits.shape[0])


def _relevance_pass(model: VideoViT, videos: torch.Tensor, target: int | torch.Tensor | None):
    """One forward keeping each attention on the graph and one backward of the targets' logits:
    (logits [B, C], the attentions, their gradients, the grid)."""
    c = model.config
    if not c.num_classes:
        raise ValueError("space_time_relevance explains a class: this model has no head")
    if videos.ndim == 4:
        videos = videos[None]
    videos = videos.detach().requires_grad_(True)  # so that the attention is on the graph whatever the parameters' flags
    with torch.enable_grad(), record_attention(model, graph=True) as rec:
        logits = model(videos)
    b = logits.shape[0]
    if target is None:
        target = logits.detach().argmax(dim=-1)
    target = torch.as_tensor(target, device=logits.device).long().reshape(-1)
    if target.numel() not in (1, b):
        raise ValueError(f"target is one class or one per clip ({b}), not {target.numel()}")
    target = target.expand(b)
    if ((target < 0) | (target >= c.num_classes)).any():
        raise ValueError(f"target must lie in 0..{c.num_classes - 1}, got {target.tolist()}")
    attn = rec.graph_attentions
    grads = torch.autograd.grad(logits.gather(1, target[:, None]).sum(), attn)
    return logits.detach(), attn, grads, model.grid_for(videos)


def _relevance_of(model: VideoViT, attn, grads, grid: tuple[int, int, int], query: Query | None, b: int) -> torch.Tensor:
    """`space_time_relevance` of `b` clips from their pass's attentions and gradients."""
    c = model.config
    if c.attention == "joint" and query is None:
        return gradient_relevance(torch.stack([a.detach().float() for a in attn]), torch.stack([g.float() for g in grads]))
    if c.attention == "divided" and query is None:
        return relevance_from_layers(_divided_terms(list(attn), list(grads), grid, b))
    n = c.num_prefix_tokens + grid[0] * grid[1] * grid[2]
    v = _query_vector(query, n, c.num_prefix_tokens, grads[-1].float()).expand(b, -1)
    if c.attention == "joint":
        for a, g in zip(reversed(attn), reversed(grads)):
            v = v + torch.bmm(v[:, None], relevance_layer(a.detach().float(), g.float()))[:, 0]
            steps.step()
        return v
    for time, space in reversed(list(_divided_steps(list(attn), list(grads), grid, b))):  # R = ... (I + S_l)(I + T_l) ...
        v = v + _row_space(v, space, grid)
        v = v + _row_time(v, time, grid)
        steps.step()
    return v


def attention_and_relevance(model: VideoViT, video: torch.Tensor, target: int | None = None, *, query: Query = 0,
                            head_fusion: HeadFusion = "mean") -> tuple[VideoAttention, torch.Tensor]:
    """One clip's attention, each layer's heads fused (as `VideoViT.attention(video, head_fusion=...)`,
    its `logits` the forward's), and the relevance row of `query` for `target` (default the predicted
    class; as `space_time_relevance(model, video, target, query=query)[0]`), from one forward and one
    backward: what the Video tab's relevance map reads, without a second forward for the attention.

    Args:
        video: one clip [T, 3, H, W] or [1, T, 3, H, W].
    """
    if video.ndim == 5 and video.shape[0] != 1:
        raise ValueError(f"attention_and_relevance reads one clip, [1, T, 3, H, W] or [T, 3, H, W]; got {list(video.shape)}")
    with model.recording_pool() as pooled:
        logits, attn, grads, grid = _relevance_pass(model, video, target)
    row = _relevance_of(model, attn, grads, grid, query, 1)[0]
    fused = [fuse_heads(a.detach(), head_fusion, dim=1).unsqueeze(1) for a in attn]
    return model.attention_of(fused, grid, pool=pool_row(pooled), logits=logits[0]), row
