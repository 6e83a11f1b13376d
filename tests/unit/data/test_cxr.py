"""CXR loaders (NIH both CSV variants, CheXpert, MIMIC-CXR-JPG), patient split, dataset and synthetic writers."""

import csv
import gzip
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from fedssl.data.cxr import (
    ALL_CLASSES,
    CHEXPERT_CLASSES,
    NIH_CLASSES,
    SHARED_CLASSES,
    CXRDataError,
    CXRDataset,
    CXRRecord,
    _normalise_nih_header,
    batches,
    dataset_classes,
    load_chexpert,
    load_cxr_site,
    load_mimic_cxr,
    load_nih,
    n_batches,
    patient_split,
)
from fedssl.data.cxr_synthetic import write_synthetic_chexpert, write_synthetic_mimic_cxr, write_synthetic_nih


def _png(path, size=(24, 20), value=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full(size[::-1], value, np.uint8)).save(path)


def test_class_sets_paper_setting():
    assert len(NIH_CLASSES) == 14 and len(CHEXPERT_CLASSES) == 13 and len(SHARED_CLASSES) == 7
    assert len(ALL_CLASSES) == 20 and len(set(ALL_CLASSES)) == 20
    assert "Pleural Effusion" in SHARED_CLASSES and "Pleural Thickening" in NIH_CLASSES
    assert "Effusion" not in ALL_CLASSES and "Pleural_Thickening" not in ALL_CLASSES
    assert set(SHARED_CLASSES) == {"Atelectasis", "Cardiomegaly", "Pleural Effusion", "Pneumonia", "Pneumothorax",
                                   "Consolidation", "Edema"}


# -------------------------------------------------------------------------------------------------------- NIH
NIH_2017_HEADER = ("Image Index,Finding Labels,Follow-up #,Patient ID,Patient Age,Patient Gender,View Position,"
                   "OriginalImage[Width,Height],OriginalImagePixelSpacing[x,y],")


def _nih(tmp_path, header, rows, name="Data_Entry_2017.csv", images=("a.png", "b.png", "c.png")):
    root = tmp_path / "nih"
    for im in images:
        _png(root / "images" / im)
    (root / name).write_text(header + "\n" + "\n".join(rows) + "\n")
    return root


@pytest.mark.parametrize("header, trail", [
    (NIH_2017_HEADER, ","),                                                       # 2017: unquoted, trailing comma
    (NIH_2017_HEADER[:-1], ""),                                                   # no trailing comma
    ('Image Index,Finding Labels,Follow-up #,Patient ID,Patient Age,Patient Gender,View Position,'
     '"OriginalImage[Width,Height]","OriginalImagePixelSpacing[x,y]"', ""),       # quoted: one field, two columns
])
def test_nih_awkward_headers_and_labels(tmp_path, header, trail):
    rows = [f"a.png,Cardiomegaly|Effusion,0,7,058Y,M,PA,2682,2749,0.143,0.143{trail}",
            f"b.png,No Finding,1,7,58,M,AP,2500,2048,0.168,0.168{trail}",
            f"c.png,Pleural_Thickening|Hernia,0,9,40,F,PA,2992,2991,0.143,0.143{trail}"]
    recs = load_nih(_nih(tmp_path, header, rows), site="site-1")
    assert [r.patient for r in recs] == ["7", "7", "9"]
    assert recs[0].labels == ("Cardiomegaly", "Pleural Effusion")
    assert recs[1].labels == ()
    assert recs[2].labels == ("Hernia", "Pleural Thickening")
    assert recs[0].path.endswith("images/a.png")


def test_nih_header_normalisation_all_forms_agree():
    plain = next(csv.reader([NIH_2017_HEADER]))
    quoted = next(csv.reader(['Image Index,Finding '
                              'Labels,"OriginalImage[Width,Height]","OriginalImagePixelSpacing[x,y]"']))
    assert _normalise_nih_header(plain)[-4:] == ["OriginalImage_Width", "OriginalImage_Height",
                                                  "OriginalImagePixelSpacing_x", "OriginalImagePixelSpacing_y"]
    assert _normalise_nih_header(quoted)[-4:] == _normalise_nih_header(plain)[-4:]
    assert len(_normalise_nih_header(plain)) == 11


@pytest.mark.parametrize("row, problem", [
    ("a.png,Cardiomegaly,0,7,58,M,PA,2682,2749,0.143", "row has 10 fields"),
    ("a.png,Cardiomegaly|Flu,0,7,58,M,PA,2682,2749,0.143,0.143,", "unknown NIH findings"),
    ("a.png,Cardiomegaly||Mass,0,7,58,M,PA,2682,2749,0.143,0.143,", "empty finding"),
    ("a.png,No Finding|Mass,0,7,58,M,PA,2682,2749,0.143,0.143,", "'No Finding' together"),
    ("zz.png,Mass,0,7,58,M,PA,2682,2749,0.143,0.143,", "not found under images"),
])
def test_nih_errors_name_file_row_and_site(tmp_path, row, problem):
    root = _nih(tmp_path, NIH_2017_HEADER, ["b.png,No Finding,1,7,58,M,AP,1,1,0.1,0.1,", row])
    with pytest.raises(CXRDataError) as e:
        load_nih(root, site="site-3")
    msg = str(e.value)
    assert problem in msg and "site-3" in msg and "Data_Entry_2017.csv" in msg and "row 3" in msg


def test_nih_missing_csv_names_site(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CXRDataError, match=r"site-2.*Data_Entry_2017_v2020.csv"):
        load_nih(tmp_path / "empty", site="site-2")


@pytest.mark.parametrize("variant, image_dirs, csv_name", [("2020", 1, "Data_Entry_2017_v2020.csv"),
                                                           ("2017", 3, "Data_Entry_2017.csv")])
def test_synthetic_nih_round_trip(tmp_path, variant, image_dirs, csv_name):
    info = write_synthetic_nih(tmp_path / "nih", n_patients=6, seed=1, image_size=32, variant=variant,
                               image_dirs=image_dirs)
    assert info["csv"].endswith(csv_name)
    text = (tmp_path / "nih" / csv_name).read_text().splitlines()
    assert text[0].endswith("[x,y]" + ("," if variant == "2017" else ""))
    recs = load_cxr_site(tmp_path / "nih", "nih", site="site-1")
    assert len(recs) == info["n_images"] and len({r.patient for r in recs}) == 6
    assert len(recs) > 6  # several images per patient
    counts = {c: sum(c in r.labels for r in recs) for c in NIH_CLASSES}
    assert counts == info["positives"]
    if image_dirs > 1:
        assert any("images_002/images" in r.path for r in recs)


# --------------------------------------------------------------------------------------------------- CheXpert
CHEX_HEADER = ["Path", "Sex", "Age", "Frontal/Lateral", "AP/PA", "No Finding"] + list(CHEXPERT_CLASSES)


def _chexpert(root, rows, split="train"):
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{split}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CHEX_HEADER)
        for path, view, labels in rows:
            vals = [labels.get(c, "") for c in CHEXPERT_CLASSES]
            w.writerow([f"CheXpert-v1.0-small/{path}", "Male", "60", view, "PA", ""] + vals)
            if view:
                _png(root / path)


def test_chexpert_values_views_and_prefix(tmp_path):
    root = tmp_path / "CheXpert-v1.0-small"  # the real folder name: Path resolved against its parent
    _chexpert(root, [
        ("train/patient00001/study1/view1_frontal.jpg", "Frontal",
         {"Edema": "1.0", "Cardiomegaly": "-1.0", "Fracture": "0.0", "Pleural Effusion": "1"}),
        ("train/patient00001/study1/view2_lateral.jpg", "Lateral", {"Edema": "1.0"}),
        ("train/patient00002/study1/view1_frontal.jpg", "Frontal", {"Support Devices": "-1", "Lung Opacity": ""}),
    ])
    recs = load_chexpert(root, site="site-2")
    assert [r.patient for r in recs] == ["patient00001", "patient00002"]  # lateral dropped
    assert recs[0].labels == ("Edema", "Pleural Effusion")  # -1 and 0 negative
    assert recs[1].labels == ()
    assert recs[0].path == str(root / "train/patient00001/study1/view1_frontal.jpg")
    # a renamed site folder: the prefix is dropped and the rest resolved against the root
    site = tmp_path / "site-2"
    shutil.copytree(root, site)
    assert [r.path for r in load_chexpert(site)] == [str(site / "train/patient00001/study1/view1_frontal.jpg"),
                                                     str(site / "train/patient00002/study1/view1_frontal.jpg")]


@pytest.mark.parametrize("labels, view, problem", [({"Edema": "2.0"}, "Frontal", "Edema='2.0'"),
                                                   ({"Edema": "yes"}, "Frontal", "Edema='yes'"),
                                                   ({}, "Sideways", "Frontal/Lateral='Sideways'")])
def test_chexpert_bad_values_name_row(tmp_path, labels, view, problem):
    _chexpert(tmp_path / "c", [("train/patient00001/study1/view1_frontal.jpg", "Frontal", {}),
                               ("train/patient00002/study1/view1_frontal.jpg", view, labels)])
    with pytest.raises(CXRDataError) as e:
        load_chexpert(tmp_path / "c", site="site-5")
    assert problem in str(e.value) and "row 3" in str(e.value) and "site-5" in str(e.value)
    assert "train.csv" in str(e.value)


def test_chexpert_missing_image_and_csv(tmp_path):
    _chexpert(tmp_path / "c", [("train/patient00001/study1/view1_frontal.jpg", "Frontal", {})])
    (tmp_path / "c" / "train/patient00001/study1/view1_frontal.jpg").unlink()
    with pytest.raises(CXRDataError, match=r"site-4.*not found.*row 2"):
        load_chexpert(tmp_path / "c", site="site-4")
    with pytest.raises(CXRDataError, match=r"site-4.*valid.csv not found"):
        load_chexpert(tmp_path / "c", split="valid", site="site-4")


def test_synthetic_chexpert_round_trip(tmp_path):
    info = write_synthetic_chexpert(tmp_path / "chex", n_patients=8, seed=2, image_size=32, n_valid_patients=2,
                                    lateral_fraction=0.5)
    rows = list(csv.DictReader(open(tmp_path / "chex" / "train.csv")))
    assert any(r["Frontal/Lateral"] == "Lateral" for r in rows)
    values = {r[c] for r in rows for c in CHEXPERT_CLASSES}
    assert {"", "0.0", "-1.0", "1.0"} <= values
    assert all(r["Path"].startswith("CheXpert-v1.0-small/train/") for r in rows)
    recs = load_chexpert(tmp_path / "chex")
    assert len(recs) == info["n_images"] == sum(r["Frontal/Lateral"] == "Frontal" for r in rows)
    assert {c: sum(c in r.labels for r in recs) for c in CHEXPERT_CLASSES} == info["positives"]
    valid = load_cxr_site(tmp_path / "chex", "chexpert", split="valid")
    assert valid and not ({r.patient for r in valid} & {r.patient for r in recs})


# ------------------------------------------------------------------------------------------------------ MIMIC
def test_synthetic_mimic_splits_views_and_labels(tmp_path):
    root = tmp_path / "mimic"
    info = write_synthetic_mimic_cxr(root, n_patients=12, seed=3, image_size=32, lateral_fraction=0.5)
    meta = list(csv.DictReader(open(root / "mimic-cxr-2.0.0-metadata.csv")))
    assert any(m["ViewPosition"] == "LATERAL" for m in meta)
    every = load_mimic_cxr(root, split="all", site="ext")
    assert len(every) == info["n_images"] == sum(m["ViewPosition"] in ("PA", "AP") for m in meta)
    # official split filter: the three splits partition the frontal images
    split_of = {r["dicom_id"]: r["split"] for r in csv.DictReader(open(root / "mimic-cxr-2.0.0-split.csv"))}
    total = 0
    for s in ("train", "validate", "test"):
        expected = sum(m["ViewPosition"] in ("PA", "AP") and split_of[m["dicom_id"]] == s for m in meta)
        if expected == 0:
            with pytest.raises(CXRDataError, match="no labelled frontal image"):
                load_mimic_cxr(root, split=s, site="ext")
            continue
        part = load_mimic_cxr(root, split=s, site="ext")
        assert len(part) == expected and all(split_of[r.path.rsplit("/", 1)[1][:-4]] == s for r in part)
        total += len(part)
    assert total == len(every)
    assert "/files/p1" in every[0].path and every[0].path.endswith(".jpg")
    assert dataset_classes("mimic", root) == list(ALL_CLASSES)  # expanded (CXR-LT-like) label file
    assert {c: sum(c in r.labels for r in every) for c in ALL_CLASSES} == info["positives"]
    # study-level labels: both frontal images of a study carry the same labels
    by_study = {}
    for r in every:
        by_study.setdefault(r.path.split("/")[-2], set()).add(r.labels)
    assert all(len(v) == 1 for v in by_study.values())


def test_mimic_chexpert_only_labels_and_gz(tmp_path):
    root = tmp_path / "mimic"
    write_synthetic_mimic_cxr(root, n_patients=5, seed=4, image_size=32, expanded_labels=False)
    assert dataset_classes("mimic", root) == [c for c in ALL_CLASSES if c in CHEXPERT_CLASSES]
    n = len(load_mimic_cxr(root, split="all"))
    for name in ("mimic-cxr-2.0.0-chexpert.csv", "mimic-cxr-2.0.0-split.csv"):  # the release ships .csv.gz
        with open(root / name, "rb") as src, gzip.open(root / (name + ".gz"), "wb") as dst:
            dst.write(src.read())
        (root / name).unlink()
    assert len(load_mimic_cxr(root, split="all")) == n


def test_mimic_errors_name_file_and_site(tmp_path):
    root = tmp_path / "mimic"
    write_synthetic_mimic_cxr(root, n_patients=3, seed=5, image_size=32)
    lines = (root / "mimic-cxr-2.0.0-split.csv").read_text().splitlines()
    (root / "mimic-cxr-2.0.0-split.csv").write_text("\n".join(lines[:1]) + "\n")
    with pytest.raises(CXRDataError, match=r"site ext.*missing from mimic-cxr-2.0.0-split.csv.*metadata.csv, row 2"):
        load_mimic_cxr(root, split="all", site="ext")
    (root / "mimic-cxr-2.0.0-split.csv").unlink()
    with pytest.raises(CXRDataError, match=r"site ext.*mimic-cxr-2.0.0-split.csv"):
        load_mimic_cxr(root, site="ext")


# ------------------------------------------------------------------------------------------------ patient split
def _records(n_patients=50, seed=0):
    rng = np.random.default_rng(seed)
    return [CXRRecord(f"/x/{p}_{i}.png", f"p{p}", ("Mass",) if rng.random() < 0.5 else ())
            for p in range(n_patients) for i in range(int(rng.integers(1, 4)))]


def test_patient_split_disjoint_seeded_and_stratified():
    recs = _records()
    tr, va, te = patient_split(recs, (0.7, 0.1, 0.2), seed=0)
    pats = [{r.patient for r in s} for s in (tr, va, te)]
    assert not (pats[0] & pats[1]) and not (pats[0] & pats[2]) and not (pats[1] & pats[2])
    assert len(tr) + len(va) + len(te) == len(recs)
    assert sorted(pats[0] | pats[1] | pats[2]) == sorted({r.patient for r in recs})
    # each group (abnormal / normal patients) is cut at round(0.7 n) and round(0.8 n), as the public code
    abnormal = {r.patient for r in recs if r.labels}  # a patient with a finding in any image
    groups = [len(abnormal), len({r.patient for r in recs} - abnormal)]
    cuts = [(round(0.7 * n), round(0.8 * n), n) for n in groups]
    assert [len(p) for p in pats] == [sum(c[0] for c in cuts), sum(c[1] - c[0] for c in cuts),
                                      sum(c[2] - c[1] for c in cuts)]
    for s in (tr, va, te):  # abnormal and normal patients in every split
        assert any(r.labels for r in s) and any(not r.labels for r in s)
    assert patient_split(recs, seed=0) == (tr, va, te)
    assert patient_split(recs, seed=1) != (tr, va, te)
    with pytest.raises(ValueError, match="summing to 1"):
        patient_split(recs, (0.5, 0.1, 0.1))


# ----------------------------------------------------------------------------------------------------- dataset
def test_dataset_targets_normalisation_and_padding(tmp_path):
    _png(tmp_path / "a.png", size=(40, 20), value=255)  # wide image: padded top/bottom
    recs = [CXRRecord(str(tmp_path / "a.png"), "p1", ("Mass", "Pleural Effusion"))]
    ds = CXRDataset(recs, ["Pleural Effusion", "Edema", "Mass"], image_size=16, train=False)
    x, y = ds[0]
    assert x.shape == (3, 16, 16) and y.tolist() == [1.0, 0.0, 1.0]
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    torch.testing.assert_close(x[:, 8, 8], (1 - mean) / std)  # white centre
    torch.testing.assert_close(x[:, 0, 8], (0 - mean) / std)  # zero padding row
    assert torch.equal(ds.targets, y[None])


def test_dataset_augmentation_reproducible_per_epoch(tmp_path):
    write_synthetic_nih(tmp_path / "n", n_patients=3, seed=0, image_size=32)
    recs = load_nih(tmp_path / "n")
    ds = CXRDataset(recs, NIH_CLASSES, image_size=32, train=True, seed=0)
    a = ds[0][0]
    assert torch.equal(a, ds[0][0])
    ds.set_epoch(1)
    assert not torch.equal(a, ds[0][0])
    plain = CXRDataset(recs, NIH_CLASSES, image_size=32, train=False)
    assert not torch.equal(a, plain[0][0]) and torch.equal(plain[0][0], plain[0][0])
    mild = CXRDataset(recs, NIH_CLASSES, image_size=32, train=True, rotation=0, zoom=0, contrast=0, flip=False)
    torch.testing.assert_close(mild[0][0], plain[0][0], atol=1e-5, rtol=0)  # identity transform


def test_dataset_corrupt_image_names_site(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a png")
    ds = CXRDataset([CXRRecord(str(tmp_path / "bad.png"), "p", ())], ["Mass"], image_size=16, site="site-6")
    with pytest.raises(CXRDataError, match=r"site-6.*unreadable image.*bad.png"):
        ds[0]


def test_batches_cover_epoch_reproducibly(tmp_path):
    write_synthetic_nih(tmp_path / "n", n_patients=4, seed=0, image_size=32)
    recs = load_nih(tmp_path / "n")
    ds = CXRDataset(recs, ALL_CLASSES, image_size=32, train=False)
    out = list(batches(ds, 3, seed=0, epoch=0))
    assert len(out) == n_batches(ds, 3) and sum(x.shape[0] for x, _ in out) == len(ds)
    assert out[0][0].shape[1:] == (3, 32, 32) and out[0][1].shape[1] == 20
    again = list(batches(ds, 3, seed=0, epoch=0))
    assert all(torch.equal(a[1], b[1]) for a, b in zip(out, again))
    ys = torch.cat([y for _, y in out])
    assert ys.sum() == ds.targets.sum()
    assert len(list(batches(ds, 3, drop_last=True))) == len(ds) // 3


# ------------------------------------------------------------------------------ ablation partitioner (issue 13 item 15)
def _patients(n_abnormal, n_normal, images_per_patient=2):
    from fedssl.data.cxr import CXRRecord

    out = []
    for p in range(n_abnormal + n_normal):
        labels = ("Mass",) if p < n_abnormal else ()
        out += [CXRRecord(path=f"/x/{p}_{i}.png", patient=f"p{p}", labels=labels) for i in range(images_per_patient)]
    return out


@pytest.mark.parametrize("k,per_client_abnormal,per_client_normal,unused", [(2, 3, 2, 0), (3, 2, 1, 1)])
def test_iid_subsets_deal_abnormal_and_normal_patients_out_equally(k, per_client_abnormal, per_client_normal, unused):
    """Paper sec. 2.4.1 / public split_for_K_nodes: 6 abnormal + 4 normal patients, K clients -> each client
    floor(6/K) abnormal and floor(4/K) normal patients, no patient in two clients, the remainder unused."""
    from fedssl.data.cxr import iid_patient_subsets

    records = _patients(6, 4)
    subsets = iid_patient_subsets(records, k, seed=3)
    patients = [{r.patient for r in s} for s in subsets]
    assert [sum(1 for p in ps if int(p[1:]) < 6) for ps in patients] == [per_client_abnormal] * k
    assert [sum(1 for p in ps if int(p[1:]) >= 6) for ps in patients] == [per_client_normal] * k
    assert sum(len(ps) for ps in patients) == len(set().union(*patients)) == 10 - unused
    assert all(len(s) == 2 * len(ps) for s, ps in zip(subsets, patients))  # a patient's images stay together
    assert iid_patient_subsets(records, k, seed=3) == subsets and iid_patient_subsets(records, k, seed=4) != subsets
    with pytest.raises(ValueError, match="n_clients=0"):
        iid_patient_subsets(records, 0)
    with pytest.raises(ValueError, match="cannot fill 11 IID subsets"):
        iid_patient_subsets(records, 11)


@pytest.mark.parametrize("n_shared,sizes", [(0, [3, 3, 4, 4]), (2, [5, 5, 5, 5]), (12, [12, 12, 13, 13]),
                                            (14, [14, 14, 14, 14])])
def test_shared_class_lists_match_the_public_ablation_configs(n_shared, sizes):
    """NIH's 14 classes over 4 clients (public configs/exp1/exp1.2): n_shared classes held by all 4, the other
    14 - n_shared by exactly one client each, dealt round-robin: list sizes as the public configs'."""
    from fedssl.data.cxr import NIH_CLASSES, shared_class_lists

    lists = shared_class_lists(NIH_CLASSES, 4, n_shared, seed=0)
    held = {c: sum(c in cl for cl in lists) for c in NIH_CLASSES}
    assert sorted(held.values()) == [1] * (14 - n_shared) + [4] * n_shared
    assert sorted(len(cl) for cl in lists) == sizes
    assert all(cl == [c for c in NIH_CLASSES if c in cl] for cl in lists)  # NIH order


def test_shared_class_lists_refuse_impossible_settings():
    from fedssl.data.cxr import shared_class_lists

    with pytest.raises(ValueError, match="n_shared=15"):
        shared_class_lists([f"c{i}" for i in range(14)], 4, 15)
    with pytest.raises(ValueError, match="leave a client of 5 without classes"):
        shared_class_lists(["a", "b", "c"], 5, 0)


def test_nih_partition_writes_disjoint_sites_with_their_own_labels_and_a_held_out_test_set(tmp_path):
    from fedssl.data.cxr import NIH_CLASSES, external_dataset, load_nih, shared_class_lists, write_nih_partition

    write_synthetic_nih(tmp_path / "nih", 30, seed=0, image_size=16)
    summary = write_nih_partition(tmp_path / "nih", tmp_path / "out", n_clients=3, n_shared=2, seed=5)
    lists = shared_class_lists(NIH_CLASSES, 3, 2, seed=5)
    assert summary["classes"] == {f"site-{k + 1}": lists[k] for k in range(3)}
    seen = set()
    for k, site in enumerate(("site-1", "site-2", "site-3")):
        records = load_nih(tmp_path / "out" / site, site=site)
        patients = {r.patient for r in records}
        assert not patients & seen and len(records) == summary["sites"][site]["n_images"]
        seen |= patients
        assert all(set(r.labels) <= set(lists[k]) for r in records)  # only the site's own classes are labelled
    held = load_nih(tmp_path / "out" / "nih_test")
    assert not {r.patient for r in held} & seen and summary["held_out"]["classes"] == list(NIH_CLASSES)
    assert external_dataset(tmp_path / "out" / "nih_test") == "nih" and external_dataset(tmp_path) == "mimic"
