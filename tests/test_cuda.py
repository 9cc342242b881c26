"""On a CUDA GPU, vitviz gives what it gives on the CPU: the embedded shapes_p16's logits and attention,
its recording hooks and rollout, a gradient method's maps, an analysis, and the evaluator's figures.
Marked `cuda` (`pytest -m cuda`; `.ci/gpu` runs them) and skipped where there is no GPU.

Tolerances are for float32 with TF32 off (`strict_float32`): the CPU and CUDA kernels sum in
different orders, so logits agree to 1e-4 and attention probabilities to 1e-5, not bit for bit. With
PyTorch's defaults cuDNN's convolutions (the patch embedding) may use TF32, a 10-bit mantissa: there
the top class is what is checked."""

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vitviz
from vitviz.preprocess import to_input

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (.ci/gpu runs these on one)")]

ROOT = Path(__file__).resolve().parent.parent
LOGITS_TOL = 1e-4
ATTENTION_TOL = 1e-5


@pytest.fixture
def strict_float32():
    """TF32 off for cuBLAS and cuDNN during the test, put back afterwards."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(scope="module")
def models():
    """shapes_p16 on the CPU and on CUDA (the same embedded weights)."""
    return vitviz.load_model("shapes_p16", device="cpu"), vitviz.load_model("shapes_p16", device="cuda")


@pytest.fixture(scope="module")
def images():
    """Six generated shapes images as PIL images, and as the model's input [6, 3, S, S] on the CPU."""
    pictures, _, _ = vitviz.shapes.generate(6, seed=31)
    pil = [Image.fromarray(p) for p in pictures]
    pre = vitviz.get_spec("shapes_p16").preprocessing
    return pil, torch.stack([to_input(p, pre) for p in pil])


def test_the_default_device_is_the_gpu():
    assert vitviz.default_device().type == "cuda"
    assert next(vitviz.load_model("shapes_p16").parameters()).device.type == "cuda"


def test_logits_and_attention_on_cuda_equal_the_cpus(models, images, strict_float32):
    cpu, gpu = models
    _, x = images
    with torch.inference_mode(), vitviz.record_attention(cpu) as rec_cpu:
        logits_cpu = cpu(x)
    with torch.inference_mode(), vitviz.record_attention(gpu) as rec_gpu:
        logits_gpu = gpu(x.cuda())
    assert logits_gpu.device.type == "cuda" and rec_gpu.attentions.shape == rec_cpu.attentions.shape  # [L, B, H, N, N]
    torch.testing.assert_close(logits_gpu.cpu(), logits_cpu, atol=LOGITS_TOL, rtol=LOGITS_TOL)
    torch.testing.assert_close(rec_gpu.attentions.cpu(), rec_cpu.attentions, atol=ATTENTION_TOL, rtol=0)
    assert torch.equal(logits_gpu.argmax(-1).cpu(), logits_cpu.argmax(-1))


def test_with_pytorchs_defaults_the_top_class_is_the_cpus(models, images):
    cpu, gpu = models
    _, x = images
    with torch.inference_mode():
        assert torch.equal(gpu(x.cuda()).argmax(-1).cpu(), cpu(x).argmax(-1))


def test_the_fused_kernel_and_the_recorded_softmax_agree_on_cuda(models, images, strict_float32):
    _, gpu = models
    x = images[1].cuda()
    with torch.inference_mode():
        fused = gpu(x)  # nobody records: scaled_dot_product_attention
        with vitviz.record_attention(gpu):
            recorded = gpu(x)  # the explicit softmax, a module a hook sees
    torch.testing.assert_close(recorded, fused, atol=LOGITS_TOL, rtol=LOGITS_TOL)


def test_recording_on_cuda_leaves_no_hook_and_its_rollout_is_the_cpus(models, images, strict_float32):
    cpu, gpu = models
    _, x = images
    with torch.inference_mode(), vitviz.record_attention(gpu) as rec:
        gpu(x.cuda())
    layers = rec.attentions.shape[0]
    with torch.inference_mode():
        gpu(x.cuda())  # after the block: nothing more is recorded
    assert rec.attentions.shape[0] == layers
    with torch.inference_mode(), vitviz.record_attention(cpu) as rec_cpu:
        cpu(x)
    rollout_gpu = vitviz.attention_rollout(rec.attentions, discard_ratio=0.5)
    assert rollout_gpu.device.type == "cuda"
    torch.testing.assert_close(rollout_gpu.sum(-1), torch.ones_like(rollout_gpu[..., 0]))  # rows sum to 1
    torch.testing.assert_close(rollout_gpu.cpu(), vitviz.attention_rollout(rec_cpu.attentions, discard_ratio=0.5), atol=1e-4, rtol=0)


def test_gradient_methods_on_cuda_equal_the_cpus(models, images, strict_float32):
    cpu, gpu = models
    _, x = images
    methods = ["gradient", "grad_rollout"]
    maps_cpu, targets_cpu, probs_cpu = vitviz.relevance_maps(cpu, x, methods=methods)
    maps_gpu, targets_gpu, probs_gpu = vitviz.relevance_maps(gpu, x.cuda(), methods=methods)
    assert torch.equal(targets_gpu.cpu(), targets_cpu)
    torch.testing.assert_close(probs_gpu.cpu(), probs_cpu, atol=LOGITS_TOL, rtol=0)
    for m in methods:
        a, b = maps_gpu[m].cpu(), maps_cpu[m]
        scale = b.abs().max()  # gradient relevance is not normalised: compare on its own scale
        torch.testing.assert_close(a / scale, b / scale, atol=1e-4, rtol=0, msg=lambda s, m=m: f"{m}: {s}")


def test_an_analysis_on_cuda_is_the_cpus(models, images, strict_float32):
    cpu, gpu = models
    pil, _ = images
    a_cpu, a_gpu = vitviz.analyze(cpu, pil[0]), vitviz.analyze(gpu, pil[0])
    assert a_gpu.attentions.device.type == "cpu"  # an analysis hands back CPU tensors
    torch.testing.assert_close(a_gpu.probabilities, a_cpu.probabilities, atol=LOGITS_TOL, rtol=0)
    torch.testing.assert_close(a_gpu.attentions, a_cpu.attentions, atol=ATTENTION_TOL, rtol=0)
    assert a_gpu.predictions()[0][0] == a_cpu.predictions()[0][0]


def _table(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_the_evaluator_on_cuda_writes_the_cpus_figures(tmp_path):
    """`python -m vitviz.evaluate` on the GPU (TF32 off through NVIDIA_TF32_OVERRIDE) and with the GPU
    hidden: the same per-image rows and attention distances to 1e-4."""
    data = tmp_path / "data"
    vitviz.shapes.write_dataset(data, 8, seed=5)
    args = ["--model", "shapes_p16", "--methods", "rollout", "--metrics", "distance", "--batch-size", "4", "--no-compare", "--workers", "0"]
    outs = {}
    for where, env in (("cuda", {"NVIDIA_TF32_OVERRIDE": "0"}), ("cpu", {"CUDA_VISIBLE_DEVICES": ""})):
        outs[where] = tmp_path / where
        subprocess.run([sys.executable, "-m", "vitviz.evaluate", str(data), *args, "--out", str(outs[where])], cwd=ROOT, check=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), **env), capture_output=True, text=True, timeout=300)
    sessions = {w: json.loads((o / "run.json").read_text())["sessions"][-1] for w, o in outs.items()}
    assert sessions["cuda"]["device"].startswith("cuda") and sessions["cpu"]["device"] == "cpu"
    for name in ("per_image.csv", "distance.csv"):
        rows_gpu, rows_cpu = _table(outs["cuda"] / name), _table(outs["cpu"] / name)
        assert len(rows_gpu) == len(rows_cpu) > 0
        for a, b in zip(rows_gpu, rows_cpu):
            for key in a:
                try:
                    va, vb = float(a[key]), float(b[key])
                except ValueError:
                    assert a[key] == b[key], (name, key)
                    continue
                assert math.isclose(va, vb, rel_tol=1e-4, abs_tol=1e-4) or (np.isnan(va) and np.isnan(vb)), (name, key, va, vb)
