"""Inside the model: what each layer would predict, what each head writes into the answer, and what
happens when heads are switched off.

- Logit lens (nostalgebraist 2020, "interpreting GPT: the logit lens"): the residual stream after
  block l (l = 0: the embedding) read through the model's own final norm, pooling and head, as if
  the blocks after l were skipped: `lens_of(stream)` [L+1, C].
- Direct logit attribution (Elhage et al. 2021, "A Mathematical Framework for Transformer
  Circuits"; TransformerLens's conventions): the target logit split exactly into the embedding,
  every head, every attention output bias, every MLP and the biases of the norm and the head, with
  the final norm's scale frozen at its value in the forward: `attribution_of(stream, target)`.
- Head ablation (Michel et al. 2019, "Are Sixteen Heads Really Better than One?"): the forward
  again with some heads' outputs replaced by zeros or by their mean over the image's patch tokens:
  `ablate`, and every head on its own: `head_importance`.

The residual stream of a vitviz ViT (`vitviz.model`), x_l [N, D] after block l:

    x_0 = tokens(image)        patch embedding + position embeddings, the prefix tokens (and CLIP's norm_pre)
    x_l = x_{l-1} + LS1 ⊙ (sum_h o_{l,h} W_{O,l,h}^T + b_{O,l}) + LS2 ⊙ MLP_l(LN(x_{l-1} + ...))

where o_{l,h} = A_h V_h [N, d] is head h's slice of the attention output before the output
projection `Attention.proj` (W_O [D, D], its columns h*d .. (h+1)*d are W_{O,l,h}) and LS the
LayerScale (1 without it). So x_L = embedding + heads + attention biases + MLPs.

The classifier reads the residual through its query ("readout"):
- "token": the cls token (DeiT: the cls and the distillation token, Q = 2, each with its head, the
  logits their mean), after the final LayerNorm;
- "mean": the mean of the patch tokens, then `fc_norm` (timm's pooled models; or no norm at all);
- "normed mean": each patch token through the final LayerNorm, then their mean (no fc_norm);
- "attention pool": SigLIP's MAP head (attention, then an MLP with its residual) reads every
  token: the lens applies it, but it is not linear in the stream, so there is no exact direct
  logit attribution (`attribution_of` says so).
A LayerNorm is z = γ ⊙ (x − mean(x)) / σ + β with σ = sqrt(var(x) + eps). Freezing σ at its value in
the forward makes z linear in the components: z = γ ⊙ Σ_c centre(c)/σ + β, with one σ per token for
"normed mean". An RMSNorm (AIMv2's) is z = γ ⊙ x / σ with σ = sqrt(mean(x²) + eps): the same with no
centring and no β. Each `Stream` component is already read at the query and divided by the forward's σ
(not yet centred); `attribution_of` centres it, multiplies by γ and projects it on the target's
direction:

    logit_t = Σ_c r_t · (γ ⊙ centre(ĉ)) + r_t · β + b_t

with r_t the target's row of the head (DeiT: half of each head's row on its token) and b_t its bias.
For an image–text model the logit is exp(s) cos(P z, text_t) (+ bias): r_t = exp(s) P^T text_t /
||P z|| with ||P z|| frozen at the forward's too, so the parts add up to the similarity logit.

Nothing here changes weights: the capture and the ablations are forward hooks that live for one
call (`record_stream`, `_ablating`) and act only in the thread that opened them.
"""

from vitviz.inside.ablation import Ablation, ablate, head_importance
from vitviz.inside.attribution import Attribution, attribution_of, logit_attribution
from vitviz.inside.lens import class_across_depth, first_top1_layer, lens_of, lens_top_k, logit_lens
from vitviz.inside.report import main, report
from vitviz.inside.stream import AblationMode, Readout, Stream, StreamRecord, Target, Unembed, readout_of, record_stream, stream_of

__all__ = [
    "Ablation",
    "Attribution",
    "Stream",
    "Unembed",
    "ablate",
    "attribution_of",
    "class_across_depth",
    "first_top1_layer",
    "head_importance",
    "lens_of",
    "lens_top_k",
    "logit_attribution",
    "logit_lens",
    "main",
    "readout_of",
    "record_stream",
    "report",
    "StreamRecord",
    "stream_of",
    "Readout",
    "AblationMode",
    "Target",
]
