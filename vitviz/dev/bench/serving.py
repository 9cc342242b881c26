"""Each kind of request priced and measured in a fresh process; another address's flood against one client's analyses."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

import vitviz
from vitviz.dev.bench.common import _private_weights, _random_torchvision_checkpoints


_KIND_CODE = """
import json, os, sys, time, torch
torch.set_num_threads({threads})
import vitviz
from vitviz.cost import forward_flops, price
from vitviz.preprocess import to_input
from vitviz.server import explaining
from vitviz.server.guards.export import Downloads
from vitviz.server.guards.memory import release_memory
from vitviz.server.models import ModelCache
from vitviz.server.pictures import explorer_data, views
from vitviz.server.pictures.drawers import drawer
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))
def skip(why):
    print(json.dumps(dict(skip=why))); sys.exit(0)
variant, kind, budget = {variant!r}, {kind!r}, {budget}
cache = ModelCache()
if kind in ("video", "video_relevance"):  # a clip through the Video tab's run and its explorer's data
    from vitviz.clips import clip_tensor, load_video
    from vitviz.server.pictures import video_explorer
    from vitviz.server.tabs import video as tab
    from vitviz.video.load import load_video_model
    spec = tab.spec_of(variant)
    model, _ = cache.get(variant, load=load_video_model)
    videos = clip_tensor(load_video("{clip}", frames=spec.frames, sampling=spec.sampling, stride=spec.frame_stride), spec.preprocessing)
    cost = price(spec, kind)
    forward = price(spec, "video").flops  # (a forward and one row through each layer)
    x = videos[None].to(next(model.parameters()).device)
    def run():
        probs, attention, maps = tab.run_clip(model, videos, "relevance" if kind == "video_relevance" else "rollout")
        video_explorer.payload(attention, tab._seen(videos, spec.preprocessing), model=variant, tubelet=spec.config.tubelet,
                               patch_size=spec.config.patch_size, scale=tab.SCALE)
else:
    model, facts = cache.get(variant)
    spec = model.spec
    forward = forward_flops(spec)
    image = "{image}"
    image_text = hasattr(model, "image")
    if kind == "faithfulness" and image_text:  # the curves follow a classifier's class
        skip("no use")
    from vitviz.server.tabs import ask as ask_tab, concepts as concepts_tab, find as find_tab, inside as inside_tab, patch as patch_tab
    from vitviz.server.tabs.base import labels_of
    exp = views.explore(cache, image, variant)
    a = exp.analysis
    inside_needs = inside_tab.TAB.needs | inside_tab.TAB.ablation_needs
    needs = dict(find=find_tab.TAB.needs, ablate=inside_needs, importance=inside_needs, patch=patch_tab.TAB.needs,
                 patch_one=patch_tab.TAB.needs, concepts=concepts_tab.TAB.needs, concept_ablate=concepts_tab.TAB.needs | {{"classes"}},
                 ask=ask_tab.TAB.needs).get(kind, ())
    if a.layout.lacks(needs):  # what its tab does not offer this model
        skip(a.layout.lacks(needs))
    labels = labels_of(a)
    maps, index = explaining.explain_exploration(cache, exp, target=None) if kind == "faithfulness" else (None, None)
    PHRASES = ["a red star", "a blue circle", "a green square", "a yellow triangle"]  # Find: four phrases at once
    options = dict(budget=budget)
    if kind in ("explain", "faithfulness", "find"):
        options.update(layer_gradients=kind in ("explain", "faithfulness"), phrases=len(PHRASES) if kind == "find" else 0)
    x = torch.zeros(1, 3, spec.image_size, spec.image_size, device=next(model.parameters()).device)
    rollout = drawer(exp).render_rollout  # what the page draws
    if kind in ("patch", "patch_one"):  # two patches swapped, as the Patch tab's "swap"
        from vitviz.patching import patch, patched_logits
        from vitviz.server.pictures import patch_maps
        pre = spec.preprocessing
        clean, corrupted = to_input(a.image, pre), to_input(patch_maps.swapped(a.image, (0, 0), (1, 1), patch_size=a.patch_size), pre)
        options["patch_kinds"] = ("resid_pre", "head") if kind == "patch" else ("head",)
    elif kind == "registers":
        from vitviz.server.tabs import tokens
        if tokens.no_register(a) is not None or not a.outliers().counts[tokens.DETECTION_LAYER]:
            skip("no high-norm token")
    elif kind in ("concepts", "concept_ablate"):
        from vitviz.concepts.browse import concept_folders, concept_map, load_concepts
        from vitviz.server.tabs.concepts import feature_ablated
        concepts = load_concepts(concept_folders(variant)[0].path)  # (the server keeps them in its store)
        options["sae"] = (concepts.layer, concepts.features, concepts.k)
    elif kind == "ask":
        from vitviz.vlm.ask import ask, vlm_of
        QUESTION, TOKENS = "how many shapes are there ?", 12
        options["ask"] = vlm_of(model).ask_shape(QUESTION, TOKENS)
        del options["budget"]
    cost = price(spec, "explain" if kind == "find" else kind, **options)
    if kind == "find":  # the tokenizer read and the text tower run once, as a server has after its first Find
        explaining.find_phrases(cache, exp, PHRASES[:1], method="gradient")

    def run():
        if kind == "analyse":
            e = views.explore(cache, image, variant); e.analysis.distances(); rollout(e)
        elif kind == "explain":
            explaining.explain_exploration(cache, exp, target=None)
        elif kind == "faithfulness":
            explaining.faithfulness_of(cache, exp, maps, target=index, batch_size=cost.batch)
        elif kind == "export":
            Downloads().npz(exp, size=cost.kept_bytes)
        elif kind == "explorer":
            drawer(exp).write_explorer(exp, key="bench", folder=Downloads().folder)
        elif kind == "view":
            rollout(exp, head_fusion="max")
        elif kind == "find":
            explaining.find_phrases(cache, exp, PHRASES, method="gradient")
        elif kind == "ablate":
            vitviz.inside.ablate(model, a.image, [(0, 0), (1, 1)], mode="zero", **labels)
        elif kind == "importance":
            vitviz.inside.head_importance(model, a.image, mode="zero", **labels)
        elif kind == "patch":
            patch(model, clean, corrupted, where=options["patch_kinds"], batch_size=cost.batch, **labels)
        elif kind == "patch_one":
            patched_logits(model, clean, corrupted, [("head", 1, 0)], **labels)
        elif kind == "registers":  # the neurons found, the model with its register analysed, both rollouts drawn
            after = views.Exploration(tokens.moved_to_register(model, a.image, tokens.DEFAULT_NEURONS)[1], exp.facts)
            rollout(exp); drawer(after).render_rollout(after)
        elif kind == "concepts":
            concept_map(model, to_input(a.image, spec.preprocessing), concepts)
        elif kind == "concept_ablate":
            feature_ablated(model, exp, concepts, 0)
        elif kind == "ask":
            ask(model, a.image, QUESTION, max_new_tokens=TOKENS)
plain_run = (lambda: model.image(x)) if kind not in ("video", "video_relevance") and image_text else (lambda: model(x))
with torch.inference_mode():
    plain_run()
    plain = []
    for _ in range(3):  # the speed a plain forward runs at here, which prices the request in seconds
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter(); plain_run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        plain.append(time.perf_counter() - t)
speed = forward / sorted(plain)[1]
release_memory(keep=0)
open("/proc/self/clear_refs", "w").write("5")  # the peak starts again from here
base = status("VmRSS")
gpu = torch.cuda.is_available()
if gpu:
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); gpu_base = torch.cuda.memory_allocated()
start = time.perf_counter()
run()
if gpu:
    torch.cuda.synchronize()
seconds = time.perf_counter() - start
gpu_peak = torch.cuda.max_memory_allocated() - gpu_base if gpu else None
print(json.dumps(dict(peak=status("VmHWM") - base, seconds=seconds, price=cost.bytes, flops=cost.flops, products=cost.products,
                      gpu_peak=gpu_peak, priced_seconds=cost.flops / speed, line=cost.line)))
"""

KINDS = ("analyse", "explain", "faithfulness", "export", "explorer", "view", "find", "ablate", "importance", "patch", "patch_one",
         "registers", "concepts", "concept_ablate", "ask", "video", "video_relevance")


def applies(variant: str, kind: str) -> bool:
    """Whether the app may serve a request of `kind` on `variant`, as far as its record tells (nothing
    loaded): a clip's kinds on a video model and no other; Ask on a VLM; Find on a model without a
    classifier, the curves on one with; concepts where an SAE of the variant is known; head ablation,
    patching, a register and concepts on a ViT with global attention. The request's process then
    asks the analysis what its tab asks (`Tab.needs`), and skips what the tab does not offer."""
    from vitviz.concepts.browse import concept_folders
    from vitviz.cost import price
    from vitviz.video.load import VIDEO_MENU, video_spec

    if variant in VIDEO_MENU:
        return kind == "video" or (kind == "video_relevance" and video_spec(variant).has_head)
    if kind in ("video", "video_relevance"):
        return False
    spec = vitviz.get_spec(variant)
    if kind == "ask":
        return spec.vlm is not None
    if kind in ("find", "faithfulness") and spec.has_head != (kind == "faithfulness"):
        return False
    if kind in ("concepts", "concept_ablate") and not concept_folders(variant):
        return False
    if kind in ("ablate", "importance", "patch", "patch_one", "registers", "concepts", "concept_ablate"):
        try:  # (refused for a windowed model; a register, also for one with relative position biases)
            price(spec, "registers" if kind == "registers" else "patch")
        except ValueError:
            return False
    return True


def serving_table(variants=("shapes_p16@384", "vit_b_16"), kinds=KINDS, *, budget: int = 6144 * 2**20, repeats: int = 1) -> list[tuple]:
    """For each variant and each kind of request it serves (`applies`), in a fresh process: (variant,
    kind, priced MB, measured peak MB above the process's resident memory before the request, priced
    seconds (its work at the speed of a plain forward of the same model, timed in that process, its
    flops as priced), priced seconds by its line's
    learned parts (`Cost.line`; `LineTimes` fed the other variants' requests of every line as
    they ran here, as a server learns from the jobs it ran: a fixed part, flops, attention products
    and bytes, and a line that ran no large job its family's speed), the same
    from their flops alone (a fixed part and a speed; both None when no other variant has one or the
    request runs no model), seconds, on a GPU the peak MB of CUDA memory allocated above what
    was before the request, else None, and priced seconds by the line's parts with each request's
    flops scaled by its variant's pace (`priced_rows`)). With `repeats`, each request's medians over
    that many runs (`measured_rows`, `merged`)."""
    return priced_rows(merged(measured_rows(variants, kinds, budget=budget, repeats=repeats)))


def measured_rows(variants, kinds=KINDS, *, budget: int = 6144 * 2**20, repeats: int = 1) -> list[dict]:
    """`serving_table`'s requests, each run in a fresh process: a dict of what it measured (peak,
    seconds, price, flops, products, gpu_peak, priced_seconds, line) with its variant and kind, and
    `round`. With `repeats` over 1, every request runs again in as many rounds, each round after the
    last has run them all (a slow minute of the machine then falls on one run of many requests, not
    on every run of one); `merged` takes their medians."""
    import subprocess
    import sys

    if repeats < 1:
        raise ValueError(f"repeats must be 1 or more, not {repeats}")
    rows = []
    with _private_weights() as torch_home:
        _random_torchvision_checkpoints([v for v in variants if v in {s.name for s in vitviz.list_variants()} and vitviz.get_spec(v).source == "torchvision"])
        examples = Path(vitviz.sources.assets_dir()) / "examples"
        requests = [(variant, kind) for variant in variants for kind in kinds if applies(variant, kind)]
        for round_ in range(repeats):
            for variant, kind in requests:
                code = _KIND_CODE.format(threads=torch.get_num_threads(), variant=variant, kind=kind, image=examples / "star.png",
                                         clip=examples / "moving.gif", budget=budget)
                env = dict(os.environ, TORCH_HOME=torch_home, VITVIZ_OFFLINE="1")
                out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
                if out.returncode:
                    raise RuntimeError(f"--serving: the {kind} of {variant} failed:\n{out.stderr[-3000:]}")
                got = json.loads(out.stdout.strip().splitlines()[-1])
                if got.get("skip"):  # a kind the model has no use for
                    continue
                rows.append(dict(got, variant=variant, kind=kind, round=round_))
    return rows


MEASURED = ("seconds", "peak", "gpu_peak", "priced_seconds")  # what differs from one run of a request to the next


def merged(rows: list[dict]) -> list[dict]:
    """`measured_rows`' rows (of one run or several, saved and read back) with each request (its
    variant and kind) once, in the order it first comes: the median of its runs' seconds, peaks and
    plain-forward seconds (`MEASURED`), `runs` how many there were, and the rest from its first run.
    Its price, flops, products and line must be the same in every run: a run of other code is refused."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["variant"], r["kind"]), []).append(r)
    out = []
    for (variant, kind), runs in groups.items():
        first = runs[0]
        for r in runs[1:]:
            for key in ("price", "flops", "products", "line"):
                if r.get(key) != first.get(key):
                    raise ValueError(f"the runs of {variant}'s {kind} differ in {key} ({first.get(key)} and {r.get(key)}): "
                                     "measured on different code, they cannot be merged")
        row = dict(first, runs=len(runs))
        row.pop("round", None)
        for key in MEASURED:
            values = [r[key] for r in runs if r.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        out.append(row)
    return out


def priced_rows(rows: list[dict], *, rate: float = 5e10) -> list[tuple]:
    """`serving_table`'s rows from `measured_rows`' requests, each priced in seconds as a server
    that ran the others would price it (see `serving_table`), at `rate` before a line has run.

    The last column asks whether a variant's pace says what its flops cost: each request's flops are
    scaled by the seconds a flop of its variant's plain forward took (the median over its requests'
    processes) at `rate`, so that a flop of a variant that runs its forward at `rate` counts once,
    and the line's parts are fitted to them as before. A server could learn that pace when it loads
    a model; before its first request it could not."""
    from vitviz.server.guards.work import LineTimes

    paces: dict[str, list[float]] = {}
    for r in rows:
        if r["flops"] > 0 and r["priced_seconds"] > 0:
            paces.setdefault(r["variant"], []).append(r["priced_seconds"] / r["flops"])
    scale = {variant: statistics.median(p) * rate for variant, p in paces.items()}

    table = []
    for row in rows:
        others = [r for r in rows if r["variant"] != row["variant"] and r["flops"] > 0]  # every line's: a family's speed is shared
        times = LineTimes(rate=rate)  # what a server learns from the other variants' jobs (at ModelWork's default rate before)
        by_flops = LineTimes(rate=rate)  # the same jobs, their bytes not told: a fixed part and a speed only
        by_pace = LineTimes(rate=rate)  # the same jobs, their flops scaled by their variants' paces
        for r in others:
            products = r.get("products", 0.0)
            times.add(r["line"], r["flops"], r["seconds"], r["variant"], nbytes=r["price"], products=products)
            by_flops.add(r["line"], r["flops"], r["seconds"], r["variant"])
            by_pace.add(r["line"], r["flops"] * scale[r["variant"]], r["seconds"], r["variant"], nbytes=r["price"],
                        products=products * scale[r["variant"]])
        ran = row["flops"] > 0 and any(r["line"] == row["line"] for r in others)
        products = row.get("products", 0.0)
        learned = times.estimate(row["line"], row["flops"], nbytes=row["price"], products=products) if ran else None
        flops_only = by_flops.estimate(row["line"], row["flops"]) if ran else None
        pace = scale[row["variant"]] if ran else 0.0
        paced = by_pace.estimate(row["line"], row["flops"] * pace, nbytes=row["price"], products=products * pace) if ran else None
        gpu = row.get("gpu_peak")
        table.append((row["variant"], row["kind"], row["price"] / 2**20, row["peak"] / 2**20, row["priced_seconds"], learned,
                      flops_only, row["seconds"], None if gpu is None else gpu / 2**20, paced))
    return table


def within(rows, column: int, *, spread: float = 1.5, least: float = 0.0) -> tuple[int, int]:
    """Of `serving_table`'s rows priced in `column` (5: line s, 6: by flops, 9: by pace) that took `least` s or
    more: (how many were priced within `spread` of their seconds, how many there are)."""
    priced = [(r[column], r[7]) for r in rows if r[column] is not None and r[7] >= least]
    return sum(1 / spread <= p / s <= spread for p, s in priced), len(priced)



def gap(rows, column: int, *, below: float = 0.3) -> tuple[float, int]:
    """Of `serving_table`'s rows priced in `column` that took under `below` s (where a fixed part of a
    few hundredths of a second is most of a price, and a ratio says little of what a server would
    refuse): (the greatest |price - seconds|, how many there are); (0.0, 0) when none."""
    gaps = [abs(r[column] - r[7]) for r in rows if r[column] is not None and r[7] < below]
    return max(gaps, default=0.0), len(gaps)


def by_kind(rows, column: int = 5, *, spread: float = 1.5) -> list[tuple]:
    """`serving_table`'s rows summed up per kind of request, in the order the kinds first come: (kind,
    how many of its rows are priced in `column` (5: line s, 6: by flops, 9: by pace), how many of them
    within `spread` of their seconds, the median and the least and greatest of those ratios (price /
    seconds; None when none is priced), then the same for its memory over the rows whose peak is over
    16 MiB (price / peak): their count, within `spread`, median, least, greatest)."""
    kinds = list(dict.fromkeys(r[1] for r in rows))

    def summary(ratios):
        if not ratios:
            return len(ratios), 0, None, None, None
        return (len(ratios), sum(1 / spread <= q <= spread for q in ratios), statistics.median(ratios), min(ratios), max(ratios))

    table = []
    for kind in kinds:
        mine = [r for r in rows if r[1] == kind]
        seconds = [r[column] / r[7] for r in mine if r[column] is not None and r[7] > 0]
        memory = [r[2] / r[3] for r in mine if r[3] > 16]
        table.append((kind, *summary(seconds), *summary(memory)))
    return table



FLOODS = {
    # what 127.0.0.2 sends, as many as its share of the queue allows (two per session)
    "swin": ("analyze", "shapes_swin@1824", None),
    "find": ("session_find", "shapes_clip@592", "a star, a circle, a square, a triangle"),
}



def flood_table(victim: str = "vit_b_16", floods=("swin", "find"), *, rounds: int = 5) -> list[tuple[str, float, float, int]]:
    """Another address's flood against one client's analyses, through the running app over raw HTTP.
    For each flood: (flood, the victim's `/analyze` seconds alone and during the flood (medians of
    `rounds`, one after another), the flood's requests completed meanwhile). The flood comes from 127.0.0.2: every
    request its share of the queue allows (`VITVIZ_ADDRESS_JOBS`, two per session), sent again as
    each ends, for as long as the victim's requests last."""
    import threading
    import uuid

    import httpx

    with _private_weights():
        if vitviz.get_spec(victim).source == "torchvision":
            _random_torchvision_checkpoints([victim])
        from vitviz.server import app

        app.demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, **app.LAUNCH_KWARGS)
        base = app.demo.local_url.rstrip("/")
        config = httpx.get(f"{base}/config").json()
        index = {d.get("api_name"): d["id"] for d in config["dependencies"]}
        image = str(Path(vitviz.sources.assets_dir()) / "examples" / "star.png")

        def client(address):
            return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=600)

        def upload(http):
            with open(image, "rb") as f:
                path = http.post(f"{base}/gradio_api/upload", files=[("files", ("star.png", f.read()))]).json()[0]
            return {"path": path, "meta": {"_type": "gradio.FileData"}}

        def call(http, name, data, session, count=1):
            """`count` joins of the event in one session, then their results; how many succeeded."""
            body = {"data": data, "fn_index": index[name], "session_hash": session, "event_data": None, "trigger_id": None}
            joined = sum(http.post(f"{base}/gradio_api/queue/join", json=body).status_code == 200 for _ in range(count))
            if not joined:
                raise RuntimeError(f"{name}: refused")
            done = ok = 0
            with http.stream("GET", f"{base}/gradio_api/queue/data", params={"session_hash": session}) as s:
                for line in s.iter_lines():
                    msg = json.loads(line[5:]) if line.startswith("data:") else {}
                    if msg.get("msg") == "process_completed":
                        done, ok = done + 1, ok + bool(msg.get("success"))
                        if done == joined:
                            break
            if count == 1 and not ok:
                raise RuntimeError(f"{name}: {msg.get('output')}")
            return ok

        rows = []
        try:
            mine = client("127.0.0.1")
            picture = upload(mine)

            def victim_seconds():
                out = []
                for _ in range(rounds):
                    start = time.perf_counter()
                    call(mine, "analyze", [picture, victim], uuid.uuid4().hex)
                    out.append(time.perf_counter() - start)
                return statistics.median(out)

            victim_seconds()  # (the model loaded and warm)
            for flood in floods:
                name, variant, text = FLOODS[flood]
                theirs = client("127.0.0.2")
                their_picture = upload(theirs)
                sessions = [uuid.uuid4().hex for _ in range(app.SERVER.settings.address_jobs // 2)]
                if text is not None:  # (each session's analysis first, its flood of phrases after)
                    for session in sessions:
                        call(theirs, "session_analyze", [their_picture, variant, "mean", 0.0, None], session)
                data = [their_picture, variant] if text is None else [None, text, "legrad"]
                alone = victim_seconds()
                stop, taken = threading.Event(), [0]

                def flooding(session):
                    with client("127.0.0.2") as http:
                        while not stop.is_set():
                            try:
                                taken[0] += call(http, name, data, session, count=2)
                            except RuntimeError:
                                time.sleep(0.05)

                threads = [threading.Thread(target=flooding, args=(s,), daemon=True) for s in sessions]
                for t in threads:
                    t.start()
                deadline = time.monotonic() + 120
                while not any(j.owner == "127.0.0.2" for j in app.SERVER.work.running()) and time.monotonic() < deadline:
                    time.sleep(0.05)
                during = victim_seconds()
                stop.set()
                for session in sessions:
                    app.SERVER.work.cancel(session)
                for t in threads:
                    t.join(600)
                rows.append((flood, alone, during, taken[0]))
        finally:
            app.demo.close()
        return rows
