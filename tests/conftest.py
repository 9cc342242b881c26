import contextlib
import functools
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("MPLBACKEND", "Agg")
import gradio.http_server
import gradio.networking
import pytest
import torch

# A server's end waited for whole. Gradio's `Server.close` waits 5 s for the server's thread, and the
# thread's end (its lifespan) deletes every file the Blocks made, uploads included; the suite launches
# the same Blocks (`vitviz.server.app.demo`) again in the next module, so an end later than that
# deletes the next server's files (four empty figures of the page test on an idle machine). Here
# closing waits for the end; a server still held by an open connection after 30 s is stopped
# without its end (uvicorn's `force_exit`: no lifespan, so no late deletion).
_gradio_close = gradio.http_server.Server.close


def _close_whole(self):
    _gradio_close(self)
    self.thread.join(timeout=30)
    if self.thread.is_alive():
        self.force_exit = True
        self.thread.join(timeout=30)


gradio.http_server.Server.close = _close_whole

# A server's launch asked for its page with patience. Gradio's `launch` checks that its own page
# answers (`networking.url_ok`) and fails ("When localhost is not accessible, a shareable link must
# be created") at the first HEAD that takes over 3 s, which a server just started on a machine running
# another suite beside this one may take. Here the check asks again until 60 s have passed.


def _url_ok_patiently(url: str) -> bool:
    import time

    import httpx

    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.head(url, timeout=10, verify=False).status_code in (200, 401, 301, 302, 303, 307, 308):
                return True
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


gradio.networking.url_ok = _url_ok_patiently


def pytest_configure(config):
    """With the suite split over processes (pytest-xdist, `-n`), each process computes on one thread:
    two processes of two threads each on a 2-core machine wait on each other."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _scratch_in_pytest_tmp(tmp_path_factory):
    """Libraries' scratch files go under pytest's own temporary folder, which pytest prunes:
    gradio_client leaves one folder per downloaded file in the system's temporary folder."""
    import tempfile

    before = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.mktemp("scratch"))
    yield
    tempfile.tempdir = before


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@contextlib.contextmanager
def sources_kept():
    """The model-family registry as it was before the block, after it (a registration is per process:
    the rest of the session must not see a family a test registered)."""
    from vitviz.sources import base

    with base._LOCK:
        before = dict(base._SOURCES)
    try:
        yield
    finally:
        with base._LOCK:
            base._SOURCES.clear()
            base._SOURCES.update(before)
            base._generation += 1  # the caches of `vitviz.sources` are made again


def _cpu_attention(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def counted_flops(fn, *, attention: bool = False) -> float:
    """The flops `fn()` runs, as torch's FlopCounterMode counts them (the CPU's fused attention counted
    by the formula torch uses for CUDA's kernels, which it counts and the CPU's it does not); with
    `attention`, those of the fused attention's calls only (its scores and weighted values)."""
    from torch.utils.flop_counter import FlopCounterMode

    cpu = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention}
    with FlopCounterMode(display=False, custom_mapping=cpu) as counter:
        fn()
    if attention:
        return float(sum(n for op, n in counter.get_flop_counts()["Global"].items() if "scaled_dot_product" in str(op)))
    return float(counter.get_total_flops())


def held_bytes(fn) -> int:
    """The most bytes of CPU tensors made while `fn()` runs that are alive at once (each storage
    counted once, however many views share it; what existed before, weights and inputs, and views
    of them, not counted). Counted from each operation's results as torch dispatches it: no clock,
    no allocator; what one operation holds inside itself (a fused kernel's buffers) is not seen."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Held(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live = self.peak = 0
            self.storages: dict[int, tuple[int, int]] = {}  # data pointer -> (bytes, live tensors on it)

        def _dropped(self, ptr: int) -> None:
            size, tensors = self.storages[ptr]
            if tensors == 1:
                del self.storages[ptr]
                self.live -= size
            else:
                self.storages[ptr] = (size, tensors - 1)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().data_ptr():
                    storage = t.untyped_storage()
                    if storage.data_ptr() in given and storage.data_ptr() not in self.storages:
                        continue  # a view of (or written into) a tensor from before
                    size, tensors = self.storages.get(storage.data_ptr(), (storage.nbytes(), 0))
                    self.live += size if tensors == 0 else 0
                    self.storages[storage.data_ptr()] = (size, tensors + 1)
                    weakref.finalize(t, self._dropped, storage.data_ptr())
            self.peak = max(self.peak, self.live)
            return out

    with Held() as held:
        fn()
    return held.peak


def random_torchvision(arch: str, **kwargs) -> torch.nn.Module:
    """A randomly initialised torchvision ViT with a non-zero head (torchvision zero-inits it)."""
    import torchvision

    model = getattr(torchvision.models, arch)(**kwargs).eval()
    torch.nn.init.normal_(model.heads.head.weight, std=0.02)
    torch.nn.init.normal_(model.heads.head.bias, std=0.02)
    return model


def random_torchvision_checkpoint(torch_home, arch: str = "vit_b_16", *, seed: int = 0):
    """Random weights for `arch` where torchvision looks for its download under `torch_home`, so the
    real weights path loads them offline. Returns the checkpoint's path."""
    import torchvision

    import vitviz

    folder = torch_home / "hub" / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    path = folder / vitviz.get_spec(arch).filename
    torch.save(getattr(torchvision.models, arch)().state_dict(), path)
    return path


_REV = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(root, repo: str, files: dict[str, bytes]):
    """`files` in a Hugging Face cache under `root` (its "hub" folder), as `hf download` leaves them;
    returns the snapshot folder (for more files, e.g. `save_pretrained`)."""
    from pathlib import Path

    folder = Path(root) / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(_REV)
    snap = folder / "snapshots" / _REV
    snap.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (snap / name).write_bytes(data)
    return snap


def random_timm(name: str, **kwargs) -> torch.nn.Module:
    """A timm model with random weights, those that start at a constant (LayerScale, heads, an Eva's
    q and v biases) moved off it (`vitviz.dev.zoo.randomise`), so that a conversion that drops any
    cannot pass."""
    import timm

    from vitviz.dev.zoo import randomise

    return randomise(timm.create_model(name, pretrained=False, **kwargs).eval())


def random_timm_weights(name: str, seed: int = 0) -> tuple[torch.nn.Module, bytes]:
    """`random_timm(name)` seeded, and its weights as the model.safetensors a hub repository holds."""
    from safetensors.torch import save

    torch.manual_seed(seed)
    model = random_timm(name)
    return model, save({k: v.contiguous() for k, v in model.state_dict().items()})


# small models of each kind the app must handle: no head (DINO), a distillation token, registers, rotary positions
APP_TIMM_MODELS = ("vit_small_patch16_224.dino", "deit_tiny_distilled_patch16_224.fb_in1k", "vit_small_patch14_reg4_dinov2.lvd142m",
                   "vit_small_patch16_dinov3.lvd1689m")


@pytest.fixture(scope="session")
def timm_cache(tmp_path_factory):
    """A Hugging Face cache holding random weights for APP_TIMM_MODELS: {name: the timm model}."""
    pytest.importorskip("timm")
    root = tmp_path_factory.mktemp("hf") / "hub"
    models = {}
    for name in APP_TIMM_MODELS:
        models[name], data = random_timm_weights(name)
        write_hub_cache(root, f"timm/{name}", {"model.safetensors": data})
    return root, models


@pytest.fixture
def offline_hub(timm_cache, monkeypatch):
    """This process reads the Hugging Face hub from `timm_cache` only, offline (as HF_HOME and
    HF_HUB_OFFLINE=1 would set it up for a fresh process; huggingface_hub reads them at import)."""
    from huggingface_hub import constants

    root, models = timm_cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return models


def free_port() -> int:
    """A port no one listens on now (a server a test starts must not take a fixed one: another suite
    may run beside it)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(url: str, process, timeout: float = 180) -> None:
    """Waits until a server started as `process` (a subprocess.Popen with stdout) answers `url`."""
    import time

    import httpx

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise AssertionError(f"the app exited:\n{process.stdout.read()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the app did not answer at {url} within {timeout:.0f} s")


@pytest.fixture
def no_network(tmp_path, monkeypatch):
    """No network at all (every connection fails as on a machine without one) and HF_HUB_OFFLINE=1,
    with an empty Hugging Face cache under `tmp_path` in place of the user's: returns its hub folder."""
    import socket

    from huggingface_hub import constants

    def unreachable(*args, **kwargs):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket.socket, "connect", unreachable)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    root = tmp_path / "hf" / "hub"
    root.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("VITVIZ_OFFLINE", raising=False)
    return root


# ------------------------------------------------------------------------------------------------
# The running app, talked to over raw HTTP (the tests of a public server)


@pytest.fixture(scope="module")
def app():
    """The app module (`vitviz.server.app`): its `demo` and launch settings, built once a process."""
    from vitviz.server import app as app_module

    return app_module


def quiet(*args, **kwargs) -> None:
    """A progress callback that shows nothing: a page's handler called directly."""


def analyse_example(variant: str = "shapes_p16", image: str | None = None) -> tuple:
    """The page's analysis of `image` (the first example by default) by `variant`, its handler called
    directly: (the session's reference, the exploration kept for it, the model, the outputs)."""
    from vitviz.server import page, runtime
    from vitviz.server.app import SERVER

    out = page.on_analyze(image or runtime.EXAMPLES[0], variant, "mean", 0.0, progress=quiet)
    ref = out[page.PAGE.state]
    return ref, SERVER.store.get(ref.key), SERVER.cache.get(variant)[0], out


@contextlib.contextmanager
def serving(demo, **launch_kwargs):
    """`demo` served on 127.0.0.1 with `launch_kwargs`: its base URL; closed afterwards."""
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True, **launch_kwargs)
    try:
        yield demo.local_url.rstrip("/")
    finally:
        demo.close()


@pytest.fixture(scope="module")
def server(app):
    """The app served on 127.0.0.1 for a module's tests, as `python app.py` launches it: its base URL."""
    with serving(app.demo, **app.LAUNCH_KWARGS) as base:
        yield base


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A generated shapes image (a star) as a PNG file."""
    from PIL import Image

    import vitviz

    path = tmp_path_factory.mktemp("good") / "star.png"
    Image.fromarray(vitviz.shapes.render(3, seed=5, index=0)[0]).save(path)
    return path


def _http(address: str | None):
    """An HTTP client whose requests come from `address` (a loopback address such as 127.0.0.2: another
    client to the server), or from the system's choice."""
    import httpx

    return httpx.Client(transport=httpx.HTTPTransport(local_address=address) if address else None)


def upload(base: str, path, *, address: str | None = None) -> dict:
    """`POST /gradio_api/upload` of one file: the payload an event takes for it."""
    with open(path, "rb") as f, _http(address) as http:
        r = http.post(f"{base}/gradio_api/upload", files=[("files", (os.path.basename(path), f.read()))], timeout=60)
    r.raise_for_status()
    return {"path": r.json()[0], "meta": {"_type": "gradio.FileData"}}


@functools.lru_cache(maxsize=None)
def fn_index(base: str, name: str) -> int:
    """The event id of the API name `name` in the served app's /config."""
    import httpx

    config = httpx.get(f"{base}/config", timeout=30).json()
    return next(d["id"] for d in config["dependencies"] if d.get("api_name") == name)


def join(base: str, name: str, data: list, session: str, *, event_data=None, address: str | None = None):
    """`POST /gradio_api/queue/join` for the event named `name` (private ones too): the response."""
    body = {"data": data, "fn_index": fn_index(base, name), "session_hash": session, "event_data": event_data, "trigger_id": None}
    with _http(address) as http:
        return http.post(f"{base}/gradio_api/queue/join", json=body, timeout=30)


def results(base: str, session: str, count: int, *, timeout: float = 300, address: str | None = None) -> list[dict]:
    """The next `count` completed events of `session` (each {"success", "output", ...})."""
    import json

    done = []
    with _http(address) as http, http.stream("GET", f"{base}/gradio_api/queue/data", params={"session_hash": session},
                                              timeout=timeout) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data:"):
                continue
            msg = json.loads(line[5:])
            if msg.get("msg") == "process_completed":
                done.append(msg)
                if len(done) == count:
                    return done
            if msg.get("msg") == "close_stream":
                break
    raise AssertionError(f"{len(done)} of {count} results arrived")


def run(base: str, name: str, data: list, *, session: str | None = None, event_data=None) -> tuple[bool, object]:
    """One event through the queue (`join`, then its result): (success, outputs or the error message)."""
    import uuid

    session = session or uuid.uuid4().hex
    r = join(base, name, data, session, event_data=event_data)
    assert r.status_code == 200, r.text
    (msg,) = results(base, session, 1)
    out = msg.get("output", {})
    return bool(msg.get("success")), out.get("data") if msg.get("success") else out.get("error")
