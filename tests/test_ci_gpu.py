""".ci/gpu, the one-command GPU check: without a GPU it says so in one line, exits 0 and writes nothing;
its dry run (every step on the CPU, tiny sizes) writes one file with every step's command and figures."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "gpu"
NO_GPU = re.compile(r"^\.ci/gpu: no CUDA GPU here \(.+\): nothing was measured")


def _gpu(*args: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=dict(os.environ, **env), capture_output=True, text=True,
                          timeout=timeout)


def test_with_every_gpu_hidden_it_says_so_in_one_line_and_measures_nothing(tmp_path):
    figures = tmp_path / "gpu.md"
    ran = _gpu(str(figures), timeout=60, CUDA_VISIBLE_DEVICES="")
    assert ran.returncode == 0, ran.stderr
    assert len(ran.stdout.splitlines()) == 1 and NO_GPU.match(ran.stdout), ran.stdout
    assert not figures.exists()


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_on_a_machine_without_a_gpu_it_says_so_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    ran = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "gpu.md")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and NO_GPU.match(ran.stdout) and "no nvidia-smi" in ran.stdout, ran.stdout + ran.stderr
    assert not (tmp_path / "gpu.md").exists()


def test_an_unknown_option_is_refused():
    ran = _gpu("--fast", timeout=60)
    assert ran.returncode == 2 and "unknown option --fast" in ran.stderr


@pytest.mark.slow
def test_the_dry_run_writes_every_steps_figures_to_one_file_within_its_budget(tmp_path):
    """The dry run on the CPU with a budget of 100 s (a whole dry run takes minutes): the steps the
    budget allows pass, each with its command beside its figures; the rest are written as not run,
    and the command says a step did not run (exit 1)."""
    figures = tmp_path / "gpu.md"
    ran = _gpu("--dry-run", str(figures), timeout=600, VITVIZ_VENV=sys.prefix, OUT=str(tmp_path / "unused"), VITVIZ_GPU_BUDGET_S="100")
    assert ran.returncode in (0, 1), ran.stdout[-3000:] + ran.stderr[-3000:]
    assert f"figures in {figures}" in ran.stdout.splitlines()[-1]
    assert not (tmp_path / "unused").exists()  # the file named on the command line, not $OUT's
    text = figures.read_text()
    assert text.startswith("# vitviz GPU check: DRY RUN on the CPU") and "- torch " in text and "- vitviz: " in text
    sections = re.findall(r"^## (.+)$", text, flags=re.M)
    wanted = ["Tests that need CUDA", "The evaluator's images", "The evaluator, torchrun --nproc_per_node=2 (gloo", "bench: the model paths", "bench --relevance",
              "bench --evaluate", "bench --handler", "bench --app", "bench --serving", "bench --training", "bench --browser", "bench --inputs",
              "Steps"]
    for want in wanted:
        assert any(s.startswith(want) for s in sections), (want, sections)
    assert "$ " + sys.prefix in text  # each step's command beside its figures
    rows = re.findall(r"^\| ([^|]+?) \| ([^|]+?) \| \d+ \|$", text.split("\n## Steps\n")[1], flags=re.M)
    status = {name: code for name, code in rows}
    evaluator = next(name for name in status if name.startswith("The evaluator, torchrun"))
    if status[evaluator] == "0":  # (on a loaded machine the budget may end before it does: then it is written as cut)
        assert "run.json: 2 process(es), rank 0 on cpu: 8 scored" in text
    for step in ("Tests that need CUDA (pytest -m cuda)", "The evaluator's images"):  # ran: whole, or cut by the budget under load
        assert status[step] in ("0", "124"), (step, rows)
    cut = [name for name, code in status.items() if code == "124" or code.startswith("not run (budget")]  # by its timeout, or never started
    assert all(code == "0" or name in cut for name, code in status.items() if name != "bench --inputs"), rows
    assert status["bench --inputs"] == "not run"
    assert (ran.returncode == 1) == bool(cut)
    assert re.search(r"^wall time: \d+ s of a budget of 100 s$", text, flags=re.M)
