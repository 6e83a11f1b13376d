"""Tests for the federated site folders of the SSL-FL image data sets (fedssl.data.image_sites) and the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fedssl.cli import main
from fedssl.data.image_sites import format_partition_table, write_site_folders
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import ImageDataError, class_histogram, list_covidfl_sites, load_image_records


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for ds, n in (("retina", 150), ("derm", 150), ("covidfl", 90)):
        root = tmp_path_factory.mktemp(f"{ds}_full")
        write_synthetic_images(root, ds, n, seed=2, image_size=16, n_sources=3 if ds == "covidfl" else 2)
        out[ds] = root
    return out


def _real(paths):
    return [os.path.realpath(p) for p in paths]


@pytest.mark.parametrize("ds", ["retina", "derm"])
def test_dirichlet_sites_load_back_disjoint_with_held_out_test(src, tmp_path, ds):
    out = tmp_path / "parts"
    part = write_site_folders(src[ds], ds, out, n_sites=4, alpha=0.5, seed=1, test_fraction=0.2, min_per_site=5)
    full = load_image_records(src[ds], ds)
    by_path = {r.path: r.label for r in full}
    seen: list[str] = []
    for k in range(1, 5):
        site = f"site-{k}"
        recs = load_image_records(out / site, ds, site=site)
        assert len(recs) >= 5
        assert all(Path(r.path).is_symlink() for r in recs)
        assert [by_path[p] for p in _real(r.path for r in recs)] == [r.label for r in recs]
        classes = part["classes"]
        assert part["sites"][site]["class_counts"] == dict(zip(classes, class_histogram(recs, len(classes))))
        assert part["sites"][site]["n_images"] == len(recs)
        seen += _real(r.path for r in recs)
    test = load_image_records(out / "test", ds, site="test")
    assert len(seen) == len(set(seen))  # no image in two sites
    assert not set(seen) & set(_real(r.path for r in test))  # test disjoint from every site
    assert sorted(seen + _real(r.path for r in test)) == sorted(by_path)  # nothing lost
    assert part["test"]["n_images"] == len(test) == pytest.approx(0.2 * len(full), abs=len(part["classes"]))
    on_disk = json.loads((out / "partition.json").read_text())
    assert on_disk == part
    assert on_disk["alpha"] == 0.5 and on_disk["seed"] == 1 and on_disk["dataset"] == ds
    # same arguments again: a no-op; other arguments into the same folder: refused
    assert write_site_folders(src[ds], ds, out, n_sites=4, alpha=0.5, seed=1, min_per_site=5) == part
    with pytest.raises(ImageDataError, match="not empty"):
        write_site_folders(src[ds], ds, out, n_sites=4, alpha=1.0, seed=1, min_per_site=5)


def test_test_set_shared_across_alphas_and_csv_rows_verbatim(src, tmp_path):
    a = write_site_folders(src["retina"], "retina", tmp_path / "a", alpha=100.0, seed=0, min_per_site=5)
    b = write_site_folders(src["retina"], "retina", tmp_path / "b", alpha=0.5, seed=0, min_per_site=5)
    ta = (tmp_path / "a" / "test" / "trainLabels.csv").read_text()
    assert ta == (tmp_path / "b" / "test" / "trainLabels.csv").read_text()
    assert a["test"] == b["test"] and a["n_sites"] == 5
    levels = dict(line.split(",") for line in (src["retina"] / "trainLabels.csv").read_text().split()[1:])
    for line in ta.split()[1:]:
        image, level = line.split(",")
        assert levels[image] == level  # the 0-4 level is kept, not the binary label


def test_covidfl_real_sites_and_pooled_test(src, tmp_path):
    out = tmp_path / "c"
    part = write_site_folders(src["covidfl"], "covidfl", out, seed=0, test_fraction=0.2)
    real = list_covidfl_sites(src["covidfl"])
    assert part["site_map"] == {f"site-{k}": s for k, s in enumerate(real, start=1)}
    seen: list[str] = []
    for site, name in part["site_map"].items():
        recs = load_image_records(out / site, "covidfl", site=site)
        assert {Path(os.path.realpath(r.path)).parent.parent.name for r in recs} == {name}
        assert part["sites"][site]["n_images"] == len(recs)
        seen += _real(r.path for r in recs)
    test = load_image_records(out / "test", "covidfl", site="test")
    assert {Path(r.path).name.split("__")[0] for r in test} == set(real)  # every real site holds some out
    assert not set(seen) & set(_real(r.path for r in test)) and len(seen) == len(set(seen))
    # more sites than real sites: the largest real site is cut into sub-sites
    more = write_site_folders(src["covidfl"], "covidfl", tmp_path / "c5", n_sites=5, seed=0)
    assert more["n_sites"] == 5 and sum(v.count(".") for v in more["site_map"].values()) >= 2
    with pytest.raises(ValueError, match="3 real sites"):
        write_site_folders(src["covidfl"], "covidfl", tmp_path / "c2", n_sites=2, seed=0)


def test_impossible_min_per_site(src, tmp_path):
    with pytest.raises(ValueError, match="min_per_site=100"):
        write_site_folders(src["derm"], "derm", tmp_path / "x", n_sites=5, min_per_site=100)


def test_cli_synth_and_partition(tmp_path, capsys):
    assert main(["sslfl", "synth", "derm", str(tmp_path / "d"), "--images", "40", "--size", "16", "--seed", "3"]) == 0
    assert "wrote 40 synthetic derm images" in capsys.readouterr().out
    assert main(["sslfl", "partition", "derm", str(tmp_path / "d"), str(tmp_path / "p"), "--sites", "3", "--alpha", "1.0",
                 "--min-per-site", "3"]) == 0
    out = capsys.readouterr().out
    part = json.loads((tmp_path / "p" / "partition.json").read_text())
    assert format_partition_table(part) in out
    assert out.count("site-") == 3 and "NV" in out and "test" in out
    assert main(["sslfl", "partition", "derm", str(tmp_path / "d"), str(tmp_path / "q"), "--min-per-site", "50"]) == 2
    assert "min_per_site=50" in capsys.readouterr().err


def test_copies_where_symlinks_fail(src, tmp_path, monkeypatch):
    def no_symlink(*a, **k):
        raise OSError("symlinks not supported")
    monkeypatch.setattr(os, "symlink", no_symlink)
    part = write_site_folders(src["derm"], "derm", tmp_path / "p", n_sites=3, seed=0, min_per_site=5)
    assert part["files"] == "copy"
    recs = load_image_records(tmp_path / "p" / "site-1", "derm", site="site-1")
    assert recs and not any(Path(r.path).is_symlink() for r in recs)
    full = {Path(r.path).name: r.label for r in load_image_records(src["derm"], "derm")}
    assert all(full[Path(r.path).name] == r.label for r in recs)
