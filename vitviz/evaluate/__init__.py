"""Dataset statistics and an explanation benchmark over a folder of images, on one process or many.

    python -m vitviz.evaluate DATA --model shapes_p16 --methods rollout,gradient \\
        --metrics distance,pointing,deletion,insertion --out results/
    torchrun --nproc_per_node=2 -m vitviz.evaluate DATA --model vit_b_16 --out results/   # gloo on CPU, NCCL on GPUs
    srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=4 --rdzv_backend=c10d \\
        --rdzv_endpoint=$HEAD_NODE:29500 -m vitviz.evaluate DATA --model vit_b_16 --out results/

DATA is a folder of images, searched recursively; in the ImageFolder layout (DATA/<class>/<image>)
the folder's name is the image's class, and the class explained and scored is that one when the
model knows it (else its top-1). Object masks for the pointing game lie under DATA/masks/ with the
image's relative path and stem (any image format; white on the object; the size of its image).
Images and masks pass the app's image gate (`vitviz.load_image`); one it refuses is an error in its
image's row and stops nothing. `python -m vitviz.shapes DIR --n 1000` writes such a folder.

Metrics: "distance" (mean attention distance per layer and head, the paper's Figure 7, averaged over
images), "pointing" (does each method's map peak on the object, dilated by one patch), "deletion" and
"insertion" (area under the class probability's curve as patches go in the map's order; a random
order, seeded by the image's relative path, is scored beside every method); and, asked for by name
(not in the default set), "inside": per image, from the same forward, the first layer at which the
logit lens ranks the image's class top-1 (0 = the embedding) and the direct logit attribution of
that class per head [L, H] (`vitviz.inside`); summary.csv gets the mean of that layer and the share
of images where it never comes, heads.csv each head's mean attribution, summary.md the top five.

Published protocols, by name, their settings fixed (`PROTOCOLS`; --metrics and --steps are refused
with them): --protocol chefer2021 (or chefer2021-target) is Chefer et al. 2021's positive and
negative perturbation test, metrics "positive" and "negative": accuracy against each image's class
(its folder) with 0 %, 10 %, ..., 90 % of the pixels removed, AUC = np.trapz x 100, maps of the
predicted class (or of the image's class); --protocol rise is RISE's deletion (to zeros) and insertion
(from a blurred copy), S pixels a step on S x S images, the predicted class's probability, RISE's
area. Both resize images to S x S as their authors' loaders do (no crop); see
`vitviz.faithfulness` for the definitions, docs/evaluate.md for the command that reproduces Chefer
et al.'s table on ImageNet.

Image–text models (CLIP, shapes_clip) are explained for a phrase: --text "a red star" for every image,
or --captions FILE.csv (columns file,text; `read_captions`) for a phrase per image; each method's map
is then the phrase's, the pointing game uses the masks as for classes, and deletion and insertion
record the image–text similarity (logits_per_image, not a probability) of the perturbed image. The images are cut into
global batches of --batch-size in file order, dealt to the ranks in turn: every image is scored
once, by the same batch whatever the number of processes, and none is repeated to pad a rank. Each
rank appends one line per image to its shard (DIR/shards/): the image's relative path, its stamp (the
sha256 of its bytes, and of its mask's: an image is known by its content, not its size or time), the
sha256 of the bytes scored, and the results. A run started again skips the images already there;
run.json holds the settings and the list of files with their stamps, and a run into the same DIR
after DATA changed is refused, or with --rescan scores what is new or changed and drops the rows of
what is gone. --out is a folder outside DATA that is new, empty, or holds a run of vitviz.evaluate
(which it resumes); any other is refused before anything is written, as is every mistake. Rank 0
checks every shard line, merges the rows of the current files into per_image.csv and computes the
dataset figures from them in file order, so one process and many write the same summary.csv (mean
and 95 % interval per method and metric: Wilson's for the pointing game), distance.csv/.png and
curves.png (each curve over the fractions of patches its points really removed,
round(i * N / steps) / N of N patches, as the areas in summary.csv are).

A row whose file could not be read (the image's, or the mask of an image that was scored) is scored
again by the next run; a row the image gate refused stays while its file is unchanged. run.json
counts the images scored and failed, and records each session that scored images (processes,
seconds, images per second); its top-level rate covers every session listed. A mistake in the
command is one line on stderr and exit status 2 (nothing written), a run that scored nothing exit
status 1, Ctrl-C exit status 130 (run the same command again to go on); --debug shows the
traceback. Every CSV cell of text that a spreadsheet would read as a formula (it starts with =, +,
-, @, a tab or a carriage return) is written with a leading ' (OWASP's rule).

    summary = vitviz.evaluate.summarize("results/")     # the same summary, from Python

A video model (`shapes_video`, an `hf:` TimeSformer, VideoMAE, ViViT or V-JEPA 2) is scored over a
folder of clips instead, on one process, by `vitviz.evaluate.clips` (its doc: the clips, their masks
a frame at a time, the methods rollout and gradient, the metrics distance in space and time, pointing
per tubelet, deletion and insertion over space-time patches, the model's accuracy); --protocol,
--text, --captions and --workers are refused for it. `python -m vitviz.video.shapes CLIPS --n 100`
writes such a folder.
"""

from vitviz.evaluate.cli import main
from vitviz.evaluate.data import (
    EXTRA_METRICS, MAX_TEXT_CHARS, METRICS, PROTOCOLS, Z95, EvalDataset, EvaluateError, EvaluateWarning, Item, Protocol, scan,
)
from vitviz.evaluate.entry import evaluate, summarize
from vitviz.evaluate.figures import wilson
from vitviz.evaluate.run import read_captions

__all__ = ["METRICS", "EXTRA_METRICS", "PROTOCOLS", "Protocol", "MAX_TEXT_CHARS", "Item", "EvaluateError", "EvaluateWarning", "scan", "read_captions",
           "EvalDataset", "Z95", "wilson", "evaluate", "summarize", "main"]
