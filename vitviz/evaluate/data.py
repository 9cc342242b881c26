"""The data of a run: the protocols and metrics, the files of DATA and their stamps, the dataset and its batches."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from pathlib import Path
import numpy as np
import torch
import torch.distributed as dist

from vitviz.faithfulness import CHEFER2021_FRACTIONS
from vitviz.images import MAX_BYTES, ImageError, load_image
from vitviz.preprocess import Preprocessing, crop, to_input


METRICS = ("distance", "pointing", "deletion", "insertion")  # the default set
EXTRA_METRICS = ("inside",)  # scored only when named in --metrics
CURVE_METRICS = ("deletion", "insertion", "positive", "negative")  # the metrics with a curve per image and its area
SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff"}
Z95 = 1.959963984540054  # the normal quantile of a two-sided 95 % interval
FORMAT = 3  # of run.json and the shard rows: rows keyed by the image's relative path, stamped with its bytes' sha256
EARLIER_FORMATS = {  # what a run.json of an earlier format holds that this one cannot resume
    1: "its rows are not keyed by file",
    2: "its files are known by their size and modification time, not by their bytes",
}
MAX_TEXT_CHARS = 1000  # of a phrase (--text, or a caption): the text towers read 77 tokens or fewer anyway
MAX_CAPTIONS_BYTES = 64 * 2**20  # of a --captions file


@dataclass(frozen=True)
class Protocol:
    """A published benchmark protocol, run by name (`--protocol`); its settings are fixed.

    Attributes:
        name: what `--protocol` takes.
        kind: "chefer2021" or "rise": which of `vitviz.faithfulness`'s protocols it runs.
        metrics: the metrics it scores, each an area per method and image.
        explains: the class each map explains: "predicted" (the top-1) or "label" (the image's
            class, from its folder).
        description: one line for --help and errors.
    """

    name: str
    kind: str
    metrics: tuple[str, ...]
    explains: str
    description: str

    def steps(self, image_size: int) -> int:
        """Steps of a curve (its points less one): 9 for Chefer et al.'s 10 %, ..., 90 %; S for RISE."""
        return len(CHEFER2021_FRACTIONS) - 1 if self.kind == "chefer2021" else image_size

    def fractions(self, image_size: int) -> np.ndarray:
        """The x of a curve's points: the share of pixels removed (inserted) at each."""
        if self.kind == "chefer2021":
            return np.asarray(CHEFER2021_FRACTIONS, dtype=np.float64)
        return np.arange(image_size + 1, dtype=np.float64) / image_size

    def preprocessing(self, pre: Preprocessing) -> Preprocessing:
        """The images as both authors' loaders make them: resized to S x S (`transforms.Resize((S, S))`,
        bilinear, no crop), normalised with the model's own mean and std."""
        return Preprocessing(pre.image_size, None, "squash", pre.mean, pre.std, interpolation="bilinear")


PROTOCOLS: dict[str, Protocol] = {
    p.name: p for p in (
        Protocol("chefer2021", "chefer2021", ("positive", "negative"), "predicted",
                 "Chefer et al. 2021's positive and negative perturbation, maps of the predicted class (their --vis-class top)"),
        Protocol("chefer2021-target", "chefer2021", ("positive", "negative"), "label",
                 "the same, maps of each image's dataset class (their --vis-class target)"),
        Protocol("rise", "rise", ("deletion", "insertion"), "predicted",
                 "RISE's deletion (to zeros) and insertion (from a blurred copy), S pixels a step, the predicted class"),
    )
}


class EvaluateError(ValueError):
    """A run vitviz.evaluate will not start, resume or merge, or one that scored nothing; the message
    says why and what to do.

    Attributes:
        status: the command's exit status: 2 for a mistake in the command or in its folders (as
            argparse's), 1 for a run that could score nothing.
    """

    def __init__(self, message: str, *, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


class EvaluateWarning(UserWarning):
    """A metric that cannot be computed for some or all images (e.g. the pointing game without masks)."""


def mask_preprocessing(pre: Preprocessing) -> Preprocessing:
    """How an object mask is cropped to lie on its image's crop: `pre`'s geometry, nearest neighbours."""
    return replace(pre, interpolation="nearest")


@dataclass(frozen=True)
class Item:
    """One image of DATA.

    Attributes:
        index: its place in the sorted list of DATA's images.
        path: the path to read (DATA joined with `file`).
        label: its class (the first folder below DATA), or None.
        mask: the path of its object mask, or None.
        file: its path relative to DATA, with "/" (what rows are keyed by).
        stamp: the sha256 of its bytes, and "|" and its mask's when it has one (`_stamp`): what a row
            was scored from; empty from `scan(..., stamps=False)`.
    """

    index: int
    path: str
    label: str | None
    mask: str | None
    file: str = ""
    stamp: str = ""


def _content(path: str) -> str:
    """The sha256 of the bytes of a file the image gate reads (its first `MAX_BYTES` + 1), read in
    chunks, its first 16 bytes in hex (the row's `sha256` when the file was scored as it is); "?"
    when the file cannot be read."""
    h = hashlib.sha256()
    left = MAX_BYTES + 1
    try:
        with open(path, "rb") as f:
            while left and (chunk := f.read(min(left, 2**20))):
                h.update(chunk)
                left -= len(chunk)
    except OSError:
        return "?"
    return h.hexdigest()[:32]


def _stamp(path: str, mask: str | None) -> str:
    """An image's stamp: its bytes' digest, and "|" and its mask's when it has one."""
    return _content(path) + ("" if mask is None else f"|{_content(mask)}")


def scan(root: str | Path, *, stamps: bool = True) -> list[Item]:
    """Every image under `root` (not under root/masks), sorted by path; the class is the first folder
    below `root` when there is one; the mask is root/masks/<the same relative path and stem>.*.

    Args:
        stamps: read and hash every image and mask for its stamp; False leaves the stamps empty
            (`evaluate` stamps them once its processes have started, each hashing a share).
    """
    root = Path(root)
    masks_root = root / "masks"
    masks = {}
    if masks_root.is_dir():
        for p in sorted(masks_root.rglob("*")):
            if p.suffix.lower() in SUFFIXES and p.is_file():
                masks.setdefault(p.relative_to(masks_root).with_suffix("").as_posix(), p)
    paths = sorted(p for p in root.rglob("*") if p.suffix.lower() in SUFFIXES and masks_root not in p.parents and p.is_file())
    items = []
    for i, p in enumerate(paths):
        rel = p.relative_to(root)
        label = rel.parts[0] if len(rel.parts) > 1 else None
        mask = masks.get(rel.with_suffix("").as_posix())
        mask = None if mask is None else str(mask)
        items.append(Item(i, str(p), label, mask, rel.as_posix(), _stamp(str(p), mask) if stamps else ""))
    return items


def _stamped(items: list[Item], *, rank: int, world: int) -> list[Item]:
    """`items` with their stamps: each rank hashes every world-th image (and its mask), then every
    rank gets every stamp, so that a run reads each file once to stamp it, on any number of processes."""
    mine = {item.index: _stamp(item.path, item.mask) for item in items[rank::world]}
    shares: list = [mine]
    if dist.is_initialized():
        shares = [None] * world
        dist.all_gather_object(shares, mine)
    stamps = {i: stamp for share in shares for i, stamp in share.items()}
    return [replace(item, stamp=stamps[item.index]) for item in items]


def _read(path: str) -> bytes:
    """The file's bytes, no more than the image gate reads (it refuses what is longer)."""
    try:
        with open(path, "rb") as f:
            return f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ImageError(f"the file cannot be read ({exc.strerror or exc})") from None


def _digest(data: bytes) -> str:
    """The sha256 of `data`, its first 16 bytes in hex."""
    return hashlib.sha256(data).hexdigest()[:32]


def _seed(file: str) -> int:
    """The random order's seed of an image: from its relative path, so that it does not depend on
    which other images DATA holds."""
    return int.from_bytes(hashlib.sha256(file.encode()).digest()[:8], "big") >> 1


def _to_input_as_their_scripts(cropped, pre: Preprocessing) -> torch.Tensor:
    """The S x S crop -> [3, S, S] as Chefer et al.'s and RISE's scripts make it: torchvision's
    `ToTensor()` (x / 255) then `Normalize(mean, std)` ((x - mean) / std). `to_input` gives the same
    values but for the last bit of some (it multiplies by 1 / 255), which can reorder tied pixels."""
    from torchvision.transforms import functional as F1

    return F1.normalize(F1.to_tensor(cropped.convert("RGB")), mean=list(pre.mean), std=list(pre.std))


class EvalDataset(torch.utils.data.Dataset):
    """Items read, checked and preprocessed (in DataLoader workers): the model's input, the object
    mask cropped the same way (nearest), the digests of the bytes read, and what was wrong with the
    image (its row counts nowhere) or with its mask (its row counts everywhere but the pointing game)."""

    def __init__(self, items: list[Item], pre: Preprocessing, *, as_their_scripts: bool = False) -> None:
        """`as_their_scripts`: the crop made a tensor as the published protocols' scripts make it
        (`_to_input_as_their_scripts`), to the bit."""
        self.items = items
        self.pre = pre
        self.to_input = _to_input_as_their_scripts if as_their_scripts else to_input
        self.mask_pre = mask_preprocessing(pre)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        item = self.items[i]
        out = _sample(item.index, self.pre.image_size)
        try:
            data = _read(item.path)
            out["sha256"] = _digest(data)
            image = load_image(data)
            out["x"] = self.to_input(crop(image, self.pre), self.pre)
        except ImageError as exc:
            out.update(ok=False, error=str(exc))
            return out
        if item.mask:
            try:
                data = _read(item.mask)
                out["mask_sha256"] = _digest(data)
                mask = load_image(data)
                if mask.size != image.size:
                    raise ImageError(f"it is {mask.width}x{mask.height} px and its image {image.width}x{image.height} px; "
                                     f"a mask has the size of its image")
                out["mask"] = torch.from_numpy(np.asarray(crop(mask.convert("L"), self.mask_pre)) > 127)
                out["has_mask"] = True
            except ImageError as exc:
                out["mask_error"] = f"mask {item.mask}: {exc}"
        return out


class _Batches(torch.utils.data.Sampler):
    """This rank's global batches (k = rank, rank + world, ...), less the images already done; with
    `max_images`, no more batches once that many images are dealt to this rank (a run in parts)."""

    def __init__(self, n: int, batch_size: int, rank: int, world: int, done: set[int], max_images: int | None = None) -> None:
        self.batches = []
        total = 0
        for k in range(rank, math.ceil(n / batch_size), world):
            if max_images is not None and total >= max_images:
                break
            batch = [i for i in range(k * batch_size, min((k + 1) * batch_size, n)) if i not in done]
            if batch:
                self.batches.append(batch)
                total += len(batch)

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _sample(index: int, size: int) -> dict:
    """One image's entry of a batch (`EvalDataset`) before its files are read: a blank input, no mask."""
    return {"index": index, "x": torch.zeros(3, size, size), "mask": torch.zeros(size, size, dtype=torch.bool),
            "has_mask": False, "ok": True, "error": "", "mask_error": "", "sha256": None, "mask_sha256": None}


def _batch_in_memory(x: torch.Tensor, masks: torch.Tensor | None = None) -> dict:
    """The batch `_score` takes, for images already preprocessed: inputs `x` [B, 3, S, S] and object
    masks bool [B, S, S] (or none), as items 0 to B - 1 whose files were read without a digest."""
    samples = [_sample(i, x.shape[-1]) | {"x": x[i]} for i in range(len(x))]
    for sample, mask in zip(samples, masks if masks is not None else ()):
        sample.update(mask=mask, has_mask=True)
    return _collate(samples)


def _collate(samples: list[dict]) -> dict:
    return {
        "index": torch.tensor([s["index"] for s in samples]),
        "x": torch.stack([s["x"] for s in samples]),
        "mask": torch.stack([s["mask"] for s in samples]),
        "has_mask": torch.tensor([s["has_mask"] for s in samples]),
        **{key: [s[key] for s in samples] for key in ("ok", "error", "mask_error", "sha256", "mask_sha256")},
    }


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("s") else "s")
