"""python -m vitviz.dev.bench: the command line over every table (the package's docstring is its help)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import vitviz
from vitviz.dev.bench.app import app_table, handler_table
from vitviz.dev.bench.browser import browser_table
from vitviz.dev.bench.common import _machine, _print_table
from vitviz.dev.bench.evaluator import attention_part_table, evaluate_table, evaluator_pass_table
from vitviz.dev.bench.families import SIDE, families_table
from vitviz.dev.bench.inputs import inputs_table
from vitviz.dev.bench.patching import patching_table
from vitviz.dev.bench.video import video_table
from vitviz.dev.bench.paths import model_path_table, relevance_table
from vitviz.dev.bench.serving import FLOODS, KINDS, by_kind, flood_table, gap, measured_rows, merged, priced_rows, within
from vitviz.dev.bench.training import training_table


_SAVED = {"variant", "kind", "line", "flops", "price", "seconds", "peak", "priced_seconds"}  # what a run saved by --rows holds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m vitviz.dev.bench", description=sys.modules[__package__].__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="vit_b_16")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--cpu-only", action="store_true", help="the same as --device cpu")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: as each row says (see above); cpu: every GPU hidden from this process and the processes it "
                         "starts; cuda: every row that has a device on CUDA, an error without one")
    ap.add_argument("--app", action="store_true", help="end to end through the app instead of the model paths")
    ap.add_argument("--second", default="vit_b_32", help="the other variant of the Compare timing (with --app)")
    ap.add_argument("--browser", action="store_true", help="in Chromium: view changes and new analyses as a person sees them")
    ap.add_argument("--models", nargs="+", default=["shapes_p16", "vit_b_16"], help="the models of --browser")
    ap.add_argument("--handler", action="store_true", help="a new analysis in the app's handler (no browser) against the forward")
    ap.add_argument("--evaluate", action="store_true", help="python -m vitviz.evaluate on 1 and --processes processes")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--images", type=int, default=128)
    ap.add_argument("--metrics", default=None, help="the metrics of --evaluate (default: distance, then pointing with gradient)")
    ap.add_argument("--inputs", action="store_true", help="hostile images (a checkout's tests/corpus.py): seconds and peak memory")
    ap.add_argument("--training", action="store_true", help="a shapes_p8 training step: attention kernels, optimizers, torch.compile")
    ap.add_argument("--serving", action="store_true", help="each kind of request priced and measured; one client's share of the queue")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="the kinds of request of --serving (each where it applies)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="--serving: run every request this many times, in as many rounds, and price their medians")
    ap.add_argument("--rows", default=None, metavar="FILE", help="--serving: write each run of each request, as measured, to this JSON file")
    ap.add_argument("--reprice", nargs="+", default=None, metavar="FILE",
                    help="--serving: price the runs saved by --rows in these files (their medians per request) instead of measuring "
                         "(--models and --kinds are not used)")
    ap.add_argument("--flood", action="store_true", help="one client's analyses (--arch) while another address floods Swin or Find requests")
    ap.add_argument("--relevance", action="store_true", help="gradient relevance of a batch against a plain forward and backward")
    ap.add_argument("--families", action="store_true", help="DINOv3 B/16 (timm) and SigLIP 2 B/16 NaFlex (Hugging Face) at 512 px "
                                                            "against their library's forward")
    ap.add_argument("--video", action="store_true", help="VideoMAE-B/16 at 16 frames: the Video tab's analysis and relevance against a forward")
    ap.add_argument("--small", action="store_true", help="--video: a tiny video ViT instead (the dry run's)")
    ap.add_argument("--patching", action="store_true", help="vitviz.patch over every resid_pre site of --arch against one forward")
    ap.add_argument("--batch", type=int, default=None,
                    help="the batch of --relevance and of --evaluate's passes in memory (default 8), of --training (default 64)")
    args = ap.parse_args(argv)
    batch = args.batch or (64 if args.training else 8)
    device = "cpu" if args.cpu_only else args.device
    if device == "cpu":  # before anything asks torch about CUDA: it counts the devices once
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if torch.cuda.is_available():
            raise SystemExit("--device cpu: CUDA was queried before the GPUs could be hidden; run with CUDA_VISIBLE_DEVICES=''")
    elif device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU and a torch built with CUDA; torch.cuda.is_available() is False here "
                         "(leave out --device to time on the CPU)")
    # the model paths and --relevance: the CPU and, with a GPU, CUDA beside it; the other in-process rows: one device
    both = [torch.device(d) for d in (("cpu", "cuda") if torch.cuda.is_available() else ("cpu",))] if device == "auto" else [torch.device(device)]
    one = torch.device("cuda" if device == "cuda" else "cpu")

    def title(d: torch.device) -> str:
        return f"CUDA ({torch.cuda.get_device_name()})" if d.type == "cuda" else "CPU"

    if args.families:
        print(f"vitviz.dev.bench --families, {SIDE} px, batch 1, {args.rounds} rounds; {time.strftime('%Y-%m-%d')}; {_machine()}")
        for d in both:
            _print_table(title(d), families_table(d, rounds=args.rounds * (5 if d.type == "cuda" else 1)))
        return
    if args.video:
        print(f"vitviz.dev.bench --video, one clip, {args.rounds} rounds; {time.strftime('%Y-%m-%d')}; {_machine()}")
        for d in both:
            _print_table(title(d), video_table(d, rounds=args.rounds, small=args.small))
        return
    if args.patching:
        print(f"vitviz.dev.bench --patching {args.arch}, {args.rounds} rounds of the forward, 1 of the patching; "
              f"{time.strftime('%Y-%m-%d')}; {_machine()}")
        for d in both:
            _print_table(title(d), patching_table(args.arch, d, rounds=args.rounds))
        return
    if args.relevance:
        print(f"vitviz.dev.bench --relevance {args.arch}, batch {batch}, {args.rounds} rounds; {time.strftime('%Y-%m-%d')}; {_machine()}")
        for d in both:
            _print_table(title(d), relevance_table(args.arch, d, batch=batch, rounds=args.rounds * (3 if d.type == "cuda" else 1)))
        print("\ntarget: relevance_maps <= 1.05x the plain forward and backward")
        return
    if args.inputs:
        print(f"vitviz.dev.bench --inputs; {time.strftime('%Y-%m-%d')}; {_machine()}; each read in a fresh process, median of 5")
        print(f"\n{'input':<22}{'read by':<10}{'seconds':>10}{'peak MB':>10}")
        for name, how, seconds, peak in inputs_table():
            print(f"{name:<22}{how:<10}{seconds:>10.3f}{peak:>10.0f}")
        return
    if args.training:
        print(f"vitviz.dev.bench --training shapes_p8, {args.rounds} rounds, on {title(one)}; {time.strftime('%Y-%m-%d')}; {_machine()}")
        for what, value in training_table(batch=batch, rounds=args.rounds, device=one):
            print(f"{what:<58}{value:>10.1f}")
        return
    if (args.repeats != 1 or args.rows or args.reprice) and not args.serving:
        raise SystemExit("--repeats, --rows and --reprice go with --serving")
    if args.serving:
        variants = tuple(args.models) if args.models != ["shapes_p16", "vit_b_16"] else ("shapes_p16@384", "vit_b_16")
        if args.reprice:
            runs = []
            for path in args.reprice:
                try:
                    saved = json.loads(Path(path).read_text())
                except (OSError, ValueError) as e:
                    raise SystemExit(f"--reprice: {path} is not a file of runs written by --rows ({e})")
                if not isinstance(saved, list) or not all(isinstance(r, dict) and _SAVED <= r.keys() for r in saved):
                    raise SystemExit(f"--reprice: {path} is not a file of runs written by --rows (a list of runs, each with "
                                     f"{', '.join(sorted(_SAVED))})")
                runs += saved
            print(f"vitviz.dev.bench --serving, the runs saved in {', '.join(args.reprice)} priced again; {time.strftime('%Y-%m-%d')}")
        else:
            if args.repeats < 1:
                raise SystemExit(f"--repeats must be 1 or more, not {args.repeats}")
            print(f"vitviz.dev.bench --serving; {time.strftime('%Y-%m-%d')}; {_machine()}")
            runs = measured_rows(variants, tuple(args.kinds), repeats=args.repeats)
        if args.rows:
            Path(args.rows).write_text(json.dumps(runs, indent=1))
        merged_rows = merged(runs)
        most = max((r["runs"] for r in merged_rows), default=1)
        print("each request in a fresh process, random weights; peak = VmHWM above VmRSS before the request"
              + (f"; seconds and peaks: each request's median over its runs (up to {most})" if most > 1 else ""))
        gpu = any(r.get("gpu_peak") is not None for r in merged_rows)  # measured with CUDA (the processes see what this one sees)
        print("priced s: the request's work at the speed of a plain forward of the model, timed in the same process")
        print("line s: the same work priced by what the other variants' requests of its line (kind and family) took here, "
              "in four parts: fixed, flops, attention products and bytes (vitviz.server.guards.work.LineTimes; a line that ran no "
              "large job: its family's speed, from the other lines); by flops: fixed and "
              "flops alone; by pace: the line's four parts with each request's flops scaled by its variant's plain-forward pace")
        print(f"\n{'variant':<24}{'kind':<16}{'priced MB':>11}{'peak MB':>10}{'ratio':>7}{'priced s':>10}{'line s':>8}{'by flops':>10}"
              f"{'by pace':>9}{'seconds':>10}{'ratio':>7}" + (f"{'GPU peak MB':>13}" if gpu else ""))
        rows = priced_rows(merged_rows)
        for variant, kind, priced, peak, priced_s, line_s, flops_s, seconds, gpu_peak, pace_s in rows:
            line, by_flops, by_pace = ("-" if s is None else f"{s:.2f}" for s in (line_s, flops_s, pace_s))
            line_ratio = "-" if line_s is None else f"{line_s / seconds:.2f}"
            print(f"{variant:<24}{kind:<16}{priced:>11.0f}{peak:>10.0f}{priced / max(peak, 1):>7.2f}{priced_s:>10.2f}{line:>8}{by_flops:>10}"
                  f"{by_pace:>9}{seconds:>10.2f}{line_ratio:>7}" + (f"{gpu_peak:>13.0f}" if gpu_peak is not None else ""))
        for column, name in ((5, "line s"), (6, "by flops"), (9, "by pace")):
            off, small = gap(rows, column)
            print(f"{name}: within 1.5x of the seconds, {'%d of %d' % within(rows, column)}; of those taking 0.3 s or more, "
                  f"{'%d of %d' % within(rows, column, least=0.3)}; of the {small} under 0.3 s, off by {off:.2f} s at most")
        print("\nper kind: seconds priced by the line / measured, memory priced / peak (requests whose peak is over 16 MiB)")
        print(f"{'kind':<16}{'priced':>8}{'within 1.5x':>13}{'median':>8}{'least':>7}{'most':>7}{'over 16 MiB':>13}{'within 1.5x':>13}"
              f"{'median':>8}{'least':>7}{'most':>7}")
        for kind, n, ok, median, least, most, m, m_ok, m_median, m_least, m_most in by_kind(rows):
            ratios = ["-" if q is None else f"{q:.2f}" for q in (median, least, most, m_median, m_least, m_most)]
            print(f"{kind:<16}{n:>8}{ok:>13}{ratios[0]:>8}{ratios[1]:>7}{ratios[2]:>7}{m:>13}{m_ok:>13}{ratios[3]:>8}{ratios[4]:>7}{ratios[5]:>7}")
        return
    if args.flood:
        print(f"vitviz.dev.bench --flood; {time.strftime('%Y-%m-%d')}; {_machine()}")
        print(f"{args.arch} through /analyze from 127.0.0.1, medians of 5, alone and while 127.0.0.2 sends all its share allows")
        print(f"\n{'flood':<8}{'alone s':>9}{'during s':>10}{'ratio':>7}{'flood requests done':>21}")
        for flood, alone, during, taken in flood_table(args.arch):
            print(f"{flood + ' (' + FLOODS[flood][1] + ')':<8}{alone:>9.2f}{during:>10.2f}{during / alone:>7.2f}{taken:>21}")
        return
    if args.handler:
        print(f"vitviz.dev.bench --handler {args.arch}, {min(args.rounds, 8)} new images; {time.strftime('%Y-%m-%d')}; {_machine()}")
        _print_table(title(vitviz.sources.default_device()), handler_table(args.arch, rounds=min(args.rounds, 8)))  # the app's device
        return
    if args.evaluate:
        print(f"vitviz.dev.bench --evaluate {args.arch}, {args.images} JPEGs of 640x480; {time.strftime('%Y-%m-%d')}; {_machine()}")
        runs = [(args.metrics, "rollout,gradient")] if args.metrics else [("distance", "rollout,gradient"), ("pointing", "gradient")]
        print(f"\n{'metrics':<10}{'methods':<18}{'processes':<11}{'images/s':>10}{'plain, images/s':>17}{'ratio':>8}{'waited':>8}  plain is")
        processes = tuple(dict.fromkeys((1, args.processes)))  # 1 and --processes, once each (.ci/gpu: one per GPU)
        for metrics, methods in runs:
            for n, rate, plain, ratio, reference, waited in evaluate_table(args.arch, images=args.images, processes=processes, metrics=metrics,
                                                        methods=methods):
                print(f"{metrics:<10}{methods:<18}{n:<11}{rate:>10.2f}{plain:>17.2f}{ratio:>8.2f}{waited:>8.1%}  {reference}")
        print(f"\nthe evaluator's scoring of one batch of {batch} in memory on {title(one)}, in turn with its plain passes (this process, 5 rounds; "
              f"ratio: the median of each round's):")
        print(f"{'metrics, methods':<22}{'seconds':>9}{'ratio':>8}  plain is")
        for name, seconds, ratio, reference in evaluator_pass_table(args.arch, batch=batch, device=one):
            print(f"{name:<22}{seconds:>9.2f}{ratio:>8.2f}  {reference}")
        where = title(one) if one.type == "cuda" else f"{torch.get_num_threads()} threads"
        _print_table(f"one layer's attention of 32 images (the runs' batch), {where}; ratio: to the fused attention's time",
                     attention_part_table(args.arch, device=one))
        print("\nwaited: the share of the run the model waited for decoded images (the decoding workers behind)")
        print("targets: distance >= 0.95x plain batched forwards; a gradient method's maps >= 0.9x plain forwards + backwards")
        return
    if args.browser:
        print(f"vitviz.dev.bench --browser {' '.join(args.models)}, {args.rounds} moves each; {time.strftime('%Y-%m-%d')}; {_machine()}")
        print("the app in this process, the system's Chromium headless; random weights through the real weights path")
        print(f"\n{'model':<14}{'what':<46}{'median ms':>11}  note")
        for model, what, ms, note in browser_table(args.models, moves=args.rounds):
            print(f"{model:<14}{what:<46}{ms:>11.1f}  {note}")
        print("\ntargets: view change (hover, click, layer, head) <= 50 ms; new analysis <= 2.0x (forward + upload)")
        return
    if args.app:
        print(f"vitviz.dev.bench --app {args.arch} + {args.second}, {args.rounds} rounds; {time.strftime('%Y-%m-%d')}; {_machine()}")
        print("random weights in a temporary $TORCH_HOME, loaded through the app's real weights path")
        rows = app_table(args.arch, args.second, rounds=args.rounds)
        print(f"\n{'what':<58}{'median ms':>12}  note")
        for name, ms, note in rows:
            print(f"{name:<58}{ms:>12.1f}  {note}")
        print("\ntargets: /analyze <= 2.5x forward; view change <= 80 ms; Compare <= the two singles")
        return
    print(f"vitviz.dev.bench {args.arch}, batch 1, {args.rounds} rounds; {time.strftime('%Y-%m-%d')}; {_machine()}")
    for d in both:
        _print_table(title(d), model_path_table(args.arch, d, rounds=args.rounds * (5 if d.type == "cuda" else 1)))
    print("\ntargets: recording forward <= 1.10, analyze <= 1.20 (ratios to torchvision's forward)")
