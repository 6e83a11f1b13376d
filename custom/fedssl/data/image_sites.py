"""Federated site folders for the SSL-FL image data sets (held-out test set + Dirichlet or real-site split).

:func:`write_site_folders` turns a full data set in its real layout (as written by the public release
or by :func:`fedssl.data.image_synthetic.write_synthetic_images`) into::

    out/test/            held-out test set, same layout (stratified, ``test_fraction`` of every class)
    out/site-1/ ...      one folder per FLARE site, same layout (CSV subset + symlinked images)
    out/partition.json   dataset, alpha, seed, per-site per-class counts, real-site mapping (COVID-FL)

* retina / derm: the test set is drawn first (stratified, seeded by ``seed`` only, so Split-1/2/3 made
  with the same seed share it), then the rest is split over ``n_sites`` sites by
  :func:`fedssl.core.dirichlet.dirichlet_split` (SSL-FL's splitter; ``min_per_site`` images at least).
  CSV rows are copied verbatim (retina keeps its 0-4 level, derm its one-hot row).
* covidfl: every real site holds out ``test_fraction`` of each of its classes ("each data site has the
  same proportion of train and test sets"); the test images of all real sites are pooled in
  ``out/test/<class>/<real_site>__<image>``; the training images of real site j go to ``site-k``
  (mapping in partition.json). With ``n_sites`` above the number of real sites, the largest real sites
  are cut into disjoint random sub-sites (:func:`fedssl.core.dirichlet.real_site_split`).

Images are symlinked (absolute targets); where the file system refuses symlinks they are copied.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path
from typing import Optional, Union

from fedssl.core.dirichlet import dirichlet_split, real_site_split
from fedssl.data.images import (
    COVIDFL_CLASSES,
    DATASETS,
    ImageDataError,
    ImageRecord,
    _read_csv,
    class_histogram,
    class_names,
    layout_paths,
    list_covidfl_sites,
    load_image_records,
    train_val_split,
)

__all__ = ["write_site_folders", "format_partition_table", "DEFAULT_MIN_PER_SITE"]

PathLike = Union[str, "os.PathLike[str]"]

#: SSL-FL's ``min_require_size``
DEFAULT_MIN_PER_SITE = 10


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


def write_site_folders(src_root: PathLike, dataset: str, out: PathLike, n_sites: Optional[int] = None,
                       alpha: float = 0.5, seed: int = 0, test_fraction: float = 0.2,
                       min_per_site: int = DEFAULT_MIN_PER_SITE) -> dict:
    """Write ``out/test``, ``out/site-1..site-N`` and ``out/partition.json`` (see the module docstring).

    Args:
        src_root: the full data set in its real layout (covidfl: ``<real_site>/<class>/...``).
        dataset: "retina", "derm" or "covidfl".
        out: output folder (created; re-running with identical arguments is a no-op).
        n_sites: retina/derm: number of Dirichlet sites (None = 5, SSL-FL); covidfl: None = one site per
            real site, more = largest real sites cut into sub-sites, fewer is an error.
        alpha: Dirichlet concentration (100 / 1.0 / 0.5 = Split-1 / 2 / 3); ignored for covidfl.
        seed: seeds the test split, the Dirichlet draw and any sub-site cut.
        test_fraction: held-out share of every class (SSL-FL: 0.2 for COVID-FL; the Retina/Derm releases
            hold out 3000/9000+3000 and ~2500/10000).
        min_per_site: every Dirichlet site gets at least this many training images (SSL-FL: 10).

    Returns:
        The partition.json content.
    """
    if dataset not in DATASETS:
        raise ValueError(f"dataset={dataset!r}: use one of {list(DATASETS)}")
    if not (isinstance(test_fraction, (int, float)) and 0.0 < test_fraction < 1.0):
        raise ValueError(f"test_fraction={test_fraction!r}: must be in (0, 1), e.g. 0.2")
    src = Path(src_root).resolve()
    out_p = Path(out)
    classes = class_names(dataset)
    params = {"dataset": dataset, "source": str(src), "seed": seed, "test_fraction": test_fraction}
    if dataset == "covidfl":
        params["n_sites_requested"] = n_sites
    else:
        params.update({"alpha": alpha, "n_sites": 5 if n_sites is None else n_sites, "min_per_site": min_per_site})
    existing = _check_out(out_p, params)
    if existing is not None:
        return existing

    modes: set[str] = set()
    site_records: list[tuple[str, list[ImageRecord]]] = []
    site_map: dict[str, str] = {}
    if dataset == "covidfl":
        train_all: list[ImageRecord] = []
        test: list[ImageRecord] = []
        for real in list_covidfl_sites(src, site="partition"):
            recs = load_image_records(src / real, dataset, site=real)
            tr, te = train_val_split(recs, test_fraction, seed)
            train_all += tr
            test += te
        parts = real_site_split([r.source for r in train_all], n_sites, seed=seed)
        for k, (name, idx) in enumerate(parts, start=1):
            site_records.append((f"site-{k}", [train_all[i] for i in idx]))
            site_map[f"site-{k}"] = name
        out_p.mkdir(parents=True, exist_ok=True)
        for site, recs in site_records:
            for r in recs:
                d = out_p / site / COVIDFL_CLASSES[r.label]
                d.mkdir(parents=True, exist_ok=True)
                modes.add(_link(r.path, str(d / os.path.basename(r.path))))
        for r in test:
            d = out_p / "test" / COVIDFL_CLASSES[r.label]
            d.mkdir(parents=True, exist_ok=True)
            modes.add(_link(r.path, str(d / f"{r.source}__{os.path.basename(r.path)}")))
    else:
        records = load_image_records(src, dataset, site="partition")
        csv_name, _, ext = layout_paths(dataset)
        header, rows = _read_csv(str(src / csv_name), dataset, "partition")
        by_image = {r[0].strip(): r for r in rows}
        train, test = train_val_split(records, test_fraction, seed)
        n = 5 if n_sites is None else n_sites
        groups = dirichlet_split([r.label for r in train], n, alpha, seed, min_per_site=min_per_site)
        site_records = [(f"site-{k}", [train[i] for i in g]) for k, g in enumerate(groups, start=1)]
        out_p.mkdir(parents=True, exist_ok=True)
        for site, recs in site_records + [("test", test)]:
            modes |= _write_csv_layout(dataset, out_p / site, recs, by_image, header)

    part = dict(params)
    part.update({
        "classes": classes,
        "n_sites": len(site_records),
        "files": "copy" if "copy" in modes else "symlink",
        "sites": {s: {"n_images": len(r), "class_counts": _counts(r, classes)} for s, r in site_records},
        "test": {"n_images": len(test), "class_counts": _counts(test, classes)},
    })
    if dataset == "covidfl":
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
