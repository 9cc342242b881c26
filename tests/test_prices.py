"""What a request is priced before it runs, held to what it does: the model work each kind of
request really runs (counted by torch's FlopCounterMode, no clock) within the price and within 1.5x
of it; the speed the server learns kept apart for each line of work (an injected clock); the
orderings, phrases and rollouts a price counts."""

import math

import pytest

import vitviz
from vitviz import cost
from vitviz.cost import Cost, price
from vitviz.explainers import methods as registered_methods
from vitviz.explanations import relevance_maps
from vitviz.server.guards.work import LineTimes, ModelWork, Pace
from vitviz.sources import get_spec
from conftest import counted_flops


def _image(spec):
    """A generated shapes image at the model's size, and its input [1, 3, S, S]."""
    from PIL import Image

    picture = Image.fromarray(vitviz.shapes.render(3, seed=5, index=0, image_size=spec.image_size)[0])
    return picture, vitviz.preprocess(picture, spec.preprocessing)[0][None]


@pytest.mark.parametrize("name", ["shapes_p16", "shapes_p8@192"])
def test_each_kind_is_priced_within_its_counted_work(name):
    """For each kind the flops a request runs (matrix products, forward and backward) are at most its
    price, and the price at most 1.5 times them: no kind priced at nothing, none far above."""
    model = vitviz.load_model(name)
    spec = model.spec
    picture, x = _image(spec)
    everything = list(registered_methods())
    recorded = vitviz.analyze(model, picture)
    counted = {
        "analyse": counted_flops(lambda: vitviz.analyze(model, picture).rollout()),
        "explain": counted_flops(lambda: relevance_maps(model, x, methods=everything)),
        "view": counted_flops(lambda: recorded.rollout()),
        "export": counted_flops(lambda: (recorded.rollout(), recorded.distances())),
        "ablate": counted_flops(lambda: vitviz.inside.ablate(model, x[0], [(0, 0)])),
        "importance": counted_flops(lambda: vitviz.inside.head_importance(model, x[0])),
    }
    for kind, work in counted.items():
        priced = price(spec, kind, layer_gradients=True).flops
        assert work > 0 and work <= priced <= 1.5 * work, (kind, work, priced, priced / work)


def test_faithfulness_prices_every_ordering_and_find_every_phrase():
    spec = get_spec("shapes_p16")
    five, six = price(spec, "faithfulness", orders=5), price(spec, "faithfulness", orders=6)
    assert six.flops > five.flops and six.bytes >= five.bytes
    one, four = price(get_spec("shapes_clip"), "explain", phrases=1), price(get_spec("shapes_clip"), "explain", phrases=4)
    assert four.flops > 3 * one.flops - 2 * cost.forward_flops(get_spec("shapes_clip")) and four.bytes > 2.5 * (one.bytes - cost.BASE_BYTES - cost.COMPUTE_BYTES)
    none = price(get_spec("shapes_clip"), "explain")  # no phrase: the maps that need no gradient, no backward
    assert none.bytes == price(get_spec("shapes_clip"), "analyse").bytes and none.flops < one.flops / 2
    with pytest.raises(ValueError, match="0 or more"):
        price(spec, "explain", phrases=-1)


def test_a_windowed_rollout_is_priced_where_it_is_drawn():
    """A Swin's rollout through the merges is drawn by an analysis, a view and an export: each priced
    with the product through the network, which grows with the final tokens times every layer's."""
    small, large = get_spec("shapes_swin"), get_spec("shapes_swin@1824")
    for kind in ("analyse", "view", "export"):
        assert price(large, kind).flops > 1e11, kind  # 2.7e8 elements through the network, each moved several times
        assert price(large, kind).line == f"{kind}/windowed"
    assert price(large, "view").flops > 1000 * price(small, "view").flops
    assert price(large, "analyse").flops > 4 * cost.forward_flops(large)


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_speed_is_learned_for_each_line_of_work():
    """One client's slow windowed rollouts slow the estimate of windowed rollouts only: another
    client's ViT explanation is still priced at the server's speed."""
    clock = _Clock()
    work = ModelWork(budget_bytes=2**40, lanes=1, seconds=1000.0, rate=1e11, clock=clock)
    rollout, explain = price(get_spec("shapes_swin@1824"), "view"), price(get_spec("shapes_p8@384"), "explain")
    before = work.estimate(explain)
    for _ in range(10):
        with work.job(rollout):
            clock.now += 90.0  # each took 90 s
    assert work.estimate(explain) == before  # another line: unchanged
    assert work.estimate(rollout) > 30.0 and work.refusal(explain) is None
    work.seconds = 100.0
    assert work.refusal(rollout) is None  # still within 100 s
    work.seconds = 1000.0
    for _ in range(10):
        with work.job(rollout):
            clock.now += 150.0
    work.seconds = 100.0
    assert "would take about" in work.refusal(rollout) and work.refusal(explain) is None


def test_a_lines_time_is_learned_as_a_fixed_part_and_a_part_that_grows_with_the_work():
    """Jobs that each take 0.6 s besides their work at 1e10 flops a second: small ones alone give
    the fixed part only (their median time; the rate still prices the work); with large ones beside
    them the fit gives both parts, and a job ten times the largest is priced at its time (one speed
    alone would price the small ones far above theirs)."""
    times = LineTimes(rate=1e9)
    assert times.estimate("explain/global", 2e9) == pytest.approx(2.0)  # no job yet: the rate
    times.add("explain/global", 1e9, 0.6 + 1e9 / 1e10)
    times.add("explain/global", 1.2e9, 0.6 + 1.2e9 / 1e10)
    pace = times.parts("explain/global")
    assert (pace.fixed, pace.speed, pace.bandwidth) == (pytest.approx(0.71), 1e9, math.inf)
    for flops in (4e10, 1e11):
        times.add("explain/global", flops, 0.6 + flops / 1e10)
    pace = times.parts("explain/global")
    assert pace.fixed == pytest.approx(0.6) and pace.speed == pytest.approx(1e10)
    assert times.estimate("explain/global", 1e12) == pytest.approx(100.6)
    assert times.estimate("view/global", 1e11) == pytest.approx(100.0)  # another line: its rate still
    times.add("view/global", 0.0, 5.0)  # no work, or no time: not counted
    times.add("view/global", 1e9, 0.0)
    assert times.parts("view/global") == Pace(0.0, 1e9)


def test_a_lines_time_that_grows_with_its_bytes_is_learned_with_them():
    """Jobs of four variants whose time is 0.05 s, plus their flops at 4e10 a second, plus their
    bytes at 2e8 a second (an attention stack copied and written): the fit finds the three parts,
    and prices a variant never run, whose bytes and flops are in another proportion, at its time.
    By flops alone (the bytes not passed) the same jobs price it at less than half."""
    def took(flops, nbytes):
        return 0.05 + flops / 4e10 + nbytes / 2e8

    jobs = {"narrow": (2e9, 4e8), "wide": (4e11, 2e8), "small": (1e8, 1e7), "long": (5e10, 1.2e9)}
    times, flops_only = LineTimes(rate=1e9), LineTimes(rate=1e9)
    for variant, (flops, nbytes) in jobs.items():
        for _ in range(3):  # the same size again counts once
            times.add("export/global", flops, took(flops, nbytes), variant, nbytes=nbytes)
            flops_only.add("export/global", flops, took(flops, nbytes), variant)
    pace = times.parts("export/global")
    assert pace.fixed == pytest.approx(0.05, rel=1e-6) and pace.speed == pytest.approx(4e10, rel=1e-6)
    assert pace.bandwidth == pytest.approx(2e8, rel=1e-6)
    new = (1e10, 3e9)  # 15.3 s, nearly all its bytes
    assert times.estimate("export/global", new[0], "new", nbytes=new[1]) == pytest.approx(took(*new), rel=1e-6)
    assert flops_only.estimate("export/global", new[0], "new") < 0.5 * took(*new)


def test_slowed_small_jobs_beside_a_large_one_price_a_larger_job_near_its_time():
    """Small jobs slowed to 0.3 s (under load) beside one large job that ran at 5e10 flops a second:
    the fit prices a job five times the large one within 2x of what it takes, never at the small
    jobs' speed (which would be hundreds of times its time)."""
    times = LineTimes(rate=5e10)
    for variant, flops in (("a", 1e8), ("b", 5e8), ("c", 1e9)):
        times.add("analyse/global", flops, 0.3 + flops / 1e8, variant, nbytes=5e7)  # slow, and slowed
    times.add("analyse/global", 2e11, 0.01 + 2e11 / 5e10, "large", nbytes=5e8)
    truth = 0.01 + 1e12 / 5e10
    assert truth / 2 < times.estimate("analyse/global", 1e12, "larger", nbytes=1e9) < 2 * truth


def test_the_server_prices_with_the_bytes_of_each_cost():
    """Through `ModelWork` with an injected clock: jobs whose time is their bytes at 1e9 a second
    beside a little work; a request of more bytes and as little work is priced at its time, and
    refused when that passes the limit."""
    clock = _Clock()
    work = ModelWork(budget_bytes=2**40, lanes=1, seconds=30.0, rate=1e12, clock=clock)
    for name, flops, nbytes in (("a", 1e9, 1e8), ("b", 2e10, 3e9), ("c", 4e9, 1e9), ("d", 1e10, 6e9)):
        with work.job(Cost("export", name, 1, int(nbytes), 0, flops)):
            clock.now += 0.02 + flops / 1e12 + nbytes / 1e9
    assert work.estimate(Cost("export", "e", 1, int(1.2e10), 0, 1e9)) == pytest.approx(0.02 + 1e-3 + 12.0, rel=1e-6)
    assert work.refusal(Cost("export", "f", 1, int(4e10), 0, 1e9)) is not None


def test_patching_is_priced_within_its_counted_work():
    """"patch": the clean and corrupted forwards, then each site run from its layer on, in batches;
    "patch_one": the clean and the patched forward of `patched_logits`. Each priced within 1.5x of
    the flops it runs; the batch the price assumes is the one `patch` runs in the same memory."""
    import PIL.Image

    from vitviz.patching import KINDS, patch, patch_forwards, patched_logits

    model = vitviz.load_model("shapes_p16")
    spec = model.spec
    picture, x = _image(spec)
    y = vitviz.preprocess(PIL.Image.fromarray(vitviz.shapes.render(3, seed=6, index=0, image_size=spec.image_size)[0]),
                          spec.preprocessing)[0][None]
    for kinds in (("resid_pre",), ("head", "pattern"), KINDS):
        work = counted_flops(lambda: patch(model, x[0], y[0], where=kinds))
        priced = price(spec, "patch", patch_kinds=kinds).flops
        assert work > 0 and work <= priced <= 1.5 * work, (kinds, work, priced, priced / work)
    sites = [("head", 2, 1), ("pattern", 3, 0), ("resid_pre", 1, 5)]
    work = counted_flops(lambda: patched_logits(model, x[0], y[0], sites))
    priced = price(spec, "patch_one", patch_kinds=("head", "pattern", "resid_pre")).flops
    assert work > 0 and work <= priced <= 1.5 * work, ("patch_one", work, priced, priced / work)
    budgeted = price(spec, "patch", patch_kinds=("head_token",), budget=20 * 2**20)
    assert 1 < budgeted.batch < spec.num_tokens * spec.config.heads and budgeted.bytes <= 20 * 2**20
    run = patch(model, x[0], y[0], where="head_token", batch_size=budgeted.batch)
    assert run.batch_size == budgeted.batch and run.forwards == patch_forwards(spec, "head_token", batch_size=budgeted.batch)
    with pytest.raises(ValueError, match="ViT towers"):
        price(get_spec("shapes_swin"), "patch")


def test_a_test_time_register_is_priced_within_its_counted_work():
    """"registers": the forward that finds the neurons (every block's MLP activations and outputs
    recorded), the analysis of the model with its register (one more token) and its rollout, and the
    rollout before drawn again, priced within 1.5x of the flops they run; none for a model without room."""
    from PIL import Image

    from vitviz.registers import register_neurons, with_test_time_register

    model = vitviz.load_model("shapes_p8_outliers")
    spec = model.spec
    picture = Image.fromarray(vitviz.shapes.generate(1, seed=2025)[0][0])  # an image with high-norm tokens
    x = vitviz.preprocess(picture, spec.preprocessing)[0][None]
    before = vitviz.analyze(model, picture)

    def run():
        found = register_neurons(model, x, top_k=8)
        vitviz.analyze(with_test_time_register(model, found), picture).rollout()
        before.rollout()

    work = counted_flops(run)
    priced = price(spec, "registers")
    assert work > 0 and work <= priced.flops <= 1.5 * work, (work, priced.flops, priced.flops / work)
    assert priced.tokens == spec.num_tokens + 1 and priced.kept_bytes > price(spec, "analyse").kept_bytes
    with pytest.raises(ValueError, match="no place for one"):
        price(get_spec("shapes_swin"), "registers")


def test_concepts_are_priced_within_their_counted_work():
    """"concepts": the forward up to the SAE's layer, its encoding and decoding; "concept_ablate": the
    two forwards of `ablate` and the encoding in the second. Each within 1.5x of what runs, at an
    early and at the last layer, with a narrow and a wide SAE."""
    from vitviz.concepts.browse import concept_map
    from vitviz.concepts.sae import TopKSAE

    model = vitviz.load_model("shapes_p16")
    spec = model.spec
    _, x = _image(spec)
    for layer, features, k in ((0, 64, 4), (5, 1536, 32)):
        sae = TopKSAE(spec.config.width, features, k)
        for kind, run in (("concepts", lambda: concept_map(model, x[0], sae, layer=layer)),
                          ("concept_ablate", lambda: vitviz.inside.ablate(model, x[0], features=[1, 2], concepts=sae, layer=layer))):
            work = counted_flops(run)
            priced = price(spec, kind, sae=(layer, features, k)).flops
            assert work > 0 and work <= priced <= 1.5 * work, (kind, layer, features, work, priced, priced / work)
    small, large = price(spec, "concepts", sae=(1, 64, 4)), price(spec, "concepts", sae=(1, 4096, 4))
    assert large.bytes > small.bytes + 3 * spec.num_tokens * 4000 * 4 and large.kept_bytes == small.kept_bytes
    with pytest.raises(ValueError, match="sae=\\(layer, features, k\\)"):
        price(spec, "concepts")
    with pytest.raises(ValueError, match="windowed"):
        price(get_spec("shapes_swin"), "concepts", sae=(0, 64, 4))
