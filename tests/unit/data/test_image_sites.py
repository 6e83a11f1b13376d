"""Tests for the federated site folders of the SSL-FL image data sets (fedssl.data.image_sites) and the CLI."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from fedssl.cli import main
from fedssl.data.image_sites import balance_retina, format_partition_table, write_site_folders
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import ImageDataError, class_histogram, load_image_records


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for ds, n in (("retina", 150), ("derm", 150), ("covidfl", 90), ("derm_mel", 40)):
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


def test_covidfl_release_clients_and_pooled_test(src, tmp_path):
    """SSL-FL's 12_clients/split_real: RSNA in rsna-0..rsna-4 (3 sources here: 7 clients), sites in client-name
    order; the test set is the release's, pooled over the real sites (section IV-A)."""
    out = tmp_path / "c"
    part = write_site_folders(src["covidfl"], "covidfl", out, seed=0)
    names = ["bimcv", "gz", "rsna-0", "rsna-1", "rsna-2", "rsna-3", "rsna-4"]
    assert part["site_map"] == {f"site-{k}": n for k, n in enumerate(names, start=1)}
    assert part["release_split"] == "split_real" and part["n_sites"] == 7
    seen: list[str] = []
    for site, name in part["site_map"].items():
        recs = load_image_records(out / site, "covidfl", site=site)
        listed = (src["covidfl"] / "7_clients" / "split_real" / f"{name}.csv").read_text().split()
        assert sorted(os.path.basename(r.path) for r in recs) == sorted(listed)
        assert part["sites"][site]["n_images"] == len(recs)
        seen += _real(r.path for r in recs)
    sizes = [part["sites"][f"site-{k}"]["n_images"] for k in range(3, 8)]
    assert max(sizes) - min(sizes) <= 1  # RSNA's training images in 5 near-equal random parts
    test = load_image_records(out / "test", "covidfl", site="test")
    assert {os.path.basename(r.path).split("_")[0] for r in test} == {"bimcv", "gz", "rsna"}
    assert not set(seen) & set(_real(r.path for r in test)) and len(seen) == len(set(seen))
    with pytest.raises(ValueError, match="split_real"):
        write_site_folders(src["covidfl"], "covidfl", tmp_path / "c5", n_sites=5, seed=0)
    anew = write_site_folders(src["covidfl"], "covidfl", tmp_path / "c3", n_sites=3, seed=0, release_split="",
                              split="iid")
    assert anew["n_sites"] == 3 and "site_map" not in anew


def test_iid_split_near_equal_shards_same_manifest(src, tmp_path):
    """FedMAE-KS (section V-B): the training set randomly cut into 10 partitions; sizes differ by at most 1 and
    each site's class mix follows the global one (no label skew), unlike Dirichlet alpha 0.5."""
    part = write_site_folders(src["derm"], "derm", tmp_path / "iid", n_sites=10, split="iid", seed=0)
    assert part["split"] == "iid" and "alpha" not in part and part["n_sites"] == 10
    sizes = [v["n_images"] for v in part["sites"].values()]
    assert part["test"]["n_images"] == 29  # 150 images, per-class rounding of the 20 % hold-out
    assert sizes == [13] + [12] * 9  # 121 training images cut by np.array_split: the first shard gets one more
    for k in range(1, 11):
        recs = load_image_records(tmp_path / "iid" / f"site-{k}", "derm", site=f"site-{k}")
        assert class_histogram(recs, 8) == list(part["sites"][f"site-{k}"]["class_counts"].values())
    # the same 120 images at every seed, but different shards
    other = write_site_folders(src["derm"], "derm", tmp_path / "iid2", n_sites=10, split="iid", seed=1)
    assert other["test"] != part["test"] or other["sites"] != part["sites"]
    with pytest.raises(ValueError, match="split='lda'"):
        write_site_folders(src["derm"], "derm", tmp_path / "x", split="lda")


def test_derm_mel_release_dirichlet_sites(src, tmp_path):
    """SSL-FL's Derm: the release's test set (25 %), the training images split by Dirichlet over the sites."""
    part = write_site_folders(src["derm_mel"], "derm_mel", tmp_path / "m", n_sites=2, alpha=100.0, seed=0,
                              min_per_site=5)
    assert part["classes"] == ["benign", "melanoma"] and part["test"]["n_images"] == 10
    assert sum(v["n_images"] for v in part["sites"].values()) == 30
    assert part["test"]["class_counts"] == {"benign": 5, "melanoma": 5}


def test_impossible_min_per_site(src, tmp_path):
    with pytest.raises(ValueError, match="min_per_site=100"):
        write_site_folders(src["derm"], "derm", tmp_path / "x", n_sites=5, min_per_site=100)


def test_cli_synth_and_partition(tmp_path, capsys):
    assert main(["sslfl", "synth", "derm", str(tmp_path / "d"), "--images", "40", "--size", "16", "--seed", "3"]) == 0
    assert "wrote 40 synthetic derm images" in capsys.readouterr().out
    assert main(["sslfl", "partition", "derm", str(tmp_path / "d"), str(tmp_path / "p"), "--sites", "3", "--alpha",
                 "1.0", "--min-per-site", "3"]) == 0
    out = capsys.readouterr().out
    part = json.loads((tmp_path / "p" / "partition.json").read_text())
    assert format_partition_table(part) in out
    assert out.count("site-") == 3 and "NV" in out and "test" in out
    assert main(["sslfl", "partition", "derm", str(tmp_path / "d"), str(tmp_path / "q"), "--min-per-site", "50"]) == 2
    assert "min_per_site=50" in capsys.readouterr().err


def test_cli_partition_takes_the_job_defaults(tmp_path, capsys):
    """`--job fedmae_derm` gives IID over 10 sites (FedMAE-KS, the job's meta.json); a flag still wins."""
    assert main(["sslfl", "synth", "derm", str(tmp_path / "d"), "--images", "60", "--size", "16"]) == 0
    assert main(["sslfl", "partition", "derm", str(tmp_path / "d"), str(tmp_path / "p"), "--job", "fedmae_derm"]) == 0
    part = json.loads((tmp_path / "p" / "partition.json").read_text())
    assert (part["split"], part["n_sites"], part["test_fraction"]) == ("iid", 10, 0.2)
    assert "IID shards" in capsys.readouterr().out
    assert main(["sslfl", "partition", "derm", str(tmp_path / "d"), str(tmp_path / "q"), "--job", "fedmae_derm",
                 "--split", "dirichlet", "--sites", "3", "--min-per-site", "3"]) == 0
    part = json.loads((tmp_path / "q" / "partition.json").read_text())
    assert (part["split"], part["n_sites"], part["alpha"]) == ("dirichlet", 3, 0.5)
    assert main(["sslfl", "partition", "retina", str(tmp_path / "d"), str(tmp_path / "r"), "--job", "fedmae_derm"]) == 2
    assert "partitions derm data, not retina" in capsys.readouterr().err


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


def test_balance_retina_keeps_as_many_healthy_as_diseased_rows(tmp_path):
    rows = [("a", 0), ("b", 0), ("c", 0), ("d", 2), ("e", 4)]
    with open(tmp_path / "trainLabels.csv", "w", newline="") as f:
        csv.writer(f).writerows([("image", "level"), *rows])
    assert balance_retina(str(tmp_path), seed=0) == {"no_dr": 2, "dr": 2, "dropped": 1}
    with open(tmp_path / "trainLabels.csv", newline="") as f:
        kept = list(csv.DictReader(f))
    assert sum(int(r["level"]) == 0 for r in kept) == 2 and {r["image"] for r in kept} >= {"d", "e"}
