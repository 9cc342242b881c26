"""The top-k sparse autoencoder of Gao et al. 2024, "Scaling and evaluating sparse autoencoders"
(arXiv:2406.04093), and one step of its training: pure tensor maths, no model, no files.

    z  = TopK(W_enc (x − b_dec) + b_enc)      the k largest pre-activations kept as they are, the rest 0
    x̂  = W_dec z + b_dec                      W_dec's columns (one per feature) of unit norm

x [..., D] is one token of a ViT's residual stream, z [..., F] its F features, k of them non-zero.
There is no ReLU: a feature among the k largest keeps its value even when it is negative (the
reference code, openai/sparse_autoencoder's `train.py`, applies a ReLU after the top-k; this one
does not).

A training step (`train_step`), as that reference takes it:

    loss = scale · ( Σ_t ||x_t − x̂_t||²  +  α Σ_t ||e_t − ê_t||² )          α = 1/32 (`AUX_WEIGHT`)

the first sum the reconstruction error of the step's tokens; the second AuxK's, against dead
features: e = x − x̂ (held fixed) is the error left, ê = W_dec z_aux its reconstruction from the
`k_aux` largest pre-activations of the dead features alone (no b_dec). `scale` is the caller's: the
trainer divides by the step's token count and the data's variance (`vitviz.concepts.train`).
Then the gradient of each decoder column is made orthogonal to the column (its component along the
column removed: a step along it would only change the column's norm), the optimizer steps, and the
columns are set back to unit norm. (The reference renormalises after the next step's backward,
just before removing the component, so its forwards see the columns as the optimizer left them;
here they are unit vectors again as soon as a step ends, as a saved or evaluated SAE needs them.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["TopKSAE", "AUX_WEIGHT", "LossTerms", "StepResult", "loss_terms", "remove_parallel_grad_", "train_step"]

AUX_WEIGHT = 1 / 32  # α of the AuxK loss (Gao et al. 2024, section 2.4 and appendix A.2)


class TopKSAE(nn.Module):
    """A top-k sparse autoencoder of `d_in` channels with `features` features, `k` of them active per token.

    Attributes:
        W_enc: [F, D].
        b_enc: [F].
        W_dec: [D, F], each column (a feature's direction) of unit norm.
        b_dec: [D], the pre-bias: subtracted before encoding, added after decoding.

    Made as Gao et al. initialise it (`reset_parameters`): W_dec's columns random unit vectors,
    W_enc = W_decᵀ, both biases 0 (the trainer then sets b_dec to the data's mean).
    """

    def __init__(self, d_in: int, features: int, k: int) -> None:
        super().__init__()
        if not 1 <= k <= features:
            raise ValueError(f"k is {k}; it is the number of features kept per token, 1 to features ({features})")
        if d_in < 1:
            raise ValueError(f"d_in is {d_in}; it is the number of channels, 1 or more")
        self.d_in, self.features, self.k = d_in, features, k
        self.W_enc = nn.Parameter(torch.empty(features, d_in))
        self.b_enc = nn.Parameter(torch.zeros(features))
        self.W_dec = nn.Parameter(torch.empty(d_in, features))
        self.b_dec = nn.Parameter(torch.zeros(d_in))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, *, generator: torch.Generator | None = None) -> None:
        """W_dec: Gaussian columns made unit vectors; W_enc = W_decᵀ; b_enc = b_dec = 0. Drawn on the
        CPU from `generator` (default torch's), so that a seed gives the same weights anywhere."""
        w = torch.randn(self.d_in, self.features, generator=generator, dtype=torch.float32)
        w /= w.norm(dim=0, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
        self.W_dec.copy_(w)
        self.W_enc.copy_(w.T)
        self.b_enc.zero_()
        self.b_dec.zero_()

    def pre_activations(self, x: Tensor) -> Tensor:
        """x [..., D] -> (x − b_dec) W_encᵀ + b_enc [..., F]."""
        if x.shape[-1] != self.d_in:
            raise ValueError(f"expected tokens of {self.d_in} channels [..., {self.d_in}], got {list(x.shape)}")
        return (x - self.b_dec) @ self.W_enc.T + self.b_enc

    def _top_k(self, pre: Tensor) -> Tensor:
        values, index = pre.topk(self.k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, index, values)

    def encode(self, x: Tensor) -> Tensor:
        """x [..., D] -> z [..., F]: the k largest pre-activations as they are, the others 0."""
        return self._top_k(self.pre_activations(x))

    def decode(self, z: Tensor) -> Tensor:
        """z [..., F] -> z W_decᵀ + b_dec [..., D]."""
        return z @ self.W_dec.T + self.b_dec

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [..., D] -> (x̂ [..., D], z [..., F])."""
        z = self.encode(x)
        return self.decode(z), z

    @torch.no_grad()
    def normalize_decoder_(self) -> None:
        """Each column of W_dec divided by its norm."""
        self.W_dec /= self.W_dec.norm(dim=0, keepdim=True).clamp_min(torch.finfo(self.W_dec.dtype).tiny)

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, features={self.features}, k={self.k}"


@dataclass
class LossTerms:
    """The sums of one step's tokens, before any scale.

    Attributes:
        recon: Σ_t ||x_t − x̂_t||² (a scalar with its graph).
        aux: Σ_t ||e_t − ê_t||², AuxK's (0 without dead features).
        z: the features [T, F].
        x_hat: the reconstructions [T, D].
    """

    recon: Tensor
    aux: Tensor
    z: Tensor
    x_hat: Tensor


def loss_terms(sae: TopKSAE, x: Tensor, *, dead: Tensor | None = None, k_aux: int = 0) -> LossTerms:
    """The reconstruction and AuxK sums of tokens x [T, D] (see the module's doc).

    Args:
        dead: bool [F], the features counted dead (None: none).
        k_aux: how many of the dead features' largest pre-activations reconstruct the error (at most
            as many as are dead).
    """
    pre = sae.pre_activations(x)
    return _terms(sae, x, pre, sae._top_k(pre), dead=dead, k_aux=k_aux)


def _terms(sae: TopKSAE, x: Tensor, pre: Tensor, z: Tensor, *, dead: Tensor | None, k_aux: int) -> LossTerms:
    x_hat = sae.decode(z)
    recon = (x - x_hat).pow(2).sum()
    aux = recon.new_zeros(())
    kept = 0 if dead is None else min(k_aux, int(dead.sum()))
    if kept > 0 and x.shape[0] > 0:
        values, index = pre.masked_fill(~dead.to(pre.device), float("-inf")).topk(kept, dim=-1)
        z_aux = torch.zeros_like(pre).scatter(-1, index, values)
        error = (x - x_hat).detach()  # e: the error the live features leave, a fixed target
        aux = (error - z_aux @ sae.W_dec.T).pow(2).sum()
    return LossTerms(recon=recon, aux=aux, z=z, x_hat=x_hat)


@torch.no_grad()
def remove_parallel_grad_(sae: TopKSAE) -> None:
    """W_dec's gradient, each column g_f made orthogonal to its unit column w_f: g_f − (w_f·g_f) w_f."""
    w, g = sae.W_dec, sae.W_dec.grad
    if g is None:
        return
    g -= (w * g).sum(dim=0, keepdim=True) * w


@dataclass
class StepResult:
    """What a step computed on its tokens (this process' share of the step's).

    Attributes:
        loss: the scaled loss of these tokens (their share of the step's).
        recon: their Σ ||x − x̂||².
        aux: their AuxK sum.
        l0: Σ over these tokens of the features that fired (z ≠ 0).
        fired: bool [F], the features that fired on at least one of these tokens.
    """

    loss: float
    recon: float
    aux: float
    l0: int
    fired: Tensor


def train_step(
    sae: TopKSAE, optimizer: torch.optim.Optimizer, x: Tensor, *, scale: float, dead_of: Callable[[Tensor], Tensor | None] | None = None,
    k_aux: int = 0, aux_weight: float = AUX_WEIGHT, all_reduce: Callable[[Tensor], None] | None = None,
) -> StepResult:
    """One step on tokens x [T, D]: the loss scale · (recon + α aux), its gradient (summed over the
    processes by `all_reduce`, in place, when there are several), W_dec's gradient made orthogonal to
    its columns, the optimizer's step, W_dec's columns back to unit norm.

    Args:
        scale: what the sums are multiplied by (the trainer's 1 / (the step's tokens on every process ·
            the data's variance)).
        dead_of: the fired features (bool [F]) -> the dead features for AuxK (bool [F]) or None;
            between the two, the trainer gathers the other processes' and counts (as the reference,
            which counts the step's firing before AuxK reads the dead).
        k_aux: AuxK's number of features.
        aux_weight: α.
        all_reduce: sums a tensor over the processes, in place.
    """
    optimizer.zero_grad(set_to_none=False)
    pre = sae.pre_activations(x)
    z = sae._top_k(pre)
    fired = (z.detach() != 0).any(dim=0)  # (all False for no tokens)
    dead = dead_of(fired) if dead_of is not None else None
    terms = _terms(sae, x, pre, z, dead=dead, k_aux=k_aux)
    loss = scale * (terms.recon + aux_weight * terms.aux)
    loss.backward()
    for p in sae.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if all_reduce is not None:
            all_reduce(p.grad)
    remove_parallel_grad_(sae)
    optimizer.step()
    sae.normalize_decoder_()
    return StepResult(loss=float(loss.detach()), recon=float(terms.recon.detach()), aux=float(terms.aux.detach()),
                      l0=int((terms.z != 0).sum()), fired=fired)
