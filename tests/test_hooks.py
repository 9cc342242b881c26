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
