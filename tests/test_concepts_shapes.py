"""The measure of the embedded SAE's features (`vitviz.dev.concepts_shapes`): AUROC by ranks, patch labels from masks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vitviz import shapes
from vitviz.dev.concepts_shapes import OUT, _labels, auroc, measure


def test_auroc_is_the_share_of_positive_negative_pairs_in_order():
    torch.manual_seed(0)
    scores = torch.randn(80, 4)
    scores[scores < 0.4] = 0  # sparse, as top-k codes are: many ties at zero
    labels = torch.rand(80, 3) > 0.6
    table = auroc(scores, labels)
    for a in range(3):
        for f in range(4):
            pos, neg = scores[labels[:, a], f], scores[~labels[:, a], f]
            pairs = (pos[:, None] > neg[None]).double() + 0.5 * (pos[:, None] == neg[None]).double()
            assert float(table[a, f]) == pytest.approx(float(pairs.mean()), abs=1e-12)
    perfect = auroc(labels.double()[:, :1] * 2.0, labels[:, :1])
    assert float(perfect[0, 0]) == 1.0


def test_a_patch_is_labelled_by_the_objects_covering_half_of_it():
    masks = np.zeros((2, 32, 32), dtype=bool)
    masks[0, :16, :16] = True  # patch (0, 0) whole
    masks[0, :16, 16:23] = True  # patch (0, 1): 7 of 16 columns, under half
    masks[1, 16:, 16:24] = True  # patch (1, 1): exactly half
    labels = _labels([[("red", "star"), ("blue", "ring")]], [masks], 16)  # a 2 x 2 grid
    attrs = list(shapes.CLASSES) + list(shapes.COLORS)
    star, red, ring, blue = (attrs.index(a) for a in ("star", "red", "ring", "blue"))
    assert labels.shape == (4, 14)
    assert labels[0, star] and labels[0, red] and not labels[1].any()
    assert labels[3, ring] and labels[3, blue] and not labels[3, star] and labels.sum() == 4


@pytest.mark.skipif(not (OUT / "card.json").is_file(), reason="the embedded SAE is not in assets/concepts/shapes_p16")
def test_the_measure_runs_on_the_embedded_sae():
    out = measure(24)
    assert out["patches"] == 24 * 36 and set(out["trained"]) == set(shapes.CLASSES) | set(shapes.COLORS)
    for name in ("trained", "random"):
        assert all(0.0 <= v["auroc"] <= 1.0 and 0 <= v["feature"] < out["features"] for v in out[name].values())
        assert 0 <= out[f"{name}_at_0.9"] <= 14
