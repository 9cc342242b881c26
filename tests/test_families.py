"""A model family is one module: a weights source that registers itself (`vitviz.register_source`)
and its conversion (`vitviz.from_<library>`). A plugin module outside vitviz adds a family with no
file of vitviz changed; the records every part reads (`vitviz.config`) stand on nothing of vitviz."""

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from PIL import Image

import vitviz
from conftest import sources_kept
from vitviz.sources import base

ROOT = Path(__file__).resolve().parent.parent

TOY_PLUGIN = textwrap.dedent(
    '''
    """A toy model family of a user's own: tiny random ViTs, named "toy:<anything>"."""
    import torch
    import vitviz
    from vitviz import Preprocessing, VariantSpec, ViTConfig, WeightsSource
    from vitviz.sources.base import split_size

    CONFIG = ViTConfig(image_size=32, patch_size=8, width=32, depth=2, heads=2, mlp_dim=64, num_classes=3)
    SEEDS = {"toy:tiny": 1, "toy:small": 2}
    LOADED = []


    @vitviz.register_source
    class ToySource(WeightsSource):
        name = "toy"
        prefix = "toy:"
        library = "toylib"  # its library's models are state dicts' owners shaped as a vitviz ViT

        def _spec(self, name):
            return VariantSpec(name=name, config=CONFIG, preprocessing=Preprocessing(image_size=32, resize_size=32),
                               categories=("red", "green", "blue"), source=self.name, weights="random", description="a toy ViT")

        def specs(self):
            return [self._spec(name) for name in SEEDS]

        def resolve(self, name, *, weights_path=None):
            _, size = split_size(name)  # "toy:<name>@<pixels>": another image size
            return self._spec(name).at(size) if size else self._spec(name)

        def status(self, spec):
            return "embedded"

        def load(self, spec, *, weights_path=None, progress=True):
            LOADED.append(spec.name)
            torch.manual_seed(SEEDS.get(spec.name, 0))
            return spec.build()

        def convert(self, model, **options):
            vit = self._spec("toy:tiny").build()
            vit.load_state_dict(model.state_dict())
            return vit.eval()


    @vitviz.register_method("toy_flat", title="Flat", needs_gradients=False)
    def flat(rec, **options):
        return torch.ones(rec.attentions.shape[1], *rec.grid)
    '''
)


@pytest.fixture
def registries():
    """The source and method registries as they were, after the test (they are per process: the
    rest of the session must not see what a test registered)."""
    from vitviz.explainers import registry as method_registry

    methods, loaded = dict(method_registry._REGISTRY), set(method_registry._LOADED)
    modules = set(sys.modules)
    try:
        with sources_kept():
            yield
    finally:
        with method_registry._LOCK:
            method_registry._REGISTRY.clear()
            method_registry._REGISTRY.update(methods)
        method_registry._LOADED.clear()
        method_registry._LOADED.update(loaded)
        vitviz.sources._PLUGINS_LOADED_FOR = None
        for name in set(sys.modules) - modules:
            if name.startswith("vv_toy"):
                del sys.modules[name]


@pytest.fixture
def toy_plugin(tmp_path, registries):
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "vv_toy.py").write_text(TOY_PLUGIN)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(folder))
        mp.setenv("VITVIZ_PLUGINS", "vv_toy")
        yield folder


def _names(sources) -> list[str]:
    return [s.name for s in sources]


def test_a_plugin_family_is_listed_loaded_and_analysed_like_the_built_in_ones(toy_plugin):
    assert "vv_toy" not in sys.modules and "toy" not in _names(base.registered_sources())
    names = [s.name for s in vitviz.list_variants()]  # the first lookup imports the plugins
    plugin = sys.modules["vv_toy"]
    assert Path(plugin.__file__).parent == toy_plugin  # the family lives outside vitviz
    assert names[-2:] == ["toy:tiny", "toy:small"] and names[:2] == ["shapes_p8", "shapes_p16"]
    assert _names(vitviz.sources.SOURCES) == ["embedded", "torchvision", "timm", "hf", "open_clip", "toy"]
    assert "toy_flat" in vitviz.methods()  # one plugin module, a source and a method

    model = vitviz.load_model("toy:tiny", device="cpu")
    assert isinstance(model, vitviz.ViT) and not model.training and plugin.LOADED == ["toy:tiny"]
    assert model.spec.source == "toy" and model.spec.name == "toy:tiny"
    assert vitviz.sources.source_of(model.spec) is base.registered_sources()[-1]
    assert vitviz.weights_status("toy:tiny") == "embedded"

    image = Image.fromarray((torch.rand(40, 48, 3) * 255).to(torch.uint8).numpy())
    result = vitviz.analyze(model, image)
    assert result.variant == "toy:tiny" and result.grid == (4, 4)
    assert result.attentions.shape == (2, 2, 1 + 16, 1 + 16)
    assert torch.allclose(result.attentions.sum(-1), torch.ones(2, 2, 17), atol=1e-5)
    assert [label for label, _ in result.predictions()] and {l for l, _ in result.predictions()} <= {"red", "green", "blue"}
    with torch.no_grad():
        assert torch.allclose(result.probabilities, model(vitviz.preprocess(image, model.spec.preprocessing)[0][None]).softmax(-1)[0], atol=1e-5)

    # its conversion is vitviz.from_<its library>, a library no family converts is no attribute
    other = vitviz.load_model("toy:small", device="cpu")
    converted = vitviz.from_toylib(other)
    x = torch.rand(1, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(converted(x), other(x)) and not torch.equal(converted(x), model(x))
    assert vitviz.sources.converter("toylib").__func__ is type(base.registered_sources()[-1]).convert
    with pytest.raises(AttributeError, match="from_nolib"):
        vitviz.from_nolib
    assert vitviz.from_timm is vitviz.sources.from_timm  # a built-in one is the package's own name

    # a name outside the list goes to the source's prefix, and a size suffix to the spec
    assert vitviz.get_spec("toy:other").source == "toy"
    assert vitviz.get_spec("toy:small@48").image_size == 48
    assert vitviz.load_model("toy:other", device="cpu", image_size=48).spec.image_size == 48


def test_without_the_plugin_the_toy_family_is_unknown(registries, monkeypatch):
    monkeypatch.delenv("VITVIZ_PLUGINS", raising=False)
    assert "toy" not in _names(vitviz.sources.SOURCES)
    with pytest.raises(ValueError, match=r"unknown variant 'toy:tiny'.*timm:<name>, hf:<name>"):
        vitviz.get_spec("toy:tiny")


def test_a_plugin_that_cannot_be_imported_is_named_by_the_lookups(registries, monkeypatch):
    monkeypatch.setenv("VITVIZ_PLUGINS", "vv_toy_missing")
    with pytest.raises(ImportError, match="the vitviz plugin 'vv_toy_missing' could not be imported"):
        vitviz.list_variants()


class _Fixed(base.WeightsSource):
    """A source of one named variant of the toy architecture."""

    name = "fixed"
    variant = "fixed_a"

    def specs(self):
        config = vitviz.ViTConfig(image_size=32, patch_size=8, width=32, depth=1, heads=2, mlp_dim=32, num_classes=2)
        return [vitviz.VariantSpec(name=self.variant, config=config, preprocessing=vitviz.Preprocessing(image_size=32),
                                   categories=("a", "b"), source=self.name, weights="random")]

    def status(self, spec):
        return "download"

    def load(self, spec, *, weights_path=None, progress=True):
        return spec.build()


def test_registering_replaces_a_source_of_the_same_name_in_its_place_and_refreshes_the_lists(registries):
    before = _names(vitviz.sources.SOURCES)
    assert before[:4] == ["embedded", "torchvision", "timm", "hf"]
    assert vitviz.register_source(_Fixed) is _Fixed  # a class decorator returns the class
    assert _names(vitviz.sources.SOURCES) == before + ["fixed"]
    assert [s.name for s in vitviz.list_variants()][-1] == "fixed_a"  # the cached list was made again

    class _Other(_Fixed):
        variant = "fixed_b"

    other = _Other()
    assert vitviz.register_source(other) is other  # an instance, by a call
    assert _names(vitviz.sources.SOURCES) == before + ["fixed"] and base.registered_sources()[-1] is other
    listed = [s.name for s in vitviz.list_variants()]
    assert "fixed_b" in listed and "fixed_a" not in listed
    assert vitviz.sources.source_of(vitviz.get_spec("fixed_b")) is other

    # the same name replaces a built-in source, which keeps its place in the menu's order
    class _Embedded(_Fixed):
        name = "embedded"
        variant = "embedded_only"

    vitviz.register_source(_Embedded)
    assert _names(vitviz.sources.SOURCES) == before + ["fixed"]
    assert [s.name for s in vitviz.list_variants()][0] == "embedded_only"
    with pytest.raises(ValueError, match="unknown variant 'shapes_p16'"):
        vitviz.get_spec("shapes_p16")


def test_register_source_refuses_what_is_not_a_source():
    with pytest.raises(TypeError):
        vitviz.register_source(object())
    with pytest.raises(TypeError):  # abstract: no specs, status, load
        vitviz.register_source(base.WeightsSource)

    class _Clash(_Fixed):
        name = "clash"
        prefix = "timm:"

    with pytest.raises(ValueError, match="'timm' has the prefix 'timm:'"):
        vitviz.register_source(_Clash)
    assert "clash" not in _names(base.registered_sources())


def test_config_imports_nothing_of_vitviz_nor_torch():
    path = ROOT / "vitviz" / "config.py"
    tree = ast.parse(path.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "math", "re", "dataclasses", "typing"}, imported
    assert not any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree))
    # loaded on its own, outside the package: the records work and nothing else was imported
    code = textwrap.dedent(
        f"""
        import importlib.util, json, sys
        spec = importlib.util.spec_from_file_location("config_alone", {str(path)!r})
        config = importlib.util.module_from_spec(spec)
        sys.modules["config_alone"] = config
        spec.loader.exec_module(config)
        c = config.ViTConfig(image_size=32, patch_size=8, width=32, depth=2, heads=2, mlp_dim=64, num_classes=3)
        v = config.VariantSpec(name="x", config=c, preprocessing=config.Preprocessing(image_size=32), categories=None,
                               source="s", weights="w").at(48)
        print(json.dumps({{"grid": v.grid, "params": c.num_params, "split": config.split_size("x@48"),
                          "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("vitviz", "torch", "torchvision", "numpy"))}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loaded"] == [] and got["grid"] == [6, 6] and got["split"] == ["x", 48]
    built = vitviz.ViT(image_size=32, patch_size=8, width=32, depth=2, heads=2, mlp_dim=64, num_classes=3)
    assert got["params"] == sum(p.numel() for p in built.parameters())


def test_the_old_import_paths_name_the_same_records():
    import vitviz.preprocess  # noqa: F401  (vitviz.preprocess is the function; the module is in sys.modules)
    from vitviz import config, model
    from vitviz.sources import base as sources_base

    preprocess = sys.modules["vitviz.preprocess"]

    assert model.ViTConfig is config.ViTConfig is vitviz.ViTConfig
    assert preprocess.Preprocessing is config.Preprocessing is vitviz.Preprocessing
    assert sources_base.VariantSpec is vitviz.sources.VariantSpec is config.VariantSpec is vitviz.VariantSpec
    assert sources_base.split_size is config.split_size and sources_base.check_size is config.check_size
    assert preprocess.IMAGENET_MEAN is config.IMAGENET_MEAN


@pytest.mark.parametrize(
    "fields",
    [
        dict(),
        dict(distill_token=True),
        dict(register_tokens=4, pos_embed_prefix=1, layer_scale=1e-5),
        dict(class_token=False, pool="avg", fc_norm=True, num_classes=0),
        dict(qkv_bias=False, proj_bias=False, mlp_bias=False, patch_bias=False, norm_pre=True, final_norm=False),
        dict(pool="avg", num_classes=0, register_tokens=2, pos_embed_prefix=0),
    ],
)
def test_the_parameter_count_read_from_the_config_is_the_models(fields):
    config = vitviz.ViTConfig(image_size=48, patch_size=16, width=24, depth=3, heads=2, mlp_dim=40, **fields)
    with torch.device("meta"):
        counted = sum(p.numel() for p in vitviz.ViT(config).parameters())
    assert config.num_params == counted


def test_the_interpolations_are_torchvisions():
    from torchvision.transforms import InterpolationMode

    from vitviz.config import INTERPOLATIONS

    assert set(INTERPOLATIONS) == {m.value for m in InterpolationMode}
    with pytest.raises(ValueError, match="not a valid InterpolationMode"):
        vitviz.Preprocessing(image_size=32, interpolation="cubic")


def test_from_torchvision_gives_the_torchvision_models_logits_and_is_vit_from_torchvision(monkeypatch):
    from torchvision.models import VisionTransformer

    tv = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=5).eval()
    torch.nn.init.normal_(tv.heads.head.weight, std=0.2)  # torchvision zero-inits the head
    torch.nn.init.normal_(tv.heads.head.bias, std=0.2)
    ours = vitviz.from_torchvision(tv)
    assert isinstance(ours, vitviz.ViT) and not ours.training and ours.spec.source == "torchvision"
    assert ours.spec.categories == tuple(f"class {i}" for i in range(5))
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        expected, got = tv(x), ours(x)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)

    # `ViT.from_<library>` is the family's own function: the same path, not a copy
    from vitviz.sources import hf, timm, torchvision

    assert vitviz.ViT.from_torchvision is vitviz.from_torchvision is torchvision.from_torchvision
    assert vitviz.ViT.from_timm is vitviz.from_timm is timm.from_timm
    assert vitviz.ViT.from_transformers is vitviz.from_transformers is hf.from_transformers
    again = vitviz.ViT.from_torchvision(tv)
    with torch.no_grad():
        assert torch.equal(again(x), got)
    # and the source's `convert` is that function too
    assert base.registered_sources()[1].library == "torchvision"
    with torch.no_grad():
        assert torch.equal(vitviz.sources.source_of(ours.spec).convert(tv)(x), got)
    with pytest.raises(TypeError, match="expected torchvision.models.VisionTransformer"):
        vitviz.from_torchvision(torch.nn.Linear(2, 2))
