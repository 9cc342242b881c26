"""A user's own explanation method, as a plugin module outside vitviz: registered with
`vitviz.register_method`, named in VITVIZ_PLUGINS, and then everywhere — `vitviz.explain`,
`python -m vitviz.evaluate --methods`, the app's Explain tab — with no file of vitviz changed.
Each part runs in a process of its own (the registry is per process)."""

import csv
import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest
import torch

from conftest import free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent

PLUGIN = textwrap.dedent(
    '''
    """The distance of each patch to the image centre, as a map (a method of a user's own)."""
    import torch
    import vitviz


    @vitviz.register_method("centre", title="Distance to the centre", needs_gradients=False, unit="patches")
    def centre(rec, **options):
        gh, gw = rec.grid
        r = torch.arange(gh, dtype=torch.float32)[:, None] - (gh - 1) / 2
        c = torch.arange(gw, dtype=torch.float32)[None, :] - (gw - 1) / 2
        return (r**2 + c**2).sqrt().expand(rec.attentions.shape[1], gh, gw).clone()
    '''
)


def _centre(gh: int, gw: int) -> torch.Tensor:
    """The map worked out here: rows and columns about the centre of a gh x gw grid."""
    return torch.tensor([[((r - (gh - 1) / 2) ** 2 + (c - (gw - 1) / 2) ** 2) ** 0.5 for c in range(gw)] for r in range(gh)])


@pytest.fixture
def plugin_env(tmp_path):
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "vv_centre.py").write_text(PLUGIN)
    path = os.pathsep.join([str(folder), str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return dict(os.environ, VITVIZ_PLUGINS="vv_centre", PYTHONPATH=path, GRADIO_ANALYTICS_ENABLED="False", TMPDIR=str(tmp_path))


def test_a_plugin_method_is_explained_like_the_built_in_ones(plugin_env, tmp_path):
    code = textwrap.dedent(
        """
        import json, vitviz
        model = vitviz.load_model("shapes_p16", device="cpu")
        star = vitviz.sources.assets_dir() / "examples" / "star.png"
        e = vitviz.explain(model, star, method="centre")
        maps, _, _ = vitviz.relevance_maps(model, vitviz.preprocess(vitviz.load_image(star), model.spec.preprocessing)[0][None],
                                           methods=["rollout", "centre"])
        print(json.dumps({"methods": vitviz.methods(), "map": e.map.tolist(), "label": e.label, "title": vitviz.explainers.method("centre").title,
                          "batch": maps["centre"][0].tolist()}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=plugin_env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["methods"] == ["attention", "rollout", "gradient", "grad_rollout", "legrad", "centre"]
    assert torch.allclose(torch.tensor(got["map"]), _centre(6, 6)) and torch.allclose(torch.tensor(got["batch"]), _centre(6, 6))
    assert got["label"] == "star" and got["title"] == "Distance to the centre"
    # without the plugin named, the method is unknown and the message lists the known ones
    env = {k: v for k, v in plugin_env.items() if k != "VITVIZ_PLUGINS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "unknown method 'centre'; the methods are attention, rollout, gradient, grad_rollout, legrad" in out.stderr


def test_a_plugin_that_cannot_be_imported_is_named(plugin_env, tmp_path):
    env = dict(plugin_env, VITVIZ_PLUGINS="vv_centre,vv_missing")
    out = subprocess.run([sys.executable, "-c", "import vitviz; vitviz.methods()"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "the vitviz plugin 'vv_missing' could not be imported" in out.stderr


@pytest.mark.slow
def test_the_evaluator_scores_a_plugin_method(plugin_env, tmp_path):
    data = tmp_path / "data"
    subprocess.run([sys.executable, "-m", "vitviz.shapes", str(data), "--n", "4"], cwd=tmp_path, env=plugin_env, check=True, capture_output=True)
    out = subprocess.run(
        [sys.executable, "-m", "vitviz.evaluate", str(data), "--model", "shapes_p16", "--methods", "centre,rollout",
         "--metrics", "pointing,deletion", "--steps", "4", "--out", str(tmp_path / "out")],
        cwd=tmp_path, env=plugin_env, capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "out" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    scored = {(r["method"], r["metric"]) for r in rows}
    assert {("centre", "pointing"), ("centre", "deletion"), ("rollout", "deletion")} <= scored, scored


@pytest.mark.slow
def test_the_app_draws_a_plugin_method_in_its_explain_tab(plugin_env, tmp_path):
    from gradio_client import Client, handle_file

    port = free_port()
    env = dict(plugin_env, GRADIO_SERVER_PORT=str(port), GRADIO_TEMP_DIR=str(tmp_path / "gradio"))
    server = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(base + "/", server)
        with urllib.request.urlopen(base + "/config") as response:
            config = json.load(response)
        labels = {c.get("props", {}).get("label") for c in config["components"]}
        ids = {c.get("props", {}).get("elem_id") for c in config["components"]}
        assert "Distance to the centre" in labels and "vv-explain-centre" in ids
        star = str(ROOT / "assets" / "examples" / "star.png")
        picture = Client(base, verbose=False).predict(handle_file(star), "shapes_p16", "star", "centre", api_name="/explain")
        assert Path(picture).name.startswith("shapes_p16-explain-centre-star")
    finally:
        server.terminate()
        server.wait(timeout=30)
