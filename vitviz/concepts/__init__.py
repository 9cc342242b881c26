"""Concepts: a top-k sparse autoencoder (Gao et al. 2024, "Scaling and evaluating sparse
autoencoders") trained on one layer of a ViT over a folder of images, its features' strongest
patches, and its evaluation as ViT-Prisma reports it.

    python -m vitviz.concepts train DATA --model shapes_p16 --layer 3 --features 256 --k 8 --out sae/
    torchrun --nproc_per_node=2 -m vitviz.concepts train DATA ... --out sae/

    sae, card, index, atlas = vitviz.concepts.read_concepts("sae/")
    x_hat, z = sae(tokens)                         # tokens [..., D] of the layer the card names

`TopKSAE` is the model (`vitviz.concepts.sae`), `train` the training and its evaluation
(`vitviz.concepts.train`), `save_concepts` / `read_concepts` the folder it writes
(`vitviz.concepts.store`). Training is a command (and this function), never an action of the app.
"""

from vitviz.concepts.sae import AUX_WEIGHT, TopKSAE, loss_terms, remove_parallel_grad_, train_step
from vitviz.concepts.store import CARD_KEYS, INDEX_KEYS, ConceptsFolderError, atlas_cell, read_concepts, save_concepts
from vitviz.concepts.train import ConceptsError, Recipe, metrics_table, train

__all__ = ["TopKSAE", "AUX_WEIGHT", "loss_terms", "remove_parallel_grad_", "train_step", "train", "Recipe", "ConceptsError",
           "metrics_table", "save_concepts", "read_concepts", "atlas_cell", "ConceptsFolderError", "CARD_KEYS", "INDEX_KEYS", "main"]


def main(argv: list[str] | None = None) -> None:
    """`python -m vitviz.concepts` (`vitviz.concepts.cli`)."""
    from vitviz.concepts.cli import main as run

    run(argv)


# browsing what an SAE found (`vitviz.concepts.browse`): the library's side of the app's Concepts tab
from vitviz.concepts.browse import ConceptFolder, ConceptMap, Concepts, Example, concept_folders, concept_map, load_concepts  # noqa: E402

__all__ += ["Concepts", "ConceptMap", "ConceptFolder", "Example", "load_concepts", "concept_map", "concept_folders"]
