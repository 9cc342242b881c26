import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest
import torch


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


def random_torchvision(arch: str, **kwargs) -> torch.nn.Module:
    """A randomly initialised torchvision ViT with a non-zero head (torchvision zero-inits it)."""
    import torchvision

    model = getattr(torchvision.models, arch)(**kwargs).eval()
    torch.nn.init.normal_(model.heads.head.weight, std=0.02)
    torch.nn.init.normal_(model.heads.head.bias, std=0.02)
    return model
