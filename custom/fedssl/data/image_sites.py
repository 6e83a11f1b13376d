"""Federated site folders for the SSL-FL / FedMAE-KS image data sets (held-out test set + site split).

:func:`write_site_folders` turns a full data set in its real layout (as written by the public release
or by :func:`fedssl.data.image_synthetic.write_synthetic_images`) into::

    out/test/            held-out test set, in the site-folder layout
    out/site-1/ ...      one folder per FLARE site (retina/derm: CSV subset + images; covidfl/derm_mel: <class>/)
    out/partition.json   dataset, split and its arguments, per-site per-class counts, client names (release)

* retina / derm: the test set is drawn first (stratified, seeded by ``seed`` only, so Split-1/2/3 made
  with the same seed share it), then the rest is split over ``n_sites`` sites by ``split``:
  "dirichlet" = :func:`fedssl.core.dirichlet.dirichlet_split` (SSL-FL's splitter; ``min_per_site`` images
  at least) or "iid" = :func:`fedssl.core.dirichlet.iid_split` (FedMAE-KS: "We randomly split the training
  set into 10 partitions", section V-B). CSV rows are copied verbatim (retina keeps its 0-4 level, derm its
  one-hot row).
* covidfl / derm_mel: SSL-FL's release (:mod:`fedssl.data.sslfl_release`) holds the test set (COVID-FL: 20 %
  of every real site, pooled) and, for COVID-FL, the client lists ``12_clients/split_real`` (8 real sites,
  RSNA cut into 5: 12 clients), which become ``site-1 .. site-12`` in client-name order (``site_map`` in
  partition.json). Derm's training images are split by ``split`` over ``n_sites`` (SSL-FL: Dirichlet, 5).

Images are symlinked (absolute targets); where the file system refuses symlinks they are copied.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path
from typing import Optional, Union

import numpy as np

from fedssl.core.dirichlet import dirichlet_split, iid_split
from fedssl.data.images import (
    SSLFL_DATASETS,
    ImageDataError,
    ImageRecord,
    _read_csv,
    class_histogram,
    class_names,
    layout_paths,
    load_image_records,
    train_val_split,
)
from fedssl.data.sslfl_release import RELEASE_DATASETS, read_client_lists, read_release

__all__ = ["write_site_folders", "format_partition_table", "DEFAULT_MIN_PER_SITE", "DEFAULT_SITES", "SPLITS",
           "RELEASE_DEFAULT_SPLIT"]

PathLike = Union[str, "os.PathLike[str]"]

#: SSL-FL's ``min_require_size``
DEFAULT_MIN_PER_SITE = 10
#: SSL-FL's N = 5 simulated clients (section IV-B1)
DEFAULT_SITES = 5
#: site splitters: SSL-FL's Dirichlet label skew; FedMAE-KS's random IID shards (section V-B)
SPLITS = ("dirichlet", "iid")
#: the release's client lists used when none is named: COVID-FL's 12 real (sub-)sites; Derm has none
RELEASE_DEFAULT_SPLIT = {"covidfl": "split_real", "derm_mel": ""}


def _link(src: str, dst: str) -> str:
    try:
        os.symlink(src, dst)
        return "symlink"
    except (OSError, NotImplementedError):
        shutil.copy2(src, dst)
        return "copy"


def _counts(records: list[ImageRecord], classes: list[str]) -> dict[str, int]:
    return dict(zip(classes, class_histogram(records, len(classes))))


def _write_csv_layout(dataset: str, folder: Path, records: list[ImageRecord], rows: dict[str, list[str]],
                      header: list[str]) -> set[str]:
    csv_name, img_dir, ext = layout_paths(dataset)
    (folder / img_dir).mkdir(parents=True)
    modes = set()
    ordered = sorted(records, key=lambda r: r.path)
    with open(folder / csv_name, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        for r in ordered:
            image = os.path.basename(r.path)[: -len(ext)]
            w.writerow(rows[image])
            modes.add(_link(r.path, str(folder / img_dir / os.path.basename(r.path))))
    return modes


def _check_out(out: Path, params: dict) -> Optional[dict]:
    """None if ``out`` is free; the existing partition if it was made with the same parameters; else error."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise ImageDataError(f"[partition] output path exists and is not a folder: {out}. Fix: choose another out")
    if not any(out.iterdir()):
        return None
    pj = out / "partition.json"
    if pj.is_file():
        try:
            old = json.loads(pj.read_text())
        except (OSError, ValueError):
            old = {}
        if all(old.get(k) == v for k, v in params.items()):
            return old
    raise ImageDataError(f"[partition] output folder is not empty and was not made with these arguments: {out}. "
                         "Fix: remove it, re-run with the arguments in its partition.json, or choose another out")


def _split_train(labels: list[int], split: str, n: int, alpha: float, seed: int, min_per_site: int) -> list[list[int]]:
    """Index lists of ``n`` sites: SSL-FL's Dirichlet splitter or FedMAE-KS's IID random shards."""
    if split == "iid":
        return iid_split(len(labels), n, seed)
    return dirichlet_split(labels, n, alpha, seed, min_per_site=min_per_site)


def _params(src: Path, dataset: str, n_sites: Optional[int], alpha: float, seed: int, test_fraction: float,
            min_per_site: int, split: str, release_split: str) -> dict:
    """The arguments that define a partition (recorded in partition.json; a re-run must match them)."""
    params = {"dataset": dataset, "source": str(src), "seed": seed}
    if dataset in RELEASE_DATASETS:
        params["release_split"] = release_split
    else:
        params["test_fraction"] = test_fraction
    if not release_split:
        params.update({"split": split, "n_sites": DEFAULT_SITES if n_sites is None else n_sites})
        if split == "dirichlet":
            params.update({"alpha": alpha, "min_per_site": min_per_site})
    return params


def _write_class_folders(dataset: str, folder: Path, records: list[ImageRecord]) -> set[str]:
    classes = class_names(dataset)
    modes = set()
    for r in records:
        d = folder / classes[r.label]
        d.mkdir(parents=True, exist_ok=True)
        modes.add(_link(r.path, str(d / os.path.basename(r.path))))
    return modes


def write_site_folders(src_root: PathLike, dataset: str, out: PathLike, n_sites: Optional[int] = None,
                       alpha: float = 0.5, seed: int = 0, test_fraction: float = 0.2,
                       min_per_site: int = DEFAULT_MIN_PER_SITE, split: str = "dirichlet",
                       release_split: Optional[str] = None) -> dict:
    """Write ``out/test``, ``out/site-1..site-N`` and ``out/partition.json`` (see the module docstring).

    Args:
        src_root: the full data set in its real layout (covidfl / derm_mel: SSL-FL's release layout).
        dataset: "retina", "derm", "covidfl" or "derm_mel".
        out: output folder (created; re-running with identical arguments is a no-op).
        n_sites: number of split sites (None = 5, SSL-FL); FedMAE-KS uses 10 (IID). Not used with a release split.
        alpha: Dirichlet concentration (100 / 1.0 / 0.5 = Split-1 / 2 / 3).
        seed: seeds the test split and the site split.
        test_fraction: retina/derm: held-out share of every class (the release of covidfl / derm_mel holds its
            own test set: 80/20 per COVID-FL site, ~7,500 / ~2,500 for Derm).
        min_per_site: every Dirichlet site gets at least this many training images (SSL-FL: 10).
        split: "dirichlet" (SSL-FL) or "iid" (FedMAE-KS: random near-equal shards).
        release_split: covidfl / derm_mel: the release's client lists to use (``<N>_clients/<name>/``); None =
            the data set's default ("split_real" for covidfl: 12 clients; none for derm_mel), "" = split the
            release's training images with ``split`` over ``n_sites`` sites.

    Returns:
        The partition.json content.
    """
    if dataset not in SSLFL_DATASETS:
        raise ValueError(f"dataset={dataset!r}: use one of {list(SSLFL_DATASETS)}")
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use one of {list(SPLITS)} (dirichlet: SSL-FL; iid: FedMAE-KS)")
    if not (isinstance(test_fraction, (int, float)) and 0.0 < test_fraction < 1.0):
        raise ValueError(f"test_fraction={test_fraction!r}: must be in (0, 1), e.g. 0.2")
    if dataset in RELEASE_DATASETS:
        release_split = RELEASE_DEFAULT_SPLIT[dataset] if release_split is None else release_split
        if release_split and n_sites is not None:
            raise ValueError(f"n_sites={n_sites}: the sites of {dataset} come from the release's split "
                             f"{release_split!r}; leave n_sites out, or pass release_split='' to split anew")
    elif release_split:
        raise ValueError(f"release_split={release_split!r}: {dataset} has no SSL-FL release layout; leave it out")
    src = Path(src_root).resolve()
    out_p = Path(out)
    params = _params(src, dataset, n_sites, alpha, seed, test_fraction, min_per_site, split, release_split or "")
    existing = _check_out(out_p, params)
    if existing is not None:
        return existing

    n = DEFAULT_SITES if n_sites is None else n_sites
    modes: set[str] = set()
    site_map: dict[str, str] = {}
    if dataset in RELEASE_DATASETS:
        release = read_release(src, dataset)
        test = release.test
        if release_split:
            clients = read_client_lists(src, release_split, release.train)
            site_records = [(f"site-{k}", recs) for k, (_, recs) in enumerate(clients, start=1)]
            site_map = {f"site-{k}": name for k, (name, _) in enumerate(clients, start=1)}
        else:
            train = release.train
            groups = _split_train([r.label for r in train], split, n, alpha, seed, min_per_site)
            site_records = [(f"site-{k}", [train[i] for i in g]) for k, g in enumerate(groups, start=1)]
        out_p.mkdir(parents=True, exist_ok=True)
        for site, recs in site_records + [("test", test)]:
            modes |= _write_class_folders(dataset, out_p / site, recs)
    else:
        records = load_image_records(src, dataset, site="partition")
        csv_name, _, ext = layout_paths(dataset)
        header, rows = _read_csv(str(src / csv_name), dataset, "partition")
        by_image = {r[0].strip(): r for r in rows}
        train, test = train_val_split(records, test_fraction, seed)
        groups = _split_train([r.label for r in train], split, n, alpha, seed, min_per_site)
        site_records = [(f"site-{k}", [train[i] for i in g]) for k, g in enumerate(groups, start=1)]
        out_p.mkdir(parents=True, exist_ok=True)
        for site, recs in site_records + [("test", test)]:
            modes |= _write_csv_layout(dataset, out_p / site, recs, by_image, header)

    classes = class_names(dataset)
    part = dict(params)
    part.update({
        "classes": classes,
        "n_sites": len(site_records),
        "files": "copy" if "copy" in modes else "symlink",
        "sites": {s: {"n_images": len(r), "class_counts": _counts(r, classes)} for s, r in site_records},
        "test": {"n_images": len(test), "class_counts": _counts(test, classes)},
    })
    if site_map:
        part["site_map"] = site_map
    (out_p / "partition.json").write_text(json.dumps(part, indent=2) + "\n")
    return part


def format_partition_table(part: dict) -> str:
    """Per-site class-count table of a partition.json dict (one row per site, then the test set)."""
    classes = part["classes"]
    w = max(6, *(len(c) for c in classes))
    names = list(part["sites"]) + ["test"]
    nw = max(len(n) for n in names)
    extra = part.get("site_map", {})
    ew = max([len(v) for v in extra.values()] + [0])
    lines = [f"{'site':<{nw}} " + (f"{'source':<{ew}} " if extra else "") + " ".join(f"{c:>{w}}" for c in classes)
             + f" {'total':>{w}}"]
    for n in names:
        d = part["test"] if n == "test" else part["sites"][n]
        row = f"{n:<{nw}} " + (f"{extra.get(n, ''):<{ew}} " if extra else "")
        row += " ".join(f"{d['class_counts'][c]:>{w}}" for c in classes) + f" {d['n_images']:>{w}}"
        lines.append(row)
    return "\n".join(lines)


def balance_retina(root: PathLike, seed: int = 0) -> dict:
    """Keep a class-balanced random subset of a retina data set's ``trainLabels.csv`` rows (SSL-FL: "randomly
    selecting 9,000 balanced images" of Kaggle DR); images left out stay on disk, unlisted. Returns the counts."""
    path = os.path.join(root, "trainLabels.csv")
    with open(path, newline="") as f:
        header, *rows = list(csv.reader(f))
    by_label = {0: [r for r in rows if int(r[1]) == 0], 1: [r for r in rows if int(r[1]) > 0]}
    n = min(len(v) for v in by_label.values())
    rng = np.random.default_rng(seed)
    keep = sorted((r for v in by_label.values() for r in (v[i] for i in rng.permutation(len(v))[:n])),
                  key=lambda r: r[0])
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([header, *keep])
    return {"no_dr": n, "dr": n, "dropped": len(rows) - 2 * n}
