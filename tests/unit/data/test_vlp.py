"""FedDRA's data layer: report parsing, MIMIC-CXR image-report pairs, the LDA client split, manifests, retina
captions (MESSIDOR-2, BRSET), RSNA / COVIDx probe sets and the image-text dataset - on hand-written files."""

import csv
import gzip
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from fedssl.data.cxr import CXRDataError
from fedssl.data.vlp import (
    COVIDX_CLASSES_OLD,
    COVIDX_CLASSES_V3,
    FEDDRA_FINDINGS,
    VLPDataError,
    VLPDataset,
    VLPRecord,
    code_histograms,
    collate_vlp,
    covidx_classes,
    finding_code,
    lda_client_split,
    load_brset,
    load_covidx,
    load_manifest,
    load_messidor2,
    load_mimic_vlp,
    load_rsna_pneumonia,
    mean_tv_distance,
    parse_report,
    patient_test_split,
    report_text,
    retina_caption,
    write_client_manifests,
    write_source_manifests,
)

# --------------------------------------------------------------------------------------- reports (real format)
REPORT_FULL = """                                 FINAL REPORT
 EXAMINATION:  CHEST (PA AND LAT)
 
 INDICATION:  ___F with new onset ascites  // eval for infection
 
 TECHNIQUE:  Chest PA and lateral
 
 COMPARISON:  None.
 
 FINDINGS:
 
 There is no focal consolidation, pleural effusion or pneumothorax.  Bilateral
 nodular opacities that most likely represent nipple shadows. The
 cardiomediastinal silhouette is normal.
 
 IMPRESSION:
 
 No acute cardiopulmonary process.
"""
REPORT_IMPRESSION_ONLY = """                                 FINAL REPORT
 INDICATION:  ___-year-old man with chest pain.
 
 COMPARISON:  ___.
 
 IMPRESSION:  Moderate pulmonary edema with small bilateral pleural effusions,
 worse since ___.
"""
REPORT_WET_READ = """WET READ: ___ ___ 4:12 PM
  Right lower lobe pneumonia.
 ______________________________________________________________________________
                                 FINAL REPORT
 HISTORY:  Fever.
 
 FINDINGS:
 
 CONCLUSION:  Right lower lobe consolidation concerning for pneumonia.  No
 pneumothorax.
"""
REPORT_NO_SECTIONS = """                                 FINAL REPORT
 EXAMINATION:  CHEST (PORTABLE AP)
 
 INDICATION:  ___ with line placement.
 
 NOTIFICATION:  Findings discussed with Dr. ___ at 10:30 a.m. by telephone.
"""


def test_parse_report_real_format():
    assert parse_report(REPORT_FULL) == {
        "findings": "There is no focal consolidation, pleural effusion or pneumothorax. Bilateral nodular opacities "
                    "that most likely represent nipple shadows. The cardiomediastinal silhouette is normal.",
        "impression": "No acute cardiopulmonary process."}
    assert parse_report(REPORT_IMPRESSION_ONLY) == {
        "findings": None,
        "impression": "Moderate pulmonary edema with small bilateral pleural effusions, worse since ___."}
    # empty FINDINGS header -> absent; CONCLUSION counts as the impression; the WET READ preamble is dropped
    assert parse_report(REPORT_WET_READ) == {
        "findings": None, "impression": "Right lower lobe consolidation concerning for pneumonia. No pneumothorax."}
    # "Findings discussed" (not an upper-case header) does not open a section
    assert parse_report(REPORT_NO_SECTIONS) == {"findings": None, "impression": None}


def test_report_text_joins_findings_and_impression():
    assert report_text(REPORT_FULL) == (
        "There is no focal consolidation, pleural effusion or pneumothorax. Bilateral nodular opacities that most "
        "likely represent nipple shadows. The cardiomediastinal silhouette is normal. "
        "No acute cardiopulmonary process.")
    assert report_text(REPORT_IMPRESSION_ONLY).startswith("Moderate pulmonary edema")
    assert report_text(REPORT_NO_SECTIONS) is None
    assert report_text(" FINDINGS:  Lungs clear.\n") == "Lungs clear."
    with pytest.raises(ValueError, match="text"):
        parse_report(None)


def test_finding_code():
    assert FEDDRA_FINDINGS == ("Edema", "Pleural Effusion", "Consolidation", "Pneumothorax", "Pneumonia")
    assert finding_code((0, 0, 0, 0, 0)) == 0
    assert finding_code((1, 0, 1, 0, 0)) == 5
    assert finding_code((0, 0, 0, 0, 1)) == 16
    assert finding_code((1, 1, 1, 1, 1)) == 31
    with pytest.raises(ValueError, match="labels"):
        finding_code((1, 0, 2, 0, 0))
    with pytest.raises(ValueError, match="labels"):
        finding_code((1, 0))


# ----------------------------------------------------------------------------------------------- MIMIC layout
def _img(path, size=(24, 20), value=100, mode="L"):
    path.parent.mkdir(parents=True, exist_ok=True)
    shape = size[::-1] if mode == "L" else size[::-1] + (3,)
    Image.fromarray(np.full(shape, value, np.uint8), mode=mode).save(path)


def _csv(path, header, rows, gz=False):
    text = "\n".join([",".join(header)] + [",".join(r) for r in rows]) + "\n"
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)


# (subject, study, dicom, view, split)
IMAGES = [
    ("10000001", "50000001", "d1", "PA", "train"),
    ("10000001", "50000001", "d2", "LATERAL", "train"),
    ("10000001", "50000002", "d3", "AP", "validate"),
    ("10000002", "50000003", "d4", "PA", "test"),
    ("10000002", "50000003", "d8", "LL", "test"),
    ("10000002", "50000003", "d9", "", "test"),
    ("10000003", "50000004", "d5", "PA", "train"),
    ("10000004", "50000005", "d6", "PA", "train"),
    ("10000005", "50000006", "d7", "AP", "train"),
]
REPORTS = {"50000001": REPORT_FULL, "50000002": REPORT_WET_READ, "50000003": REPORT_IMPRESSION_ONLY,
           "50000004": REPORT_NO_SECTIONS, "50000005": REPORT_FULL}  # 50000006: no report file


def _mimic(tmp_path, reports_apart=False):
    root = tmp_path / "mimic"
    rep_root = tmp_path / "reports" if reports_apart else root
    root.mkdir()
    for subject, study, dicom, _, _ in IMAGES:
        _img(root / "files" / f"p{subject[:2]}" / f"p{subject}" / f"s{study}" / f"{dicom}.jpg")
    for (subject, study), text in {(s, st): REPORTS[st] for s, st, *_ in IMAGES if st in REPORTS}.items():
        p = rep_root / "files" / f"p{subject[:2]}" / f"p{subject}" / f"s{study}.txt"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    # label columns in another order than FEDDRA_FINDINGS; 50000005 has no label row
    _csv(root / "mimic-cxr-2.0.0-chexpert.csv",
         ["subject_id", "study_id", "Atelectasis", "Consolidation", "Edema", "Pleural Effusion", "Pneumonia",
          "Pneumothorax"],
         [["10000001", "50000001", "", "", "1.0", "0.0", "", ""],
          ["10000001", "50000002", "", "", "", "", "1.0", "-1.0"],
          ["10000002", "50000003", "1.0", "", "", "", "", ""],
          ["10000003", "50000004", "", "1.0", "", "", "", ""],
          ["10000005", "50000006", "", "", "", "", "", ""]])
    _csv(root / "mimic-cxr-2.0.0-split.csv.gz", ["dicom_id", "study_id", "subject_id", "split"],
         [[d, st, s, sp] for s, st, d, _, sp in IMAGES], gz=True)
    _csv(root / "mimic-cxr-2.0.0-metadata.csv", ["dicom_id", "subject_id", "study_id", "ViewPosition", "Rows"],
         [[d, s, st, v, "20"] for s, st, d, v, _ in IMAGES])
    return root, rep_root


EXPECTED_COUNTS = {"images": 3, "studies": 3, "patients": 2, "train": 2, "test": 1, "skipped_lateral": 2,
                   "skipped_other_view": 1, "skipped_no_labels": 1, "skipped_no_report": 1, "skipped_no_sections": 1}


@pytest.mark.parametrize("apart", [False, True])
def test_load_mimic_vlp_hand_written(tmp_path, apart):
    root, rep_root = _mimic(tmp_path, apart)
    recs, counts = load_mimic_vlp(root, site="site-1", reports_root=rep_root if apart else None)
    assert counts == EXPECTED_COUNTS
    assert [(r.study, os.path.basename(r.image), r.split, r.labels) for r in recs] == [
        ("50000001", "d1.jpg", "train", (1, 1, 0, 0, 0)),   # Edema 1.0 -> 1, Pleural Effusion 0.0 -> 1 (non-NaN)
        ("50000002", "d3.jpg", "train", (0, 0, 0, 1, 1)),   # validate -> train; Pneumothorax -1.0 -> 1
        ("50000003", "d4.jpg", "test", (0, 0, 0, 0, 0)),    # Atelectasis is not a FedDRA finding
    ]
    assert recs[0].text == report_text(REPORT_FULL)
    assert recs[1].text == "Right lower lobe consolidation concerning for pneumonia. No pneumothorax."
    assert recs[0].patient == "10000001" and os.path.isabs(recs[0].image)
    assert recs[0].text_source == str(rep_root / "files" / "p10" / "p10000001" / "s50000001.txt")


def test_load_mimic_vlp_errors(tmp_path):
    root, _ = _mimic(tmp_path)
    os.remove(root / "files" / "p10" / "p10000002" / "s50000003" / "d4.jpg")
    with pytest.raises(VLPDataError, match=r"\[site site-3\].*d4\.jpg not found.*metadata\.csv, row 5"):
        load_mimic_vlp(root, site="site-3")
    recs, _ = load_mimic_vlp(root, check_images=False)
    assert len(recs) == 3
    # reports elsewhere and not given: every frontal report missing -> told to pass reports_root
    with pytest.raises(VLPDataError, match="reports_root"):
        load_mimic_vlp(root, reports_root=tmp_path / "mimic" / "files" / "p10")
    bad = (root / "mimic-cxr-2.0.0-chexpert.csv").read_text().replace("1.0,0.0", "1.0,2.0")
    (root / "mimic-cxr-2.0.0-chexpert.csv").write_text(bad)
    with pytest.raises(CXRDataError, match=r"Pleural Effusion='2\.0'.*row 2"):
        load_mimic_vlp(root, check_images=False)


# ------------------------------------------------------------------------------------------------ LDA split
def _records(n_studies=400, seed=0):
    """Studies with a skewed code mix over 8 codes; a quarter of the studies have two images."""
    rng = np.random.default_rng(seed)
    codes = [0, 1, 2, 3, 4, 5, 16, 20]
    p = np.array([40, 12, 12, 8, 8, 6, 8, 6], float)
    out = []
    for k in range(n_studies):
        code = int(rng.choice(codes, p=p / p.sum()))
        labels = tuple((code >> i) & 1 for i in range(5))
        for j in range(1 + int(rng.random() < 0.25)):
            out.append(VLPRecord(image=f"/x/s{k}_{j}.jpg", text=f"report {k}", labels=labels, patient=f"p{k // 2}",
                                 study=f"s{k}", split="test" if k % 5 == 0 else "train", text_source=f"/x/s{k}.txt"))
    return out


def test_lda_split_deterministic_partition_by_study():
    recs = _records()
    parts = lda_client_split(recs, n_clients=5, alpha=1.0, seed=0)
    assert len(parts) == 5
    assert parts == lda_client_split(recs, n_clients=5, alpha=1.0, seed=0)
    assert parts != lda_client_split(recs, n_clients=5, alpha=1.0, seed=1)
    ids = [r.image for p in parts for r in p]
    assert sorted(ids) == sorted(r.image for r in recs) and len(set(ids)) == len(recs)  # each record exactly once
    owner = {}
    for c, p in enumerate(parts):
        for r in p:
            assert owner.setdefault(r.study, c) == c, f"study {r.study} split over clients"
    assert sum(1 for r in recs if r.study == "s0") >= 1
    assert all(len({r.study for r in p}) >= 10 for p in parts)  # min_per_client studies
    for p in parts:  # input order kept
        pos = [recs.index(r) for r in p]
        assert pos == sorted(pos)


def test_code_histograms_sum_to_totals():
    recs = _records()
    parts = lda_client_split(recs, n_clients=4, alpha=0.5, seed=3)
    h = code_histograms(parts)
    assert h.shape == (4, 32)
    total = np.bincount([finding_code(r.labels) for r in recs], minlength=32)
    assert np.array_equal(h.sum(axis=0), total)
    assert [int(x) for x in h.sum(axis=1)] == [len(p) for p in parts]
    assert h[:, [6, 7] + list(range(8, 16)) + list(range(17, 20)) + list(range(21, 32))].sum() == 0


def test_small_alpha_more_skew_than_large():
    recs = _records()
    for seed in (0, 1, 2):
        skewed = mean_tv_distance(code_histograms(lda_client_split(recs, 5, 0.1, seed)))
        iid = mean_tv_distance(code_histograms(lda_client_split(recs, 5, 100.0, seed)))
        assert skewed > iid + 0.2, (seed, skewed, iid)
        assert iid < 0.15


def test_mean_tv_distance_hand_computed():
    h = np.array([[2, 0], [1, 3]])  # global (3/6, 3/6); client 1 (1, 0): 0.5; client 2 (1/4, 3/4): 0.25
    assert mean_tv_distance(h) == pytest.approx(0.375)


def test_lda_split_argument_errors():
    recs = _records(30)
    with pytest.raises(ValueError, match="n_clients"):
        lda_client_split(recs, n_clients=0)
    with pytest.raises(ValueError, match="alpha"):
        lda_client_split(recs, alpha=0.0)
    with pytest.raises(ValueError, match="min_per_client"):
        lda_client_split(recs, n_clients=5, min_per_client=10)  # 30 studies < 5 x 10


# ------------------------------------------------------------------------------------------------- manifests
def test_manifest_round_trip(tmp_path):
    root, _ = _mimic(tmp_path)
    recs, _ = load_mimic_vlp(root)
    paths = write_client_manifests(recs, tmp_path / "clients", n_clients=2, alpha=1.0, seed=0, root=root,
                                   min_per_client=1)
    assert paths == [str(tmp_path / "clients" / "site-1" / "manifest.csv"),
                     str(tmp_path / "clients" / "site-2" / "manifest.csv")]
    rows = [r for p in paths for r in csv.DictReader(open(p))]
    assert list(rows[0]) == ["image", "text_source", "split", "patient", "study", "labels"]
    by_study = {r["study"]: r for r in rows}
    assert by_study["50000001"] == {"image": "files/p10/p10000001/s50000001/d1.jpg",
                                    "text_source": "files/p10/p10000001/s50000001.txt", "split": "train",
                                    "patient": "10000001", "study": "50000001", "labels": "1;1;0;0;0"}
    back = [r for i, p in enumerate(paths) for r in load_manifest(p, root, site=f"site-{i + 1}")]
    assert sorted(back, key=lambda r: r.image) == sorted(recs, key=lambda r: r.image)
    summary = json.loads((tmp_path / "clients" / "split_summary.json").read_text())
    assert (summary["n_clients"], summary["alpha"], summary["seed"]) == (2, 1.0, 0)
    assert [c["images"] for c in summary["clients"]] == [len(load_manifest(p, root)) for p in paths]
    total = [0] * 32
    total[3] = total[24] = total[0] = 1  # (1,1,0,0,0) -> 3; (0,0,0,1,1) -> 24; none -> 0
    assert summary["total_code_histogram"] == total
    assert [sum(x) for x in zip(*[c["code_histogram"] for c in summary["clients"]])] == total


def test_manifest_bad_rows(tmp_path):
    root, _ = _mimic(tmp_path)
    recs, _ = load_mimic_vlp(root)
    paths = write_client_manifests(recs, tmp_path / "c", n_clients=1, min_per_client=1)  # absolute paths
    text = open(paths[0]).read().splitlines()
    first = text[1].rsplit(",", 1)[0]
    with open(paths[0], "w") as f:
        f.write("\n".join([text[0], first + ",1;x;0;0;0"] + text[2:]) + "\n")
    with pytest.raises(VLPDataError, match=r"\[site site-9\].*labels '1;x;0;0;0'.*manifest\.csv, row 2"):
        load_manifest(paths[0], None, site="site-9")
    with open(paths[0], "w") as f:
        f.write("\n".join(text) + "\n")
    os.remove(recs[0].text_source)
    with pytest.raises(VLPDataError, match=r"report .*s50000001\.txt not found.*row 2"):
        load_manifest(paths[0], None, site="site-9")


# ------------------------------------------------------------------------------------------------------ retina
def test_retina_caption():
    assert retina_caption(0, 0) == "retinal image with no diabetic retinopathy and no risk of macular edema"
    assert retina_caption(2, 1) == ("retinal image with moderate non-proliferative diabetic retinopathy and risk "
                                    "of macular edema")
    assert retina_caption(4, 0) == "retinal image with proliferative diabetic retinopathy and no risk of macular edema"
    assert retina_caption(1, 0, "binary") == "retinal image with diabetic retinopathy and no risk of macular edema"
    with pytest.raises(ValueError, match="dr_grade"):
        retina_caption(5, 0)
    with pytest.raises(ValueError, match="scheme"):
        retina_caption(1, 0, "sdrg")


def test_patient_test_split():
    pats = [f"p{i}" for i in range(10)]
    test = patient_test_split(pats + pats[:3], seed=0)
    assert len(test) == 2 and test <= set(pats)
    assert test == patient_test_split(list(reversed(pats)), seed=0)  # order of the input does not matter
    assert len({frozenset(patient_test_split(pats, seed=s)) for s in range(5)}) > 1
    assert patient_test_split(pats, seed=0, test_fraction=0.0) == set()


def test_load_messidor2(tmp_path):
    root = tmp_path / "messidor"
    _img(root / "IMAGES" / "20051020_43808_0100_PP.png", mode="RGB")
    _img(root / "IMAGES" / "IM000004.jpg", mode="RGB")
    _img(root / "IMAGES" / "IM000005.jpg", mode="RGB")
    _img(root / "IMAGES" / "20051020_44000_0100_PP.tif", mode="RGB")
    _csv(root / "messidor_data.csv", ["image_id", "adjudicated_dr_grade", "adjudicated_dme", "adjudicated_gradable"],
         [["20051020_43808_0100_PP.tif", "0", "0", "1"],   # listed .tif, stored .png (Kaggle copy)
          ["IM000004.JPG", "2", "1", "1"],
          ["IM000005.JPG", "", "", "0"],                   # ungradable: skipped
          ["20051020_44000_0100_PP.tif", "4.0", "0.0", "1"]])
    recs, counts = load_messidor2(root, site="messidor")
    assert counts == {"images": 3, "patients": 3, "train": 2, "test": 1, "skipped_ungradable": 1}
    assert [(os.path.basename(r.image), r.labels) for r in recs] == [
        ("20051020_43808_0100_PP.png", (0, 0)), ("IM000004.jpg", (2, 1)), ("20051020_44000_0100_PP.tif", (4, 0))]
    assert recs[1].text == ("retinal image with moderate non-proliferative diabetic retinopathy and risk of "
                            "macular edema")
    test = patient_test_split([r.patient for r in recs], seed=0)
    assert [r.split for r in recs] == ["test" if r.patient in test else "train" for r in recs]
    rows = (root / "messidor_data.csv").read_text().replace("IM000004.JPG,2", "IM000004.JPG,7")
    (root / "messidor_data.csv").write_text(rows)
    with pytest.raises(VLPDataError, match=r"adjudicated_dr_grade='7'.*row 3"):
        load_messidor2(root)


def test_source_manifests_carry_captions(tmp_path):
    for n in ("a", "b", "c"):
        _img(tmp_path / "img" / f"{n}.png", mode="RGB")
    m = [VLPRecord(str(tmp_path / "img" / "a.png"), retina_caption(2, 1), (2, 1), "a", "a", "train"),
         VLPRecord(str(tmp_path / "img" / "b.png"), retina_caption(0, 0), (0, 0), "b", "b", "test")]
    b = [VLPRecord(str(tmp_path / "img" / "c.png"), retina_caption(4, 0), (4, 0), "7", "c", "train")]
    paths = write_source_manifests({"site-1": m, "site-2": b}, tmp_path / "out", root=tmp_path)
    assert paths == [str(tmp_path / "out" / s / "manifest.csv") for s in ("site-1", "site-2")]
    row = next(csv.DictReader(open(paths[0])))
    assert row["image"] == "img/a.png" and row["labels"] == "2;1"
    assert row["text_source"] == "caption:retinal image with moderate non-proliferative diabetic retinopathy and " \
                                 "risk of macular edema"
    assert load_manifest(paths[0], tmp_path) == m and load_manifest(paths[1], tmp_path) == b
    summary = json.loads((tmp_path / "out" / "split_summary.json").read_text())
    assert [(c["site"], c["images"], c["train"], c["test"]) for c in summary["clients"]] == [
        ("site-1", 2, 1, 1), ("site-2", 1, 1, 0)]
    with pytest.raises(ValueError, match="sources"):
        write_source_manifests([m], tmp_path / "o2")


def test_messidor2_xls_only_refused(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    (root / "messidor-2.xls").write_bytes(b"\xd0\xcf\x11\xe0")
    with pytest.raises(VLPDataError, match=r"messidor-2\.xls.*messidor_data\.csv"):
        load_messidor2(root, site="s")


def test_load_brset(tmp_path):
    root = tmp_path / "brset"
    for i in range(1, 5):
        _img(root / "fundus_photos" / f"img{i:05d}.jpg", mode="RGB")
    _csv(root / "labels_brset.csv",
         ["image_id", "patient_id", "camera", "DR_SDRG", "DR_ICDR", "macular_edema", "quality"],
         [["img00001", "1", "Canon CR", "0", "0", "0", "Adequate"],
          ["img00002", "1", "Canon CR", "1", "1", "0", "Adequate"],
          ["img00003", "2", "NIKON NF5050", "3", "3", "1", "Adequate"],
          ["img00004", "3", "Canon CR", "4", "4", "1", "Inadequate"]])
    recs, counts = load_brset(root, test_fraction=0.34)
    test = patient_test_split(["1", "2", "3"], seed=0, test_fraction=0.34)
    assert len(test) == 1  # round(0.34 * 3) = 1 patient
    n_test = {"1": 2, "2": 1, "3": 1}[next(iter(test))]
    assert counts == {"images": 4, "patients": 3, "train": 4 - n_test, "test": n_test}
    assert [r.split for r in recs] == ["test" if r.patient in test else "train" for r in recs]
    assert recs[0].split == recs[1].split  # both eyes of patient 1 together
    assert [r.labels for r in recs] == [(0, 0), (1, 0), (3, 1), (4, 1)]
    assert recs[1].text == "retinal image with mild non-proliferative diabetic retinopathy and no risk of macular edema"
    assert recs[2].text == ("retinal image with severe non-proliferative diabetic retinopathy and risk of macular "
                            "edema")
    os.remove(root / "fundus_photos" / "img00003.jpg")
    with pytest.raises(VLPDataError, match=r"fundus_photos/img00003\.jpg not found.*row 4"):
        load_brset(root)
    os.remove(root / "labels_brset.csv")
    with pytest.raises(VLPDataError, match="labels_brset.csv"):
        load_brset(root)


# ------------------------------------------------------------------------------------------------- RSNA, COVIDx
def test_load_rsna_max_target(tmp_path):
    root = tmp_path / "rsna"
    for pid in ("aaa", "bbb", "ccc", "ddd"):
        _img(root / "stage_2_train_images" / f"{pid}.png")
    _csv(root / "stage_2_train_labels.csv", ["patientId", "x", "y", "width", "height", "Target"],
         [["aaa", "", "", "", "", "0"], ["bbb", "264.0", "152.0", "213.0", "379.0", "1"],
          ["bbb", "562.0", "152.0", "256.0", "453.0", "1"], ["ccc", "", "", "", "", "0"],
          ["ddd", "", "", "", "", "0"], ["ddd", "100", "100", "50", "50", "1"],
          ["eee", "100", "100", "50", "50", "1"], ["eee", "", "", "", "", "0"]])
    _img(root / "stage_2_train_images" / "eee.jpg")
    got = load_rsna_pneumonia(root)
    assert [(os.path.basename(p), t) for p, t in got] == [("aaa.png", 0), ("bbb.png", 1), ("ccc.png", 0),
                                                         ("ddd.png", 1), ("eee.jpg", 1)]


def test_rsna_dicom_only_refused(tmp_path):
    root = tmp_path / "rsna"
    (root / "stage_2_train_images").mkdir(parents=True)
    (root / "stage_2_train_images" / "aaa.dcm").write_bytes(b"DICM")
    _csv(root / "stage_2_train_labels.csv", ["patientId", "x", "y", "width", "height", "Target"],
         [["aaa", "", "", "", "", "0"]])
    with pytest.raises(VLPDataError, match=r"\[site rs\].*DICOM.*convert the images to PNG"):
        load_rsna_pneumonia(root, site="rs")


def test_load_covidx(tmp_path):
    root = tmp_path / "covidx"
    for split, name in (("train", "a.png"), ("train", "b.png"), ("test", "c.png")):
        _img(root / split / name)
    (root / "train.txt").write_text("419639-003251 a.png positive ricord\nP12 b.png negative rsna\n\n")
    (root / "test.txt").write_text("P77 c.png positive bimcv\n")
    assert covidx_classes(root) == COVIDX_CLASSES_V3 == ("negative", "positive")
    assert [(os.path.basename(p), y) for p, y in load_covidx(root, "train")] == [("a.png", 1), ("b.png", 0)]
    assert [y for _, y in load_covidx(root, "test")] == [1]
    # an older release: normal / pneumonia / COVID-19 -> 0 / 1 / 2 (a line without source accepted)
    (root / "train.txt").write_text("1 a.png COVID-19 cohen\n2 b.png normal\n")
    (root / "test.txt").write_text("3 c.png pneumonia rsna\n")
    assert covidx_classes(root) == COVIDX_CLASSES_OLD
    assert [y for _, y in load_covidx(root, "train")] == [2, 0]
    assert [y for _, y in load_covidx(root, "test")] == [1]
    (root / "test.txt").write_text("3 c.png positive rsna\n")
    with pytest.raises(VLPDataError, match="mix label sets"):
        covidx_classes(root)
    (root / "test.txt").write_text("3 c.png maybe rsna\n")
    with pytest.raises(VLPDataError, match=r"test\.txt, row 1"):
        load_covidx(root, "test")
    with pytest.raises(ValueError, match="split"):
        load_covidx(root, "validation")


# ---------------------------------------------------------------------------------------------------- dataset
def _rec(path, text="t"):
    return VLPRecord(image=str(path), text=text, labels=(0, 0, 0, 0, 0), patient="p", study="s", split="train")


def test_dataset_values_and_crop(tmp_path):
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    _img(tmp_path / "flat.png", size=(40, 20), value=128)
    a = np.zeros((30, 60), np.uint8)
    a[:, 30:] = 255  # left half black, right half white
    Image.fromarray(a).save(tmp_path / "half.png")
    red = np.zeros((16, 16, 3), np.uint8)
    red[..., 0] = 255
    Image.fromarray(red).save(tmp_path / "red.png")
    ds = VLPDataset([_rec(tmp_path / "flat.png", "flat"), _rec(tmp_path / "half.png"), _rec(tmp_path / "red.png")], 16)
    x, text = ds[0]
    assert x.shape == (3, 16, 16) and text == "flat"
    assert torch.allclose(x, ((128 / 255 - mean) / std).view(3, 1, 1).expand(3, 16, 16), atol=1e-5)
    # 30 x 60 -> 16 x 32, centre crop columns 8..23: the black / white border in the middle
    h = ds[1][0]
    assert torch.allclose(h[:, :, 0], ((0 - mean) / std).view(3, 1).expand(3, 16), atol=1e-5)
    assert torch.allclose(h[:, :, -1], ((1 - mean) / std).view(3, 1).expand(3, 16), atol=1e-5)
    grey_red = round(0.299 * 255) / 255  # ITU-R 601 luma of pure red
    assert torch.allclose(ds[2][0][:, 0, 0], (grey_red - mean) / std, atol=1e-5)
    rgb = VLPDataset([_rec(tmp_path / "red.png")], 16, colour="rgb")[0][0]
    assert torch.allclose(rgb[:, 0, 0], (torch.tensor([1.0, 0.0, 0.0]) - mean) / std, atol=1e-5)
    one = VLPDataset([_rec(tmp_path / "flat.png")], 8, channels=1)[0][0]
    assert one.shape == (1, 8, 8) and torch.allclose(one, torch.full((1, 8, 8), (128 / 255 - 0.449) / 0.226), atol=1e-4)


def test_dataset_augmentation_deterministic(tmp_path):
    g = (np.add.outer(np.arange(40), np.arange(48)) * 2).astype(np.uint8)
    Image.fromarray(g).save(tmp_path / "g.png")
    recs = [_rec(tmp_path / "g.png", "a"), _rec(tmp_path / "g.png", "b")]
    ds = VLPDataset(recs, 24, augment=True, seed=5)
    ds.set_epoch(0)
    a0, b0 = ds[0][0], ds[1][0]
    assert a0.shape == (3, 24, 24)
    assert torch.equal(a0, VLPDataset(recs, 24, augment=True, seed=5)[0][0])  # same (seed, epoch, index)
    assert not torch.equal(a0, b0)  # another index, another crop / rotation
    ds.set_epoch(1)
    assert not torch.equal(ds[0][0], a0)
    plain = VLPDataset(recs, 24)
    assert torch.equal(plain[0][0], plain[1][0])
    images, texts = collate_vlp([ds[0], ds[1]])
    assert images.shape == (2, 3, 24, 24) and texts == ["a", "b"]


def test_dataset_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="image_size"):
        VLPDataset([], 4)
    with pytest.raises(ValueError, match="channels"):
        VLPDataset([], 16, channels=1, colour="rgb")
    with pytest.raises(ValueError, match="colour"):
        VLPDataset([], 16, colour="color")
    ds = VLPDataset([_rec(tmp_path / "missing.png")], 16, site="s1")
    with pytest.raises(ValueError, match=r"s1.*missing\.png"):
        ds[0]
