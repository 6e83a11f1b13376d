"""SSL-FL's released data layout (COVID-FL and Derm): reader and writer.

SSL-FL (Yan et al., IEEE TMI 2023) publishes COVID-FL and its "Derm" set (melanoma vs benign, ISIC 2017/2019/
2020) only in its own "unified" layout (``data/README.md`` and ``code/util/data_utils.py`` of rui-yan/SSL-FL)::

    root/labels.csv                         <image>,<label>   one row per image, SSL-FL's label ids
    root/train.csv, root/test.csv           one image per line (the first comma field is the image)
    root/train/<image>, root/test/<image>
    root/<N>_clients/<split>/<client>.csv   one training image per line; COVID-FL: 12_clients/split_real/
                                            bimcv, cohen, eurorad, gz, ml-workgroup, ricord_c, rsna-0..rsna-4, sirm

SSL-FL's label ids: COVID-FL 0 normal, 1 pneumonia, 2 COVID-19 (``data/view_data_split.ipynb``); Derm
0 benign, 1 melanoma (the repository has no Derm split viewer; melanoma is the positive class of the task).
They are mapped to this package's class order (:func:`fedssl.data.images.class_names`). The train/test split
is the release's (COVID-FL: 80/20 within every real site, section IV-A; Derm: ~7,500 / ~2,500).

Every problem raises :class:`fedssl.data.images.ImageDataError` naming the site and the file.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence, Union

from fedssl.data.images import ImageDataError, ImageRecord, class_names

__all__ = ["RELEASE_DATASETS", "RELEASE_LABELS", "Release", "read_release", "read_client_lists", "write_release"]

PathLike = Union[str, "os.PathLike[str]"]

#: SSL-FL's label id -> this package's class name, per data set published in the release layout
RELEASE_LABELS: dict[str, dict[int, str]] = {
    "covidfl": {0: "normal", 1: "pneumonia", 2: "covid"},
    "derm_mel": {0: "benign", 1: "melanoma"},
}
RELEASE_DATASETS = tuple(RELEASE_LABELS)
PHASES = ("train", "test")


@dataclass(frozen=True)
class Release:
    """The release's training and test records (paths under ``root/train`` and ``root/test``)."""

    train: list
    test: list


def _err(site: str, path: PathLike, problem: str, fix: str) -> ImageDataError:
    return ImageDataError(f"[site {site or '?'}] {problem}: {os.fspath(path)}. Fix: {fix}")


def _check(dataset: str) -> None:
    if dataset not in RELEASE_LABELS:
        raise ValueError(f"dataset={dataset!r}: SSL-FL's release layout holds {list(RELEASE_DATASETS)}")


def _rows(path: Path, site: str, what: str) -> list[list[str]]:
    if not path.is_file():
        raise _err(site, path, f"{what} is missing", "point at the root of SSL-FL's released data set (labels.csv, "
                   "train.csv, test.csv, train/, test/), or write a synthetic one with `fedssl sslfl synth`")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            return [[c.strip() for c in r] for r in csv.reader(f) if any(c.strip() for c in r)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise _err(site, path, f"cannot read {what} ({exc.__class__.__name__}: {exc})", "check the file") from exc


def _labels(root: Path, dataset: str, site: str) -> dict[str, int]:
    """``labels.csv`` -> {image: label in this package's class order}; a non-numeric first row is a header."""
    path = root / "labels.csv"
    names, mapping = class_names(dataset), RELEASE_LABELS[dataset]
    out: dict[str, int] = {}
    for i, r in enumerate(_rows(path, site, "labels.csv"), start=1):
        try:
            value = float(r[1]) if len(r) >= 2 else float("nan")
        except ValueError:
            if i == 1:
                continue
            value = float("nan")
        if value not in mapping:
            raise _err(site, path, f"row {i} ({r[0] if r else ''}): label {r[1:2]} is not one of SSL-FL's "
                       f"{dataset} ids {sorted(mapping)}", f"write <image>,<id> with ids {mapping}")
        if r[0] in out:
            raise _err(site, path, f"row {i}: image {r[0]!r} listed twice", "keep one row per image")
        out[r[0]] = names.index(mapping[int(value)])
    return out


def _phase(root: Path, phase: str, labels: Mapping[str, int], site: str) -> list[ImageRecord]:
    path = root / f"{phase}.csv"
    out, seen = [], set()
    for i, r in enumerate(_rows(path, site, f"{phase}.csv"), start=1):
        image = r[0]
        if not image or "/" in image or os.sep in image or image in (".", ".."):
            raise _err(site, path, f"row {i}: bad image name {image!r}", "use the bare file name of the image")
        if image in seen:
            continue
        seen.add(image)
        if image not in labels:
            raise _err(site, path, f"row {i}: image {image!r} has no row in labels.csv", "add its label or drop it")
        p = root / phase / image
        if not p.is_file():
            raise _err(site, p, f"image listed in {phase}.csv row {i} is missing",
                       f"put it in {phase}/ or drop the row")
        out.append(ImageRecord(str(p), labels[image], ""))
    if not out:
        raise _err(site, path, f"no {phase} image listed", f"list the {phase} images, one per line")
    return out


def read_release(root: PathLike, dataset: str, site: str = "partition") -> Release:
    """Training and test records of SSL-FL's released ``dataset`` ("covidfl" or "derm_mel") under ``root``.

    Raises:
        ImageDataError: a missing or unreadable CSV, an image without a label, an unknown label id, a missing
            image file, or an image in both the training and the test list.
    """
    _check(dataset)
    r = Path(root).resolve()
    labels = _labels(r, dataset, site)
    train, test = (_phase(r, phase, labels, site) for phase in PHASES)
    both = {os.path.basename(x.path) for x in train} & {os.path.basename(x.path) for x in test}
    if both:
        raise _err(site, r / "test.csv", f"{len(both)} image(s) in both train.csv and test.csv, e.g. "
                   f"{sorted(both)[0]!r}", "a test image must not be trained on; fix the lists")
    return Release(train=train, test=test)


def read_client_lists(root: PathLike, split: str, train: Sequence[ImageRecord], site: str = "partition"
                      ) -> list[tuple[str, list[ImageRecord]]]:
    """The release's clients of ``split`` (``root/<N>_clients/<split>/<client>.csv``), in client-name order.

    Each client's records are taken from ``train`` (by image name); an image listed by two clients, or not in
    the training list, is an error naming the file.
    """
    r = Path(root).resolve()
    folders = sorted(p for p in r.glob(f"*_clients/{split}") if p.is_dir())
    if len(folders) != 1:
        found = sorted(p.name for p in r.glob("*_clients/*") if p.is_dir())
        raise _err(site, r, f"{len(folders)} folders <N>_clients/{split} (expected one; splits here: {found})",
                   "name a split the release has (COVID-FL: split_real)")
    by_name = {os.path.basename(x.path): x for x in train}
    owner: dict[str, str] = {}
    out = []
    for path in sorted(folders[0].glob("*.csv")):
        recs = []
        for i, row in enumerate(_rows(path, site, f"client list {path.name}"), start=1):
            image = row[0]
            if image not in by_name:
                raise _err(site, path, f"row {i}: image {image!r} is not in train.csv", "fix the client list")
            if owner.get(image, path.stem) != path.stem:
                raise _err(site, path, f"row {i}: image {image!r} is also listed by client {owner[image]}",
                           "clients must not overlap")
            if image not in owner:
                owner[image] = path.stem
                recs.append(by_name[image])
        out.append((path.stem, sorted(recs, key=lambda x: x.path)))
    if not out:
        raise _err(site, folders[0], "no client list (.csv) in the split folder", "restore the release's split files")
    return out


def write_release(root: PathLike, dataset: str, labels: Mapping[str, str], phases: Mapping[str, Sequence[str]],
                  clients: Mapping[str, Mapping[str, Sequence[str]]]) -> None:
    """Write the release's CSV files under ``root`` (the images themselves go to ``root/train``, ``root/test``).

    Args:
        labels: image -> this package's class name.
        phases: ``{"train": [...], "test": [...]}`` image names.
        clients: ``{split: {client: [training images]}}``, written to ``<N>_clients/<split>/<client>.csv``.
    """
    _check(dataset)
    r = Path(root)
    ids = {name: i for i, name in RELEASE_LABELS[dataset].items()}
    with open(r / "labels.csv", "w", newline="") as f:
        csv.writer(f).writerows([image, f"{float(ids[c])}"] for image, c in sorted(labels.items()))
    for phase in PHASES:
        (r / f"{phase}.csv").write_text("".join(f"{image}\n" for image in phases[phase]))
    (r / "central").mkdir(exist_ok=True)
    (r / "central" / "train.csv").write_text("".join(f"{image}\n" for image in phases["train"]))
    for split, lists in clients.items():
        folder = r / f"{len(lists)}_clients" / split
        folder.mkdir(parents=True, exist_ok=True)
        for client, images in lists.items():
            (folder / f"{client}.csv").write_text("".join(f"{image}\n" for image in images))
