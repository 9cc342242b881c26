"""Side-by-side timings of vitviz against torchvision's plain forward, on the same weights.

    python -m vitviz.dev.bench                   # ViT-B/16, batch 1, CPU (and CUDA when available)
    python -m vitviz.dev.bench --rounds 30 --arch vit_b_32
    python -m vitviz.dev.bench --app             # end to end through the running app (gradio_client)
    python -m vitviz.dev.bench --browser         # in Chromium: view changes and a new analysis, as a person sees them
    python -m vitviz.dev.bench --handler         # a new analysis in the app's handler, explorer file included, no browser
    python -m vitviz.dev.bench --evaluate        # python -m vitviz.evaluate on 1 and 2 processes against plain forwards
    python -m vitviz.dev.bench --serving         # each kind of request priced and measured; one client's share of the queue
    python -m vitviz.dev.bench --serving --repeats 3 --rows runs.json   # each request's median of 3 runs; the runs saved
    python -m vitviz.dev.bench --serving --reprice runs.json more.json  # saved runs priced again, nothing measured
    python -m vitviz.dev.bench --inputs          # hostile images from a checkout's tests/corpus.py: time and peak memory
    python -m vitviz.dev.bench --training        # a shapes training step: fused and plain attention, Muon and AdamW, torch.compile
    python -m vitviz.dev.bench --families        # DINOv3 B/16 and SigLIP 2 B/16 NaFlex at 512 px against timm's and transformers' forwards
    python -m vitviz.dev.bench --patching        # vitviz.patch over every resid_pre site of --arch against one forward
    python -m vitviz.dev.bench --video           # VideoMAE-B/16 at 16 frames: the Video tab's analysis and relevance against a forward
    python -m vitviz.dev.bench --device cuda     # any row above on CUDA only (cpu: GPUs hidden; auto, the default: as each row says)

Each round runs every candidate once, in a rotating order, so that drifts in clock speed and
cache state hit all of them alike; the table shows medians and ratios to torchvision's forward.
Weights are random (the cost does not depend on their values), so no download is needed.

--device auto (the default) times the model paths and --relevance on the CPU and, when there is a
GPU, on CUDA; --training and the in-memory passes of --evaluate on the CPU; the app's rows
(--handler, --app, --browser, --serving) and the evaluator's runs on the device the app and the
evaluator choose themselves (CUDA when there is one). --device cpu hides every GPU from this process
and the processes it starts; --device cuda runs every row that has a device on CUDA (`.ci/gpu`).
"""

from vitviz.dev.bench.app import app_table, handler_table
from vitviz.dev.bench.browser import browser_table
from vitviz.dev.bench.cli import main
from vitviz.dev.bench.common import measure
from vitviz.dev.bench.evaluator import attention_part_table, evaluate_table, evaluator_pass_table
from vitviz.dev.bench.families import families_table
from vitviz.dev.bench.inputs import inputs_table
from vitviz.dev.bench.patching import patching_table
from vitviz.dev.bench.paths import model_path_table, relevance_table
from vitviz.dev.bench.serving import flood_table, serving_table
from vitviz.dev.bench.training import training_table
from vitviz.dev.bench.video import video_table


__all__ = ["measure", "main", "model_path_table", "relevance_table", "handler_table", "app_table", "browser_table",
           "evaluate_table", "evaluator_pass_table", "attention_part_table", "serving_table", "flood_table", "inputs_table",
           "training_table", "families_table", "patching_table", "video_table"]
