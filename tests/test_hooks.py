"""record_attention: hooks live for one block, fail loudly, and keep threads apart."""

import threading

import pytest
import torch

import vitviz


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(1)
    return vitviz.get_spec("shapes_p8").build().eval()


def test_records_every_layer_and_leaves_no_hook(model):
    x = torch.randn(2, 3, 96, 96)
    with torch.inference_mode(), vitviz.record_attention(model) as rec:
        model(x)
        assert _hook_count(model) == model.depth
    assert _hook_count(model) == 0
    a = rec.attentions
    assert a.shape == (6, 2, 3, 145, 145)
    torch.testing.assert_close(a.sum(-1), torch.ones(6, 2, 3, 145))


def test_no_hook_remains_after_an_exception(model):
    with pytest.raises(ValueError):
        with vitviz.record_attention(model):
            model(torch.randn(1, 3, 50, 50))
    assert _hook_count(model) == 0
    with pytest.raises(RuntimeError, match="boom"):
        with vitviz.record_attention(model):
            raise RuntimeError("boom")
    assert _hook_count(model) == 0


def test_nothing_captured_fails_loudly(model):
    with vitviz.record_attention(model) as rec:
        pass
    with pytest.raises(RuntimeError, match="captured nothing"):
        rec.attentions


def test_two_forwards_keep_both_and_report_the_last(model):
    x1, x2 = torch.randn(1, 3, 96, 96), torch.randn(1, 3, 96, 96)
    with torch.inference_mode(), vitviz.record_attention(model) as rec:
        model(x1)
        model(x2)
    assert len(rec.calls) == 2
    with torch.inference_mode(), vitviz.record_attention(model) as solo:
        model(x2)
    torch.testing.assert_close(rec.attentions, solo.attentions)


def test_models_without_vitviz_attention_are_refused():
    with pytest.raises(TypeError, match="from_torchvision"):
        with vitviz.record_attention(torch.nn.Linear(2, 2)):
            pass


def test_eight_threads_sharing_one_model_get_their_own_attention(model):
    inputs = [torch.randn(1, 3, 96, 96, generator=torch.Generator().manual_seed(i)) for i in range(8)]

    def run(x):
        with torch.inference_mode(), vitviz.record_attention(model) as rec:
            logits = model(x)
        return logits, rec.attentions

    alone = [run(x) for x in inputs]
    results: list = [None] * 8
    errors = []
    barrier = threading.Barrier(8)

    def worker(i):
        try:
            barrier.wait()
            for _ in range(3):
                results[i] = run(inputs[i])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for (want_logits, want_attn), (got_logits, got_attn) in zip(alone, results):
        torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_attn, want_attn, atol=1e-5, rtol=1e-5)
    assert _hook_count(model) == 0


def test_a_thread_that_is_not_recording_is_unaffected(model):
    """While one thread records, another thread's plain forward takes the fused path and captures nothing."""
    x = torch.randn(1, 3, 96, 96)
    started, release = threading.Event(), threading.Event()
    captured = {}

    def recorder():
        with vitviz.record_attention(model) as rec:
            started.set()
            release.wait(10)
        captured["calls"] = rec.calls

    t = threading.Thread(target=recorder)
    t.start()
    started.wait(10)
    with torch.inference_mode():
        model(x)
    release.set()
    t.join()
    assert captured["calls"] == []


def test_reduce_stores_what_it_returns_per_layer(model):
    x = torch.randn(2, 3, 96, 96)
    with torch.inference_mode(), vitviz.record_attention(model) as full:
        model(x)
    with torch.inference_mode(), vitviz.record_attention(model, reduce=lambda a: a[..., 0, :].amax(-1)) as rec:
        model(x)
    assert rec.attentions.shape == (6, 2, 3)
    torch.testing.assert_close(rec.attentions, full.attentions[..., 0, :].amax(-1))
    assert _hook_count(model) == 0


def _per_image(a):
    return (a * torch.arange(a.shape[-1], dtype=a.dtype)).sum(-1).mean(-1)  # [b, H]: each head's mean key index


@pytest.mark.parametrize("images", [1, 2, 5, 9])
def test_reduced_a_few_images_at_a_time_equals_the_whole_layers(model, images):
    """With images_at_a_time, each layer's attention is computed and reduced in parts of the batch:
    the stored results and the model's outputs are those of the whole layer, bit for bit, and the
    parts were of the size asked for."""
    x = torch.randn(5, 3, 96, 96)
    with torch.inference_mode(), vitviz.record_attention(model, reduce=_per_image) as whole:
        expected = model(x)
    sizes = []

    def counted(a):
        sizes.append(a.shape[0])
        return _per_image(a)

    with torch.inference_mode(), vitviz.record_attention(model, reduce=counted, images_at_a_time=images) as rec:
        got = model(x)
        assert _hook_count(model) == 0  # no hook: the parts go to the recorder directly
    assert torch.equal(got, expected) and torch.equal(rec.attentions, whole.attentions)
    assert rec.attentions.shape == (6, 5, 3)
    part = min(images, 5)
    assert sizes == ([part] * (5 // part) + ([5 % part] if 5 % part else [])) * 6
    from vitviz.model import _part_reducer

    assert all(_part_reducer(m) is None for m in model.modules())  # nothing left behind in this thread


def test_reducing_by_parts_meets_other_recorders_and_gradients(model):
    """A second recorder in the same block (or a hook of anyone's) makes each layer whole again, for
    both; a forward with autograd on still differentiates; bad settings are refused."""
    x = torch.randn(3, 3, 96, 96)
    with torch.inference_mode(), vitviz.record_attention(model) as full:
        model(x)
    with torch.inference_mode(), vitviz.record_attention(model, reduce=_per_image, images_at_a_time=1) as parts:
        with vitviz.record_attention(model) as inner:
            model(x)
    torch.testing.assert_close(inner.attentions, full.attentions, rtol=0, atol=0)
    torch.testing.assert_close(parts.attentions, _per_image(full.attentions.flatten(0, 1)).unflatten(0, (6, 3)))
    inp = x.clone().requires_grad_(True)
    with vitviz.record_attention(model, reduce=_per_image, images_at_a_time=2) as rec:
        model(inp).sum().backward()
    ref = x.clone().requires_grad_(True)
    model(ref).sum().backward()
    torch.testing.assert_close(inp.grad, ref.grad, rtol=1e-4, atol=1e-6)
    assert rec.attentions.shape == (6, 3, 3)
    for bad in (dict(images_at_a_time=0), dict(images_at_a_time=True), dict(images_at_a_time=1.5)):
        with pytest.raises(ValueError, match="images_at_a_time must be a whole number"):
            with vitviz.record_attention(model, reduce=_per_image, **bad):
                pass
    for bad in (dict(), dict(reduce=_per_image, gradients=True), dict(reduce=_per_image, graph=True)):
        with pytest.raises(ValueError, match="needs a reduce"):
            with vitviz.record_attention(model, images_at_a_time=2, **bad):
                pass
    assert _hook_count(model) == 0
