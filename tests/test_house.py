"""The shape of the house: imports go one way, vitviz installs as a package, the README's examples run."""

import ast
import os
import re
import shutil
import subprocess
import sysconfig
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import free_port, random_torchvision_checkpoint, random_timm_weights, wait_for, write_hub_cache

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vitviz"

# Modules that stand on nothing else of vitviz: the model, the maths, the pictures, the image gate.
LEAVES = {"vitviz.model", "vitviz.analysis", "vitviz.plots", "vitviz.images", "vitviz.preprocess", "vitviz.shapes",
          "vitviz.layout"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, text: str, modules: dict[str, Path], *, is_package: bool = False) -> set[str]:
    """Every vitviz module that module `name` (source `text`) imports, anywhere in the file (inside
    functions too)."""
    package = name if is_package else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # "from vitviz.x import y": y may be a module of its own
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rsplit(".", 1)[0] if "." in target else ""
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: _imports(name, path.read_text(), modules, is_package=path.name == "__init__.py") for name, path in modules.items()
    }


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    assert "vitviz.model" in graph and len(graph) > 15
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_sees_imports_inside_functions():
    modules = _modules()
    planted = _imports("vitviz.model", "def convert():\n    from vitviz.pipeline import analyze\n", modules)
    assert planted == {"vitviz.pipeline"}
    graph = _graph()
    graph["vitviz.model"] = planted
    assert _find_cycle(graph) is not None


def test_the_model_and_the_maths_import_nothing_else_of_vitviz():
    """Nothing but the records of `vitviz.config` and the step points of `vitviz.steps`, which
    themselves import nothing of vitviz."""
    graph = _graph()
    allowed = {"vitviz.config", "vitviz.steps"}
    for base in allowed:
        assert graph[base] == set(), f"{base} imports {graph[base]}"
    for leaf in LEAVES:  # a leaf package's modules import each other and nothing else
        assert leaf in graph
        for name in (n for n in graph if n == leaf or n.startswith(leaf + ".")):
            outside = {t for t in graph[name] if t != leaf and not t.startswith(leaf + ".")}
            assert outside <= allowed, f"{name} imports {outside - allowed}"


def test_the_apps_pictures_stand_on_the_library_and_its_model_cache_alone():
    """server/pictures draws from an analysis: no Gradio, and of the app only its own modules and the
    model cache (whose facts a picture reads); the guards stand below the page and the tabs."""
    graph = _graph()
    pictures = [n for n in graph if n.startswith("vitviz.server.pictures")]
    assert len(pictures) >= 5
    for name in pictures:
        app = {t for t in graph[name] if t.startswith("vitviz.server") and not t.startswith("vitviz.server.pictures")}
        assert app <= {"vitviz.server", "vitviz.server.models"}, f"{name} imports {app}"
        tree = ast.parse(_modules()[name].read_text())
        gradio = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                  and any((a.name if isinstance(n, ast.Import) else (n.module or "")).split(".")[0] == "gradio" for a in n.names)]
        assert not gradio, f"{name} imports gradio"
    for name in (n for n in graph if n.startswith("vitviz.server.guards")):
        above = {t for t in graph[name] if t in ("vitviz.server.page", "vitviz.server.runtime") or t.startswith("vitviz.server.tabs")}
        assert not above, f"{name} imports {above}"


def test_the_library_never_reaches_up_into_the_app():
    graph = _graph()
    for name, targets in graph.items():
        if not name.startswith(("vitviz.server", "vitviz.dev")):
            assert not {t for t in targets if t.startswith("vitviz.server")}, f"{name} imports the app's modules"


def test_nothing_imports_the_checkout_tools():
    """vitviz.dev (bench, train_shapes) is for working on vitviz: the library and the app never
    import it, and the distribution leaves it out."""
    graph = _graph()
    assert "vitviz.dev.bench" in graph and "vitviz.dev.train_shapes" in graph
    for name, targets in graph.items():
        if not name.startswith("vitviz.dev"):
            assert not {t for t in targets if t.startswith("vitviz.dev")}, f"{name} imports {sorted(t for t in targets if t.startswith('vitviz.dev'))}"
    packages = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert '"vitviz"' in packages and "vitviz.dev" not in packages


def _top_level_imports(text: str) -> set[str]:
    """The first name of every absolute import in a source file (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_only_the_app_package_imports_gradio_and_nothing_imports_the_launcher():
    web = {"gradio", "gradio_client", "starlette", "fastapi", "uvicorn", "spaces"}
    for name, path in _modules().items():
        names = _top_level_imports(path.read_text())
        assert "app" not in names, f"{name} imports the launcher app.py (the app is vitviz.server.app)"
        if not name.startswith(("vitviz.server", "vitviz.dev")):
            assert not names & web, f"{name} imports {sorted(names & web)}: web code belongs in vitviz.server"
    planted = "import vitviz\nfrom gradio import Blocks\n"
    assert _top_level_imports(planted) & web == {"gradio"}


def _repo_copy(tmp_path: Path) -> Path:
    """The files git tracks (and those it would track), copied: no build litter in the checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    )
    if listed.returncode != 0:  # not a git checkout: copy what matters
        files = [p.relative_to(ROOT) for d in ("vitviz", "assets") for p in (ROOT / d).rglob("*") if p.is_file()]
        files += [Path("pyproject.toml"), Path("README.md")]
    else:
        files = [Path(line) for line in listed.stdout.splitlines() if line]
    dest = tmp_path / "src"
    for rel in files:
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    return dest


@pytest.mark.slow
def test_vitviz_installs_into_a_fresh_venv_and_loads_an_embedded_model_anywhere(tmp_path):
    """As a user installs it: a wheel built by pip, installed by a fresh venv's own pip, imported from
    another folder; the `vitviz-app` command is there. The venv is made by whichever Python runs the
    tests (itself a venv or not); torch & co. come from the environment running the tests (installing
    them again would be gigabytes), on the venv's path after its own site-packages."""
    src = _repo_copy(tmp_path)
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(src)],
        cwd=tmp_path, capture_output=True, text=True,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("vitviz-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (Path(purelib) / "zz-test-environment.pth").write_text("".join(f"{p}\n" for p in ours))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VITVIZ_ASSETS", "VIRTUAL_ENV")}
    probe = subprocess.run([str(python), "-c", "import vitviz"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert probe.returncode != 0, "vitviz is importable before it is installed"
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                             cwd=tmp_path, capture_output=True, text=True, env=env)
    assert install.returncode == 0, install.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = textwrap.dedent(
        """
        import vitviz, pathlib
        assert "site-packages" in vitviz.__file__, vitviz.__file__
        model = vitviz.load_model("shapes_p16", device="cpu")
        star = pathlib.Path(vitviz.sources.assets_dir()) / "examples" / "star.png"
        print(vitviz.analyze(model, star).predictions(1)[0][0])
        """
    )
    out = subprocess.run([str(python), "-c", code], cwd=elsewhere, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "star"
    command = subprocess.run([str(venv / "bin" / "vitviz-app"), "--help"], cwd=elsewhere, capture_output=True, text=True, env=env)
    assert command.returncode == 0 and "usage: vitviz-app" in command.stdout, command.stderr[-2000:]


def _readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


@pytest.mark.slow
def test_the_readmes_python_examples_run_as_written(tmp_path):
    """Every Python block of the README, in a fresh interpreter from the repository's root (where a
    reader who cloned it stands); torchvision's and timm's weights come from caches of random
    weights, offline; the gradio_client examples talk to the app on a free port (the README's address
    changed to it)."""
    import torch
    import torchvision

    blocks = _readme_blocks()
    assert len(blocks) >= 3
    torch_home = tmp_path / "torch"
    random_torchvision_checkpoint(torch_home)
    hf_home = tmp_path / "hf"
    for name in ("vit_small_patch16_224.dino",):  # the timm models the examples load by name
        write_hub_cache(hf_home / "hub", f"timm/{name}", {"model.safetensors": random_timm_weights(name)[1]})
    env = dict(os.environ, TORCH_HOME=str(torch_home), VITVIZ_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False",
               HF_HUB_OFFLINE="1", HF_HOME=str(hf_home))
    env.pop("VITVIZ_ASSETS", None)
    needs_server = any("Client(" in b for b in blocks)
    server = None
    if needs_server:
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-c", f"import app; app.demo.launch(server_name='127.0.0.1', server_port={port}, **app.LAUNCH_KWARGS)"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        wait_for(f"http://127.0.0.1:{port}/", server)
    try:
        for i, block in enumerate(blocks):
            if server is not None:  # the README's address, the port this run's server took
                block = block.replace("http://127.0.0.1:7860/", f"http://127.0.0.1:{port}/")
            out = subprocess.run([sys.executable, "-c", block], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
            assert out.returncode == 0, f"README block {i + 1} failed:\n{block}\n{out.stderr[-3000:]}"
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)


def test_the_app_package_is_made_of_short_pieces():
    """No function (nested ones too) and no top-level statement of vitviz/server over 80 lines (a page
    is built by functions, a tab is a module of its own; a class is judged by its methods), and app.py
    only builds and launches."""
    long = []
    for path in sorted((PACKAGE / "server").rglob("*.py")):
        tree = ast.parse(path.read_text())
        nodes = [*tree.body, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))]
        for node in nodes:
            span = node.end_lineno - node.lineno + 1
            if span > 80 and not isinstance(node, ast.ClassDef):
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} ({span} lines)")
    assert not long, long
    assert len((PACKAGE / "server" / "app.py").read_text().splitlines()) <= 100


def test_no_module_asks_a_models_family_outside_the_familys_own():
    """A family is told apart only in its own modules (`swin*`) and the source registry (`sources/`,
    `dev/train_shapes_*`): everywhere else a model is asked through `vitviz.architectures` and an
    analysis through its layout (`vitviz.server.pictures.drawers`), so that a new layout is drawn with no
    change there. The check finds what it looks for in a planted line."""
    asks = re.compile(r"\bis_swin\(|isinstance\([^)]*\bSwin\w*|\bSwin\w*\b\s*(?:==|is)\s|type\([^)]*\)\s*(?:==|is)\s*Swin|hasattr\([^)]*\"geometries\"")
    own = re.compile(r"(^|/)swin[^/]*\.(py|js)$|^sources/|^dev/train_shapes_")
    found = []
    for path in sorted(PACKAGE.rglob("*")):
        rel = path.relative_to(PACKAGE).as_posix()
        if path.suffix not in (".py", ".js") or own.search(rel):
            continue
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if asks.search(line):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert found == [], found
    assert asks.search("    if isinstance(a, SwinAnalysis):") and asks.search("ragged = any(swin_views.is_swin(e) for e in exps)")
    assert asks.search('if hasattr(spec.config, "geometries"):')
    assert own.search("server/swin_views.py") and not own.search("server/views.py")
