"""What a request is priced before it runs, held to what it does: the model work each kind of
request really runs (counted by torch's FlopCounterMode, no clock) within the price and within 1.5x
of it; the speed the server learns kept apart for each line of work (an injected clock); the
orderings, phrases and rollouts a price counts."""

import json
import math
import statistics

import pytest
import torch

import vitviz
from vitviz import cost
from vitviz.cost import Cost, price
from vitviz.explainers import methods as registered_methods
from vitviz.explanations import relevance_maps
from vitviz.server.guards.work import LineTimes, ModelWork, Pace
from vitviz.sources import get_spec
from conftest import counted_flops


def _image(spec, seed: int = 5):
    """A generated shapes image at the model's size, and its input [1, 3, S, S]."""
    from PIL import Image

    picture = Image.fromarray(vitviz.shapes.render(3, seed=seed, index=0, image_size=spec.image_size)[0])
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


@pytest.mark.parametrize("name", ["shapes_p16", "shapes_p8@192", "shapes_swin@320"])
def test_the_attention_products_are_told_apart_as_counted(name):
    """Of a forward's work, the attention products (`Cost.products`) are exactly what torch counts in
    its fused attention's calls (4 L N² D; a Swin's window by window); of an ablation's and a head
    importance's, at least those and at most 1.5 times them; and never more than the whole work."""
    model = vitviz.load_model(name)
    spec = model.spec
    _, x = _image(spec)
    with torch.no_grad():
        assert counted_flops(lambda: model(x), attention=True) == pytest.approx(cost.attention_flops(spec), rel=1e-9)
    kinds = ["analyse", "explain", "faithfulness", "view", "export"]
    if spec.config.attention != "windowed":
        counted = {"ablate": counted_flops(lambda: vitviz.inside.ablate(model, x[0], [(0, 0)]), attention=True),
                   "importance": counted_flops(lambda: vitviz.inside.head_importance(model, x[0]), attention=True)}
        for kind, work in counted.items():
            priced = price(spec, kind).products
            assert 0 < work <= priced <= 1.5 * work, (kind, work, priced)
        kinds += ["ablate", "importance", "patch", "patch_one", "registers"]
    for kind in kinds:
        c = price(spec, kind)
        assert 0 <= c.products <= c.flops, kind
    assert price(spec, "view").products == 0 == price(spec, "export").products  # a rollout and its pictures: no model runs


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
    the fixed part only (the median of their time less their work at the rate, which still prices
    the work); with large ones beside them the fit gives both parts, and a job ten times the largest
    is priced at its time (one speed alone would price the small ones far above theirs)."""
    times = LineTimes(rate=1e9)
    assert times.estimate("explain/global", 2e9) == pytest.approx(2.0)  # no job yet: the rate
    times.add("explain/global", 1e8, 0.6 + 1e8 / 1e10)
    times.add("explain/global", 1.2e8, 0.6 + 1.2e8 / 1e10)
    pace = times.parts("explain/global")
    assert (pace.fixed, pace.speed, pace.bandwidth) == (pytest.approx(0.6 + 1.1e8 / 1e10 - 1.1e8 / 1e9), 1e9, math.inf)
    for flops in (4e10, 1e11):
        times.add("explain/global", flops, 0.6 + flops / 1e10)
    pace = times.parts("explain/global")
    assert pace.fixed == pytest.approx(0.6) and pace.speed == pytest.approx(1e10)
    assert times.estimate("explain/global", 1e12) == pytest.approx(100.6)
    assert times.estimate("view/windowed", 1e11) == pytest.approx(100.0)  # another family's line: its rate still
    times.add("view/windowed", 0.0, 5.0)  # no work, or no time: not counted
    times.add("view/windowed", 1e9, 0.0)
    assert times.parts("view/windowed") == Pace(0.0, 1e9)


def test_a_line_that_has_run_no_large_job_runs_at_its_familys_speed():
    """A machine's speed shows in every kind of work: a line that has run no large job yet prices
    its work at the median over its family's lines that have (each its large jobs' flops over their
    whole time), not at the rate (here 20 times too slow, as on a GPU), and its own fixed part
    stays; once it runs a large job, its own. Another family's lines lend it nothing, and no line
    makes another slower than the rate: a client's slow jobs of one kind (memory-bound rollouts)
    never get another client's first request of another kind refused. A line whose large jobs small
    ones pushed out keeps the slowest it ran, not its family's (a slow kind never priced as a fast
    one by a client's small requests)."""
    times = LineTimes(rate=1e9)
    for line, speed in (("explain/global", 1e10), ("importance/global", 2e10), ("faithfulness/global", 4e10)):
        for flops in (1e8, 2e10, 8e10):
            times.add(line, flops, 0.1 + flops / speed)
    times.add("view/windowed", 4e10, 0.1 + 4e10 / 1e12)  # fast, and of another family
    times.add("global", 8e10, 0.1 + 8e10 / 1e12)  # a line named as the family, of no family: its own
    times.add("registers/global", 1e8, 0.05)  # small jobs only
    times.add("registers/global", 3e8, 0.06)
    middle = statistics.median([8e10 / (0.1 + 8e10 / 2e10), 2e10 / (0.1 + 2e10 / 2e10)])  # importance's, all time counted
    fixed = statistics.median([0.05 - 1e8 / middle, 0.06 - 3e8 / middle])  # (their work at that speed: not twice)
    assert times.parts("registers/global") == Pace(pytest.approx(fixed), pytest.approx(middle))
    assert times.estimate("registers/global", 6e10) == pytest.approx(fixed + 6e10 / middle)  # (at the rate: 60 s)
    assert times.estimate("patch/windowed", 6e10) == pytest.approx(6e10 / 1e12 * (1 + 0.1 / 0.04))  # its own family's
    assert times.estimate("ask/other", 6e10) == pytest.approx(60.0)  # a family no line of which ran a large job: the rate
    times.add("registers/global", 5e10, 0.055 + 5e10 / 5e9)  # its own large job, slower than its family
    assert times.parts("registers/global").speed < 6e9

    evicted = LineTimes(rate=1e9, keep=4)  # a slow kind of work whose large jobs a client pushes out with small ones
    for line, speed, fixed in (("analyse/windowed", 3e10, 0.1), ("view/windowed", 1e12, 0.01)):
        for flops in (2e10, 8e10):
            evicted.add(line, flops, fixed + flops / speed)
    for _ in range(4):
        evicted.add("analyse/windowed", 1e8, 0.05)
    assert evicted.parts("analyse/windowed").speed == pytest.approx(2e10 / (0.1 + 2e10 / 3e10))  # the slowest it ran

    slow = LineTimes(rate=1e10)
    for flops in (1e8, 2e10, 8e10):
        slow.add("export/global", flops, 0.1 + flops / 1e8)  # 800 s for 8e10 flops: slower than the rate
    assert slow.parts("analyse/global").speed == 1e10  # the rate, not the slow line's speed
    for line in ("view/global", "explain/global"):
        for flops in (1e8, 2e10, 8e10):
            slow.add(line, flops, 0.01 + flops / 1e11)
    assert slow.parts("analyse/global").speed == pytest.approx(statistics.median([8e10 / (0.01 + 0.8), 2e10 / (0.01 + 0.2)]))


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


def test_attention_products_are_learned_as_a_part_of_their_own():
    """Jobs of four variants whose time is 0.02 s, plus their flops at 1e11 a second, plus their
    attention products once more at 2e10 a second (narrow heads' products, slower than the
    projections'): the fit finds the parts and prices a variant never run at its time, whether most
    of its work is attention (74 %, as `shapes_p16@576`) or little (1 %, as `vit_b_32`). Told its
    flops only, the same line prices the first at under a third of its time and the second at over
    1.3 times."""
    def took(flops, products):
        return 0.02 + flops / 1e11 + products / 2e10

    jobs = {"wide": (4e10, 4e8), "narrow": (2e10, 1.2e10), "small": (1e8, 1e7), "mid": (6e10, 1.5e10)}
    times, flops_only = LineTimes(rate=1e9), LineTimes(rate=1e9)
    for variant, (flops, products) in jobs.items():
        times.add("patch/global", flops, took(flops, products), variant, products=products)
        flops_only.add("patch/global", flops, took(flops, products), variant)
    pace = times.parts("patch/global")
    assert pace.speed == pytest.approx(1e11, rel=1e-6) and pace.products_speed == pytest.approx(2e10, rel=1e-6)
    for flops, products in ((1e11, 7.4e10), (2e11, 2e9)):
        truth = took(flops, products)
        assert times.estimate("patch/global", flops, "new", products=products) == pytest.approx(truth, rel=1e-6)
        assert ModelWork(budget_bytes=2**40, lanes=1, seconds=100.0, rate=1e9).estimate(
            Cost("patch", "new", 1, 1, 0, flops, products=products)) == pytest.approx(flops / 1e9)  # nothing run yet: the rate
    assert flops_only.estimate("patch/global", 1e11, "new") < took(1e11, 7.4e10) / 3
    assert flops_only.estimate("patch/global", 2e11, "new") > 1.3 * took(2e11, 2e9)
    times.add("patch/global", 1e9, 0.1, "odd", products=2e9)  # more products than flops: not a job, not counted
    assert times.parts("patch/global") == pace


def test_a_large_job_sets_the_speed_once_its_work_is_most_of_its_time():
    """On a fast machine a line's large jobs may all take under a fifth of a second: jobs of 1e10
    flops or more that took over twice the median time of the line's smaller ones (their work most
    of their time) set its speed, and a variant never run is priced at its time, not at the rate
    (three times its time here). A large job that took no more than twice the small ones' (its
    time mostly theirs, a slow machine's fixed part) does not set a speed, nor its fixed part."""
    def took(flops):
        return 0.01 + flops / 1.5e11

    times = LineTimes(rate=5e10)
    for variant, flops in (("a", 1e8), ("b", 1e9), ("c", 2e9), ("d", 1.04e10), ("e", 1.76e10)):
        times.add("ablate/global", flops, took(flops), variant)
    assert times.estimate("ablate/global", 7e10, "new") == pytest.approx(took(7e10), rel=1e-6)  # (at the rate: 1.41 s)
    slow = LineTimes(rate=5e10)
    for variant, flops, seconds in (("a", 1e8, 0.3), ("d", 1.2e10, 0.55), ("e", 1.5e10, 0.58)):
        slow.add("ablate/global", flops, seconds, variant)
    assert slow.parts("ablate/global") == Pace(0.3 - 1e8 / 5e10, 5e10)  # (the fixed part the smaller job's, not theirs)


def test_a_small_jobs_work_is_priced_once_not_again_in_the_fixed_part():
    """Jobs that take 2 ms besides their work at 1e11 flops a second, the speed of their family's
    other lines (the concepts' maps of three sizes of model, 3-41 ms): a line of small jobs alone
    has a fixed part of their time less their work at that speed, so a variant never run is priced
    at its time (2.3 ms; their median time as the fixed part would price it at 25 ms). A line of
    two sizes, one of them large (time 0.05 s plus the work at 1e11 a second), has the large job's
    speed (its time less the smaller job's) and the smaller job's time less its work at that speed:
    a small variant and a large one are priced within 1.1x of their times, where the smaller job's
    whole time as the fixed part would price the first at 1.9 times its time. Two sizes never let
    the smaller job set the speed, nor two large ones run faster than the slower's median with the
    faster's: a line fitted through them exactly would let in requests that take twice the limit."""
    times = LineTimes(rate=5e10)
    for flops in (2e10, 8e10):
        times.add("explain/global", flops, flops / 1e11)
    for flops in (1e9, 3.7e9):
        times.add("concepts/global", flops, 0.002 + flops / 1e11)
    assert times.parts("concepts/global") == Pace(pytest.approx(0.002), pytest.approx(1e11))
    assert times.estimate("concepts/global", 3.3e7, "new") == pytest.approx(0.002 + 3.3e7 / 1e11)

    for flops in (5e9, 6e10):
        times.add("registers/global", flops, 0.05 + flops / 1e11)
    for flops in (4e8, 2e11):
        assert times.estimate("registers/global", flops, "new") == pytest.approx(0.05 + flops / 1e11, rel=0.1)

    for jobs in ([(5e9, 0.05, 0.0), (2e10, 2.0, 0.0)],  # a fast small model beside a slow large one: 500 s at its pace
                 [(9.9e9, 0.04, 0.0), (1e10, 1.0, 0.0)],  # (the same, just under the large jobs' flops: 500 s)
                 [(1e10, 1.0, 0.0), (2e10, 1.1, 0.0)],  # two large sizes, the larger faster: 250-500 s
                 [(1e11, 2.0, 1e9), (1e11, 3.0, 2e9)]):  # the same flops, other bytes: 100-150 s at their paces
        line = LineTimes(rate=5e10)
        for flops, seconds, nbytes in jobs:
            line.add("ablate/global", flops, seconds, nbytes=nbytes)
        slowest = min(flops / seconds for flops, seconds, _ in jobs)
        request = 5e12 if jobs[0][0] < 1e11 else 1e13
        assert line.estimate("ablate/global", request, "new") > 0.7 * request / slowest, jobs


def test_three_sizes_never_set_the_attention_products_speed():
    """Three jobs whose time is 0.05 s plus their flops at 1e11 a second, give or take a tenth (the one
    with most attention products slower), and owes nothing to those products: three sizes fit three
    parts exactly, so the products' part waits for a fourth size and is not taken from their noise
    (which would price products at 3.4e11 flops a second)."""
    times = LineTimes(rate=1e9)
    for (flops, products), noise in zip(((1e9, 1e8), (4e10, 3e10), (1e11, 1e9)), (1.0, 1.1, 0.9)):
        times.add("analyse/global", flops, (0.05 + flops / 1e11) * noise, products=products)
    assert times.parts("analyse/global").products_speed == math.inf
    times.add("analyse/global", 2e11, 0.05 + 2e11 / 1e11, products=1.5e11)
    assert times.parts("analyse/global").speed < math.inf


def test_slow_small_jobs_never_make_a_large_one_look_slow():
    """Small jobs slowed down (here 0.3 s each for 1e8 flops, as under load or a test's sleep) set
    the fixed part only: a large job of a variant not yet run is priced at that and its work at the
    rate, not at the small jobs' speed (which would be 2,000 s here, and refuse it)."""
    times = LineTimes(rate=5e10)
    for _ in range(10):
        times.add("analyse/global", 1e8, 0.3, "small")
    assert times.estimate("analyse/global", 2e11, "large") == pytest.approx(0.3 - 1e8 / 5e10 + 2e11 / 5e10)
    assert times.estimate("analyse/global", 1.2e8, "small") == pytest.approx(0.36)  # its own jobs price a variant that has run


def test_the_server_learns_both_parts_from_the_jobs_it_times():
    """Through `ModelWork` with an injected clock: small and large jobs, each 0.25 s plus its work at
    2e10 flops a second; a request four times the larger is then priced at about its time, and one
    whose time passes the limit is refused."""
    clock = _Clock()
    work = ModelWork(budget_bytes=2**40, lanes=1, seconds=30.0, rate=1e12, clock=clock)
    jobs = [Cost("analyse", name, 1, 1, 0, flops) for name, flops in (("a", 1e9), ("b", 4e10), ("c", 1e9), ("d", 1e11), ("e", 2e9))]
    for c in jobs:
        with work.job(c):
            clock.now += 0.25 + c.flops / 2e10
    huge = Cost("analyse", "huge", 1, 1, 0, 4e11)
    assert work.estimate(huge) == pytest.approx(0.25 + 4e11 / 2e10, rel=0.03)
    assert work.refusal(Cost("analyse", "huger", 1, 1, 0, 40 * 2e10)) is not None


def test_the_server_learns_the_attention_products_from_the_jobs_it_times():
    """Through `ModelWork` with an injected clock: jobs that take 0.02 s, plus their flops at 1e11 a
    second, plus their attention products once more at 2e10; a variant never run whose work is
    mostly attention is then priced at its time and, past the limit, refused, where the same flops
    with few products are let in."""
    clock = _Clock()
    work = ModelWork(budget_bytes=2**40, lanes=1, seconds=30.0, rate=1e12, clock=clock)
    for name, flops, products in (("wide", 4e10, 4e8), ("narrow", 2e10, 1.2e10), ("small", 1e8, 1e7), ("mid", 6e10, 1.5e10)):
        with work.job(Cost("patch", name, 1, 1, 0, flops, products=products)):
            clock.now += 0.02 + flops / 1e11 + products / 2e10
    attention = Cost("patch", "new", 1, 1, 0, 8e11, products=6e11)
    assert work.estimate(attention) == pytest.approx(0.02 + 8 + 30, rel=1e-6)
    assert "would take about 38 s" in work.refusal(attention)
    assert work.refusal(Cost("patch", "new", 1, 1, 0, 8e11, products=1e10)) is None  # 8.5 s


def test_a_variant_that_has_run_is_priced_by_its_own_jobs():
    """Variants of one line differ in what a flop costs them: once a variant has run a job of about
    the size asked (within 1.5x), its own jobs price it; a new variant, or a size far from what it
    ran, is priced by the line's fit."""
    times = LineTimes(rate=1e9)
    for flops, seconds, variant in ((1e9, 0.6, "narrow"), (1e10, 1.5, "wide"), (4e9, 0.9, "mid")):
        times.add("analyse/global", flops, seconds, variant)
    pace = times.parts("analyse/global")
    assert times.estimate("analyse/global", 1.2e10, "wide") == pytest.approx(1.5 * 1.2)
    assert times.estimate("analyse/global", 1.2e10, "new") == pytest.approx(pace.seconds(1.2e10))
    assert times.estimate("analyse/global", 3e10, "wide") == pytest.approx(pace.seconds(3e10))
    assert times.estimate("view/global", 1e10, "wide") == pytest.approx(10.0)  # another line: the rate



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


def test_a_request_far_larger_than_any_run_is_never_priced_at_its_bytes_alone():
    """Three jobs whose time the fit puts on their bytes alone (flops and bytes grow together; the
    speed it finds is infinite): a request of 2e13 flops is still priced at least at half what the
    fastest large job's pace says (2e13 / (2 x 7.2e10 / 2.8 s), 389 s) and refused past the limit,
    where its bytes alone would price it at about 3 s and let it run."""
    clock = _Clock()
    work = ModelWork(budget_bytes=2**40, lanes=1, seconds=300.0, rate=5e10, clock=clock)
    for name, flops, nbytes, took in (("a", 1.9e8, 8.2e6, 0.034), ("b", 1.6e8, 1.2e6, 0.021), ("c", 7.2e10, 2.7e9, 2.796)):
        with work.job(Cost("faithfulness", name, 1, int(nbytes), 0, flops)):
            clock.now += took
    huge = Cost("faithfulness", "huge", 1, int(3e9), 0, 2e13)
    assert work.estimate(huge) >= 2e13 / (2 * 7.2e10 / 2.796) * 0.999
    assert "would take about" in work.refusal(huge)


def test_jobs_of_one_size_count_once_whichever_variants_ran_them():
    """Three checkpoints of one architecture (the same flops and bytes) each ran once: one size, so
    no fit (it would find a fixed part only and price any work at nothing); the large jobs' speed
    prices a request 340 times larger at about 340 times their time, and refuses it."""
    times = LineTimes(rate=5e10)
    for variant, took in (("vit_b_16", 0.9), ("deit", 1.0), ("dino", 1.1)):
        times.add("analyse/global", 3.5e10, took, variant, nbytes=6e7)
    assert times.parts("analyse/global").speed == pytest.approx(3.5e10)
    assert times.estimate("analyse/global", 1.2e13, "vit_l", nbytes=6e8) == pytest.approx(1.2e13 / 3.5e10)


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


def test_every_kind_of_request_is_in_the_table_of_prices():
    """docs/serving.md's "Every request kind" table has a row naming each kind `vitviz.cost.price`
    takes (`cost.Kind`), the first cell's words; and the serving bench times each kind somewhere."""
    import re
    import typing
    from pathlib import Path

    from vitviz.dev.bench.serving import KINDS

    text = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    section = text.split("## Every request kind", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    named = {word for cell in rows for word in re.findall(r"[a-z_]+", cell.split("(")[0])}
    kinds = set(typing.get_args(cost.Kind))
    assert not kinds - named, f"kinds without a row in docs/serving.md: {sorted(kinds - named)}"
    assert not kinds - set(KINDS) - {"explorer_layer"}, sorted(kinds - set(KINDS))


@pytest.mark.parametrize("name", ["shapes_p16@576", "vit_b_32"])
def test_a_forward_that_records_nothing_is_priced_at_what_it_holds(name):
    """Head ablation, head importance, one patched head (or pattern) and an SAE's concepts run forwards that record
    nothing (the fused attention kernel: no [H, N, N] layer held): each priced, above the fixed base,
    at least the tensors it holds at once and at most three times them (a block's parts are priced
    summed where they are held in turn; the kernels' and the allocator's own buffers, which the
    resident peak in docs/serving.md shows and this count does not, take much of the rest). A narrow
    model at 1,297 tokens was priced 21x what ablation holds (four attention layers a copy); one
    patched site, every layer's activations where one layer's are kept."""
    from vitviz.concepts.browse import concept_map
    from vitviz.concepts.sae import TopKSAE
    from vitviz.model import ViT
    from vitviz.patching import patched_logits
    from conftest import held_bytes

    spec = get_spec(name)
    model = vitviz.load_model(name, device="cpu") if spec.source == "embedded" else ViT(spec.config).eval()
    _, x = _image(spec)
    other = _image(spec, seed=6)[1][0]
    sae = TopKSAE(spec.config.width, 256, 8)
    runs = [
        ("ablate", lambda: vitviz.inside.ablate(model, x[0], [(0, 0), (1, 1)]), {}),
        ("importance", lambda: vitviz.inside.head_importance(model, x[0]), {}),
        ("patch_one", lambda: patched_logits(model, x[0], other, [("head", 1, 0)]), dict(patch_kinds=("head",))),
        ("patch_one", lambda: patched_logits(model, x[0], other, [("pattern", 1, 0)]), dict(patch_kinds=("pattern",))),
        ("concepts", lambda: concept_map(model, x[0], sae, layer=2), dict(sae=(2, 256, 8))),
    ]
    for kind, run, options in runs:
        held = held_bytes(run)
        priced = price(spec, kind, **options).bytes - cost.BASE_BYTES - cost.COMPUTE_BYTES
        assert held <= priced <= 3 * held, (kind, options, held / 2**20, priced / 2**20, priced / held)


def test_patching_is_priced_at_what_its_batches_hold():
    """`patch` holds its cached runs and one batch of copies at a time: block inputs and heads run on
    the fused kernel, a pattern on the explicit path (its logits and weights). Each priced at least
    the tensors held at once and at most three times them, above the fixed base (as the test above);
    priced in the explicit form, the fused batches were over three times what they hold."""
    from vitviz.patching import patch
    from conftest import held_bytes

    spec = get_spec("shapes_p16@192")
    model = vitviz.load_model("shapes_p16@192", device="cpu")
    _, x = _image(spec)
    other = _image(spec, seed=6)[1][0]
    for kinds in (("resid_pre", "head"), ("pattern",)):
        held = held_bytes(lambda: patch(model, x[0], other, where=kinds))
        priced = price(spec, "patch", patch_kinds=kinds).bytes - cost.BASE_BYTES - cost.COMPUTE_BYTES
        assert held <= priced <= 3 * held, (kinds, held / 2**20, priced / 2**20, priced / held)


def test_the_serving_benchs_request_code_is_whole_and_each_kind_goes_where_the_app_serves_it():
    """`vitviz.dev.bench --serving` runs each request from a template (its braces doubled) in a fresh
    process: it formats and compiles; `applies` sends each kind where the app may serve it."""
    from vitviz.dev.bench.serving import _KIND_CODE, applies

    code = _KIND_CODE.format(threads=2, variant="shapes_p16", kind="analyse", image="star.png", clip="moving.gif", budget=2**30)
    compile(code, "<serving request>", "exec")
    served = {("shapes_p16", "patch"), ("shapes_p16", "concepts"), ("shapes_p16", "faithfulness"), ("shapes_vlm", "ask"),
              ("shapes_video", "video"), ("shapes_clip", "find"), ("shapes_p8_outliers", "registers")}
    not_served = {("shapes_swin", "patch"), ("shapes_swin", "registers"), ("shapes_p16", "ask"), ("shapes_p16", "find"),
                  ("shapes_video", "analyse"), ("shapes_p16", "video"), ("vit_b_16", "concepts"), ("shapes_clip", "faithfulness")}
    assert all(applies(*pair) for pair in served), [pair for pair in served if not applies(*pair)]
    assert not any(applies(*pair) for pair in not_served), [pair for pair in not_served if applies(*pair)]


def test_the_serving_benchs_prices_are_the_other_variants_jobs_of_the_line():
    """`priced_rows` prices each request from the other variants' requests alone: four variants whose
    requests take 0.05 s, plus their flops at each variant's own pace (a plain forward's seconds a
    flop, as the bench times it), plus their bytes at 1e9 a second. Scaled by those paces, the
    line's parts price each at its time; by flops alone (the paces differ 3x), not all of them; a
    line no other variant ran is not priced, and one they ran small jobs of only runs at the speed
    their other lines' large jobs show (`LineTimes`)."""
    from vitviz.dev.bench.serving import priced_rows, within

    paces = {"narrow": 3e-11, "wide": 1e-11, "mid": 2e-11, "long": 1.5e-11}  # seconds a flop of a plain forward
    sizes = {"narrow": (4e10, 2e8), "wide": (8e11, 1e8), "mid": (1e9, 3e7), "long": (2e11, 9e8)}
    rows = [dict(variant=v, kind="importance", line="importance/global", flops=f, price=b, peak=b, gpu_peak=None,
                 priced_seconds=f * paces[v], seconds=0.05 + f * paces[v] + b / 1e9) for v, (f, b) in sizes.items()]
    rows.append(dict(rows[0], kind="view", line="view/global", flops=1e8, priced_seconds=1e8 * paces["narrow"], seconds=0.01))
    table = priced_rows(rows)
    assert [(r[0], r[1]) for r in table] == [(r["variant"], r["kind"]) for r in rows]
    for r, row in zip(table[:4], rows):
        assert r[9] == pytest.approx(row["seconds"], rel=1e-6), r
        assert (r[4], r[7]) == (row["priced_seconds"], row["seconds"])
    assert table[4][5] is None and table[4][9] is None  # its line ran on no other variant
    assert within(table, 9) == (4, 4) and within(table, 5)[0] < 4
    # a line whose other variants ran small jobs only: their time, and the family's speed from the other
    # lines' large jobs of the other variants (here importance's of "wide" and "long", all time counted)
    small = [dict(rows[0], variant=v, kind="registers", line="registers/global", flops=f, price=1e6, seconds=t)
             for v, f, t in (("wide", 1e8, 0.02), ("mid", 2e8, 0.03), ("narrow", 4e10, 1.0))]
    family = statistics.median(r["flops"] / r["seconds"] for r in rows[:4] if r["variant"] in ("wide", "long"))
    assert family > 5e10  # (faster than the rate)
    fixed = statistics.median([0.02 - 1e8 / family, 0.03 - 2e8 / family])  # (their time less their work at that speed)
    assert priced_rows(rows + small)[-1][5] == pytest.approx(fixed + 4e10 / family, rel=1e-6)


def test_the_serving_bench_merges_a_requests_runs_into_their_medians():
    """`merged` keeps each request once, in the order it first comes, with the median of its runs'
    seconds, peaks and plain-forward seconds and how many runs there were; a GPU peak measured in
    none stays None; runs whose price or flops differ (other code) are refused, not averaged."""
    from vitviz.dev.bench.serving import merged

    def run(variant, kind, seconds, peak, round_, flops=1e9):
        return dict(variant=variant, kind=kind, seconds=seconds, peak=peak, gpu_peak=None, priced_seconds=seconds / 2,
                    price=5, flops=flops, products=2e8, line=f"{kind}/global", round=round_)

    runs = [run("a", "explain", 1.0, 10, 0), run("b", "view", 0.2, 4, 0), run("a", "explain", 3.0, 30, 1),
            run("b", "view", 0.1, 8, 1), run("a", "explain", 1.5, 20, 2)]
    got = merged(runs)
    assert [(r["variant"], r["kind"], r["runs"]) for r in got] == [("a", "explain", 3), ("b", "view", 2)]
    a, b = got
    assert (a["seconds"], a["peak"], a["priced_seconds"], a["gpu_peak"]) == (1.5, 20, 0.75, None)
    assert (b["seconds"], b["peak"]) == (pytest.approx(0.15), 6)
    assert (a["flops"], a["products"], a["line"]) == (1e9, 2e8, "explain/global") and "round" not in a
    with pytest.raises(ValueError, match="differ in flops"):
        merged(runs + [run("a", "explain", 1.0, 10, 3, flops=2e9)])


def test_the_serving_bench_prices_saved_runs_again_without_measuring(tmp_path, capsys):
    """`--serving --reprice FILE...` reads the runs `--rows` wrote (from one file or several), prices
    their medians as a measured run would be priced, measures nothing, and writes what it read back
    with `--rows`; a file that is not one is refused with its name."""
    from vitviz.dev.bench import main

    def run(variant, seconds, flops):
        return dict(variant=variant, kind="importance", line="importance/global", flops=flops, products=0.0, price=1e6,
                    peak=2e6, gpu_peak=None, priced_seconds=seconds, seconds=seconds, round=0)

    sizes = {"a": 1e9, "b": 4e9, "c": 1.6e10, "d": 6.4e10}  # 0.02 s and 1e-11 s a flop, as measured in the first file
    first = [run(v, 0.02 + f * 1e-11, f) for v, f in sizes.items()]
    second = [dict(r, seconds=r["seconds"] * 3, round=1) for r in first]  # a slow run: the median of two is its mean
    (tmp_path / "1.json").write_text(json.dumps(first))
    (tmp_path / "2.json").write_text(json.dumps(second))
    main(["--serving", "--reprice", str(tmp_path / "1.json"), str(tmp_path / "2.json"), "--rows", str(tmp_path / "all.json")])
    out = capsys.readouterr().out
    assert "priced again" in out and "median over its runs (up to 2)" in out
    table = [line.split() for line in out.splitlines() if line.startswith(("a ", "b ", "c ", "d "))]
    assert [t[0] for t in table] == ["a", "b", "c", "d"]
    for t, (variant, flops) in zip(table, sizes.items()):
        seconds = 2 * (0.02 + flops * 1e-11)
        assert float(t[9]) == pytest.approx(seconds, abs=0.006) and float(t[6]) == pytest.approx(seconds, abs=0.006), t
    assert json.loads((tmp_path / "all.json").read_text()) == first + second
    for name, text in (("bad.json", "not runs"), ("object.json", json.dumps(first[0])),
                       ("short.json", json.dumps([{k: v for k, v in first[0].items() if k != "flops"}]))):
        (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit, match=name):
            main(["--serving", "--reprice", str(tmp_path / name)])
    with pytest.raises(SystemExit, match="go with --serving"):
        main(["--reprice", str(tmp_path / "1.json")])


def test_the_serving_bench_sums_each_kind_up_from_its_rows():
    """`by_kind` counts a kind's priced rows, those within 1.5x of their seconds and their ratios'
    median and range, leaves out a row its line could not price, and does the same for memory over
    the rows whose peak is over 16 MiB; kinds in the order they first come. `gap` gives the rows
    under 0.3 s their greatest difference in seconds."""
    from vitviz.dev.bench.serving import by_kind, gap

    def row(variant, kind, priced_mb, peak_mb, line_s, seconds):
        return (variant, kind, priced_mb, peak_mb, None, line_s, None, seconds, None, None)

    rows = [row("a", "patch", 20, 10, 1.0, 1.0), row("b", "view", 12, 1, 0.02, 0.01), row("b", "patch", 40, 32, 3.0, 1.5),
            row("c", "patch", 30, 40, None, 2.0), row("d", "patch", 100, 50, 0.5, 1.0)]
    assert by_kind(rows) == [("patch", 3, 1, 1.0, 0.5, 2.0, 3, 2, 1.25, 0.75, 2.0),
                             ("view", 1, 0, 2.0, 2.0, 2.0, 0, 0, None, None, None)]
    # and the rows under 0.3 s (here b's view alone) by their greatest gap in seconds, not a ratio
    assert gap(rows, 5) == (pytest.approx(0.01), 1)
    assert gap(rows, 5, below=1.2) == (0.5, 3) and gap(rows, 5, below=0.001) == (0.0, 0)


@pytest.mark.parametrize("saved", [f"serving_{what}_{commit}.json" for what in ("kinds", "patch")
                                   for commit in ("5ffa94c", "de60324", "c3a9008")])
def test_the_saved_runs_of_every_kind_are_priced_within_their_seconds(saved):
    """The runs measured on this machine and saved in docs/runs (docs/serving.md, "A small job's
    work priced once"), priced again as a server that ran the other variants would: each kind's
    median price is within 1.5x of its seconds, every request of 0.3 s or more but at most three
    within 1.5x, and every request under 0.3 s within 0.25 s. (Recorded times: nothing is timed.)"""
    from pathlib import Path

    from vitviz.dev.bench.serving import by_kind, gap, merged, priced_rows, within

    runs = json.loads((Path(__file__).resolve().parents[1] / "docs" / "runs" / saved).read_text())
    table = priced_rows(merged(runs))
    for kind, priced, _, median, *_ in by_kind(table):
        assert priced and 1 / 1.5 <= median <= 1.5, (kind, median)
    close, long = within(table, 5, least=0.3)
    assert long and close >= long - 3
    assert gap(table, 5)[0] < 0.25


def test_a_request_whose_work_is_no_number_is_refused():
    """A cost whose flops are not a number prices at no number of seconds, which no comparison with
    the limit catches: it is refused as unpriced, never let in."""
    work = ModelWork(budget_bytes=2**40, lanes=1, seconds=300.0)
    assert "could not be priced" in work.refusal(Cost("analyse", "odd", 1, 1, 0, math.nan))
    assert work.refusal(Cost("analyse", "even", 1, 1, 0, 1e9)) is None
