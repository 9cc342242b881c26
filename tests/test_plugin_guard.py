"""A plugin method's failure or slowness stays with its own map in the app: the other methods are
drawn, the failure is named without the plugin's text (which goes to the server's log), and a
plugin whose map took too long is left out of the explanations that follow (an injected clock)."""

import logging

import pytest
import torch

import vitviz
from vitviz.explainers import registry
from vitviz.server.explaining import MethodGuard, explain_exploration
from vitviz.server.models import ModelCache
from vitviz.server.pictures.views import explore


@pytest.fixture
def plugins():
    """Two plugin methods, "boom" (raises with a secret in its text) and "slow" (takes 20 s on the
    test's clock); the registry as it was afterwards."""
    before = dict(registry._REGISTRY)
    clock = [0.0]

    @vitviz.register_method("boom", title="Boom", needs_gradients=False)
    def boom(rec, **options):
        raise ValueError("token=secret-123")

    @vitviz.register_method("slow", title="Slow", needs_gradients=False)
    def slow(rec, **options):
        clock[0] += 20.0
        gh, gw = rec.grid
        return torch.ones(rec.attentions.shape[1], gh, gw)

    yield clock
    registry._REGISTRY.clear()
    registry._REGISTRY.update(before)


def test_a_failing_or_slow_plugin_leaves_the_other_maps_alone(plugins, caplog):
    cache = ModelCache(max_models=1)
    exp = explore(cache, vitviz.sources.assets_dir() / "examples" / "star.png", "shapes_p16")
    guard = MethodGuard(seconds=5.0, clock=lambda: plugins[0])
    notes: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="vitviz.server"):
        maps, index = explain_exploration(cache, exp, target=None, guard=guard, notes=notes)
    assert set(vitviz.explanations.METHODS) <= set(maps) and "slow" in maps and "boom" not in maps
    assert notes["boom"] == "Boom failed (ValueError); the server's log has the details."
    assert "secret-123" in caplog.text  # for the operator, never for the callers
    notes.clear()
    maps, _ = explain_exploration(cache, exp, target=None, guard=guard, notes=notes)
    assert "slow" not in maps and set(vitviz.explanations.METHODS) <= set(maps)
    assert notes["slow"].startswith("Slow is left out: its map took 20.0 s, more than the 5 s")
    with pytest.raises(ValueError, match="secret-123"):  # the library itself raises, as a caller of vitviz.explain expects
        explain_exploration(cache, exp, target=None)


def test_a_plugins_per_layer_reduction_runs_under_its_guard_not_in_the_backward(plugins, caplog):
    """A gradient plugin with a per-layer reduction (`layerwise=`) that raises: the built-in
    gradient methods are drawn (their reductions still inside the backward) and the plugin's map is
    left out with its note; one whose reduction is slow is timed as its map and left out after."""
    clock = plugins

    def failing(a, g, **options):
        raise RuntimeError("key=secret-456")

    def slow(a, g, **options):
        clock[0] += 4.0  # 4 s a layer on the test's clock: 24 s for shapes_p16's six
        return (a * g).clamp(min=0).mean(1)

    def read(name):
        def fn(rec, **options):
            layers = rec.layerwise(name, head_fusion=options.get("head_fusion", "mean"), discard_ratio=options.get("discard_ratio", 0.0))
            gh, gw = rec.grid
            return torch.stack(layers).sum(0)[:, 0, rec.num_prefix_tokens:].reshape(-1, gh, gw)
        return fn

    vitviz.register_method("boomwise", title="Boom per layer", needs_gradients=True, layerwise=failing)(read("boomwise"))
    vitviz.register_method("slowwise", title="Slow per layer", needs_gradients=True, layerwise=slow)(read("slowwise"))
    cache = ModelCache(max_models=1)
    exp = explore(cache, vitviz.sources.assets_dir() / "examples" / "star.png", "shapes_p16")
    guard = MethodGuard(seconds=5.0, clock=lambda: clock[0])
    notes: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="vitviz.server"):
        maps, _ = explain_exploration(cache, exp, target=None, guard=guard, notes=notes)
    assert set(vitviz.explanations.METHODS) <= set(maps) and "slowwise" in maps and "boomwise" not in maps
    assert notes["boomwise"] == "Boom per layer failed (RuntimeError); the server's log has the details."
    assert "secret-456" in caplog.text
    for failing_plugin in ("boom", "boomwise"):
        del registry._REGISTRY[failing_plugin]
    reference, _ = explain_exploration(cache, exp, target=None)  # the built-ins' maps are those of the plain pass
    for m in vitviz.explanations.METHODS:
        torch.testing.assert_close(maps[m], reference[m])
    notes.clear()
    maps, _ = explain_exploration(cache, exp, target=None, guard=guard, notes=notes)
    assert "slowwise" not in maps and notes["slowwise"].startswith("Slow per layer is left out: its map took 24.0 s")
