"""Tests for SSL-FL's release layout (fedssl.data.sslfl_release): label ids, client lists, errors naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedssl.data.images import ImageDataError, class_names
from fedssl.data.sslfl_release import read_client_lists, read_release, write_release


def _release(root: Path, labels: dict[str, str], train: list[str], test: list[str], clients=None) -> Path:
    for phase, names in (("train", train), ("test", test)):
        (root / phase).mkdir(parents=True, exist_ok=True)
        for n in names:
            (root / phase / n).write_bytes(b"x")
    write_release(root, "covidfl", labels, {"train": train, "test": test}, {"split_real": clients or {}})
    return root


@pytest.fixture
def rel(tmp_path: Path) -> Path:
    labels = {"a.png": "normal", "b.png": "pneumonia", "c.png": "covid", "d.png": "covid"}
    return _release(tmp_path / "r", labels, ["a.png", "b.png", "c.png"], ["d.png"],
                    {"rsna-0": ["a.png"], "rsna-1": ["b.png"], "bimcv": ["c.png"]})


def test_label_ids_map_to_sslfl_classes(rel):
    """SSL-FL's COVID-FL ids (view_data_split.ipynb): 0 normal, 1 pneumonia, 2 COVID-19."""
    assert (rel / "labels.csv").read_text().splitlines() == ["a.png,0.0", "b.png,1.0", "c.png,2.0", "d.png,2.0"]
    r = read_release(rel, "covidfl")
    names = class_names("covidfl")
    assert [(Path(x.path).name, names[x.label]) for x in r.train] == [("a.png", "normal"), ("b.png", "pneumonia"),
                                                                      ("c.png", "covid")]
    assert [Path(x.path).parent.name for x in r.test] == ["test"]
    clients = read_client_lists(rel, "split_real", r.train)
    assert [(n, [Path(x.path).name for x in recs]) for n, recs in clients] == [
        ("bimcv", ["c.png"]), ("rsna-0", ["a.png"]), ("rsna-1", ["b.png"])]


def test_errors_name_the_file(rel):
    (rel / "labels.csv").write_text("a.png,0\nb.png,1\nc.png,7\nd.png,2\n")
    bad_id = r"row 3 \(c.png\): label \['7'\] is not one of SSL-FL's covidfl ids \[0, 1, 2\]: .*labels.csv"
    with pytest.raises(ImageDataError, match=bad_id):
        read_release(rel, "covidfl")
    (rel / "labels.csv").write_text("image,label\na.png,0\nb.png,1\nc.png,2\n")  # a header is skipped
    with pytest.raises(ImageDataError, match=r"row 1: image 'd.png' has no row in labels.csv: .*test.csv"):
        read_release(rel, "covidfl")
    (rel / "labels.csv").write_text("a.png,0\nb.png,1\nc.png,2\nd.png,2\n")
    (rel / "test.csv").write_text("d.png\nc.png\n")
    (rel / "test" / "c.png").write_bytes(b"x")
    with pytest.raises(ImageDataError, match="1 image\\(s\\) in both train.csv and test.csv, e.g. 'c.png'"):
        read_release(rel, "covidfl")


def test_client_list_errors(rel):
    train = read_release(rel, "covidfl").train
    (rel / "3_clients" / "split_real" / "sirm.csv").write_text("a.png\n")
    with pytest.raises(ImageDataError, match="'a.png' is also listed by client rsna-0.*sirm.csv"):
        read_client_lists(rel, "split_real", train)
    (rel / "3_clients" / "split_real" / "sirm.csv").write_text("z.png\n")
    with pytest.raises(ImageDataError, match="'z.png' is not in train.csv.*sirm.csv"):
        read_client_lists(rel, "split_real", train)
    with pytest.raises(ImageDataError, match=r"0 folders <N>_clients/split_1 .*splits here: \['split_real'\]"):
        read_client_lists(rel, "split_1", train)
