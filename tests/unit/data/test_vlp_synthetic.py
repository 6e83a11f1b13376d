"""Synthetic FedDRA data: the writers' layouts are read by fedssl.data.vlp unchanged, reports name exactly the
findings drawn, the CheXpert file follows them, language follows the finding code (so LDA clients differ), retina
cameras differ and edema is visible, and everything is deterministic in the seed."""

import csv
import gzip
import re
import time

import numpy as np
import pytest
from PIL import Image

from fedssl.data.cxr import load_mimic_cxr
from fedssl.data.vlp import (
    COVIDX_CLASSES_V3,
    FEDDRA_FINDINGS,
    covidx_classes,
    finding_code,
    lda_client_split,
    load_brset,
    load_covidx,
    load_messidor2,
    load_mimic_vlp,
    load_rsna_pneumonia,
    mean_tv_distance,
    retina_caption,
)
from fedssl.data.vlp_synthetic import (
    DEVICE_SENTENCES,
    RETINA_CAMERAS,
    REPORT_TERMS,
    STYLES,
    _grade_and_edema,
    _retina,
    devices_named,
    write_synthetic_brset,
    write_synthetic_covidx,
    write_synthetic_messidor2,
    write_synthetic_mimic,
    write_synthetic_rsna,
)

from .files import tree_digests

CUE = re.compile(r"\b(no|not|without|negative for|free of|cannot exclude)\b", re.IGNORECASE)


def _mentions(text):
    """(findings stated as present, findings negated or uncertain): a sentence with a negation / uncertainty cue
    negates every finding it names (NegEx-like, on the terms every style may use)."""
    pos, neg = set(), set()
    for sent in re.split(r"(?<=\.)\s+", text):
        low = sent.lower()
        named = {f for f, terms in REPORT_TERMS.items() if any(t.lower() in low for t in terms)}
        (neg if CUE.search(sent) else pos).update(named)
    return pos, neg


def _chexpert(root):
    with gzip.open(root / "mimic-cxr-2.0.0-chexpert.csv.gz", "rt") as f:
        return {r["study_id"]: r for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def mimic(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic_mimic")
    return root, write_synthetic_mimic(root, n_patients=60, image_px=32, seed=3)


def test_mimic_layout_read_by_the_loader(mimic):
    root, s = mimic
    recs, counts = load_mimic_vlp(root, site="syn")
    assert counts["images"] == s["images"] == len(recs)
    assert counts["skipped_lateral"] == s["skipped_lateral"] > 0  # the LATERAL images are written and dropped
    assert counts["skipped_no_sections"] == s["skipped_no_sections"]
    assert counts["skipped_no_report"] == counts["skipped_no_labels"] == counts["skipped_other_view"] == 0
    assert counts["test"] > 0 and counts["train"] > 0
    lab = _chexpert(root)
    for r in recs:  # FedDRA labels: non-NaN -> 1
        assert r.labels == tuple(int(lab[r.study][f] != "") for f in FEDDRA_FINDINGS)
    with Image.open(recs[0].image) as im:
        assert im.size[1] == 32 and im.mode == "L"
    assert len(load_mimic_cxr(root, "all")) == s["images"] + s["skipped_no_sections"]  # the older loader reads it too


def test_reports_name_exactly_the_drawn_findings(mimic):
    root, s = mimic
    recs, _ = load_mimic_vlp(root)
    lab = _chexpert(root)
    assert len({r.study for r in recs}) == len(recs)
    negated_zero = 0
    for r in recs:
        drawn = {f for f in FEDDRA_FINDINGS if lab[r.study][f] == "1.0"}
        pos, neg = _mentions(r.text)
        assert pos == drawn, (r.text, drawn)
        for f in FEDDRA_FINDINGS:
            if lab[r.study][f] == "0.0":  # an explicit 0.0 is always a negated mention in the report
                assert f in neg, (r.text, f)
                negated_zero += 1
    assert negated_zero > 0
    assert sum(v == "1.0" for row in lab.values() for f, v in row.items() if f in FEDDRA_FINDINGS) == \
        sum(s["drawn"].values())


def test_chexpert_values_mostly_blank_for_absent_findings(mimic):
    root, s = mimic
    absent = [row[f] for row in _chexpert(root).values() for f in FEDDRA_FINDINGS if row[f] != "1.0"]
    assert set(absent) <= {"", "0.0", "-1.0"}
    assert absent.count("0.0") == s["explicit"]["0.0"] and absent.count("-1.0") == s["explicit"]["-1.0"]
    assert absent.count("0.0") / len(absent) < 0.1 and absent.count("") / len(absent) > 0.85
    assert sum(s["feddra_positive"].values()) == sum(s["drawn"].values()) + len(absent) - absent.count("")


def test_report_sections_and_headers_vary(mimic):
    root, s = mimic
    texts = [p.read_text() for p in (root / "files").rglob("s*.txt")]
    assert len(texts) == s["n_studies"]
    assert any("CONCLUSION:" in t for t in texts) and any("IMPRESSION:" in t for t in texts)
    assert any("FINDINGS:" not in t for t in texts) and any("IMPRESSION:" not in t and "CONCLUSION:" not in t
                                                          for t in texts)
    assert any(t.startswith("WET READ:") for t in texts)
    assert all("FINAL REPORT" in t for t in texts)
    assert sum(s["styles"].values()) == s["n_studies"] and len(s["styles"]) == len(STYLES)


def test_lda_clients_get_heterogeneous_language_and_writer_is_fast(tmp_path):
    t = time.perf_counter()
    s = write_synthetic_mimic(tmp_path, n_patients=200, image_px=64, seed=0)
    assert time.perf_counter() - t < 10.0
    assert s["skipped_no_sections"] > 0
    recs, _ = load_mimic_vlp(tmp_path)
    names = [st["name"] for st in STYLES]
    for seed in (0, 1, 2):
        tv = {}
        for alpha in (0.1, 100.0):
            parts = lda_client_split(recs, 5, alpha, seed)
            h = np.array([[sum(s["study_styles"][r.study] == n for r in p) for n in names] for p in parts])
            tv[alpha] = mean_tv_distance(h)
        assert tv[0.1] > tv[100.0] + 0.15, (seed, tv)


def test_style_coupling_ties_each_codes_studies_to_one_institution_or_none(tmp_path):
    """The heterogeneity knob: at 1 every study of a FedDRA code is in that code's preferred style; at 0 the style
    ignores the code; the default (0.7) writes the same data as before the knob existed."""
    def styles_per_code(root, coupling):
        s = write_synthetic_mimic(root, n_patients=150, image_px=16, seed=2, style_coupling=coupling)
        recs, _ = load_mimic_vlp(root, check_images=False)
        by_code = {}
        for r in recs:
            by_code.setdefault(finding_code(r.labels), set()).add(s["study_styles"][r.study])
        return s, by_code
    _, tight = styles_per_code(tmp_path / "one", 1.0)
    assert all(len(v) == 1 for v in tight.values())
    _, loose = styles_per_code(tmp_path / "zero", 0.0)
    assert sum(len(v) for v in loose.values()) > 2 * len(loose)
    a, _ = styles_per_code(tmp_path / "default", 0.7)
    b = write_synthetic_mimic(tmp_path / "plain", n_patients=150, image_px=16, seed=2)
    assert {k: v for k, v in a.items() if k != "root"} == {k: v for k, v in b.items() if k != "root"}
    for bad in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="style_coupling"):
            write_synthetic_mimic(tmp_path / "bad", n_patients=2, image_px=16, style_coupling=bad)


def test_devices_give_normal_studies_something_to_pair_by_and_change_nothing_else(tmp_path):
    """device_rate draws lines and tubes from a stream of their own: studies, findings, styles, splits and so the
    clients' split stay those of device_rate=0 (which writes what the writer wrote before); a study shows devices in
    its frontal image exactly when its report names them and CheXpert's Support Devices is 1.0."""
    a = write_synthetic_mimic(tmp_path / "a", n_patients=80, image_px=32, seed=2, style_coupling=1.0)
    b = write_synthetic_mimic(tmp_path / "b", n_patients=80, image_px=32, seed=2, style_coupling=1.0, device_rate=0.4)
    assert set(a["devices"].values()) == {0} and all(n > 0 for n in b["devices"].values())
    same = ("n_studies", "images", "splits", "styles", "drawn", "feddra_positive", "codes", "study_styles")
    assert {k: a[k] for k in same} == {k: b[k] for k in same}
    ca, cb = _chexpert(tmp_path / "a"), _chexpert(tmp_path / "b")
    assert all(r["Support Devices"] == "" for r in ca.values())
    recs_a = {r.study: r for r in load_mimic_vlp(tmp_path / "a", check_images=False)[0]}
    recs_b = {r.study: r for r in load_mimic_vlp(tmp_path / "b", check_images=False)[0]}
    assert recs_a.keys() == recs_b.keys() and all(recs_a[k].labels == recs_b[k].labels for k in recs_a)
    with_devices = 0
    for study, rec in recs_b.items():
        named = devices_named(rec.text)
        shown = cb[study]["Support Devices"] == "1.0"
        assert bool(named) == shown, study
        assert named == tuple(d for d in DEVICE_SENTENCES if d in named)  # in the table's order, each once
        same_image = Image.open(rec.image).tobytes() == Image.open(recs_a[study].image).tobytes()
        assert same_image != shown, study  # drawn exactly when named
        if not shown:
            assert rec.text == recs_a[study].text
        with_devices += shown
    assert 0 < with_devices < len(recs_b)
    for bad in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="device_rate"):
            write_synthetic_mimic(tmp_path / "bad", n_patients=2, image_px=16, device_rate=bad)


def test_devices_named_by_hand():
    ett, pm = DEVICE_SENTENCES["endotracheal tube"], DEVICE_SENTENCES["pacemaker"]
    wrapped = pm.replace(" with leads", "\n with leads")
    assert devices_named(f"FINDINGS: {wrapped} Lungs are clear. IMPRESSION: {ett}") == ("endotracheal tube",
                                                                                          "pacemaker")
    assert devices_named("FINDINGS: No acute process. Median sternotomy wires are intact.") == ()


def test_mimic_writer_deterministic(tmp_path):
    a = write_synthetic_mimic(tmp_path / "a", n_patients=12, image_px=16, seed=5)
    b = write_synthetic_mimic(tmp_path / "b", n_patients=12, image_px=16, seed=5)
    write_synthetic_mimic(tmp_path / "c", n_patients=12, image_px=16, seed=6)
    assert {k: v for k, v in a.items() if k != "root"} == {k: v for k, v in b.items() if k != "root"}
    da, db, dc = (tree_digests(tmp_path / x) for x in "abc")
    assert da == db and len(da) > 12
    assert da != dc


def test_mimic_writer_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="n_styles"):
        write_synthetic_mimic(tmp_path, n_patients=2, n_styles=len(STYLES) + 1)
    with pytest.raises(ValueError, match="image_px"):
        write_synthetic_mimic(tmp_path, n_patients=2, image_px=8)
    with pytest.raises(ValueError, match="studies_per_patient"):
        write_synthetic_mimic(tmp_path, n_patients=2, studies_per_patient=(2, 1))
    with pytest.raises(ValueError, match="n_patients"):
        write_synthetic_mimic(tmp_path, n_patients=0)


# ------------------------------------------------------------------------------------------------------ retina
def test_retina_writers_read_by_the_loaders(tmp_path):
    sm = write_synthetic_messidor2(tmp_path / "m", n_images=8, image_px=24, seed=1)
    sb = write_synthetic_brset(tmp_path / "b", n_images=8, image_px=24, seed=1)
    m, cm = load_messidor2(tmp_path / "m", site="site-1")
    b, cb = load_brset(tmp_path / "b", site="site-2")
    assert cm["images"] == sm["gradable"] and cm["skipped_ungradable"] == sm["ungradable"]
    assert cb["images"] == 8 and cb["patients"] == sb["n_patients"]
    assert [sum(r.labels[0] == g for r in m) for g in range(5)] == sm["grades"]
    assert [sum(r.labels[0] == g for r in b) for g in range(5)] == sb["grades"]
    assert sum(r.labels[1] for r in b) == sb["edema"]
    assert all(r.text == retina_caption(*r.labels) for r in m + b)
    rows = list(csv.DictReader(open(tmp_path / "m" / "messidor_data.csv")))
    assert {r["image_id"][-4:] for r in rows} == {".tif", ".JPG"}  # listed as released, stored re-encoded
    assert all(r.image.endswith(".png") for r in m)

    def brightness_and_field(recs):
        a = np.stack([np.asarray(Image.open(r.image).convert("RGB"), float) for r in recs])
        fundus = a.sum(-1) > 25
        return a[fundus].mean(), fundus.mean()

    (bm, fm), (bb, fb) = brightness_and_field(m), brightness_and_field(b)
    assert bm > 1.25 * bb and fm < fb - 0.04  # MESSIDOR's bright, narrower-field Topcon vs BRSET's cameras


def test_edema_drawn_as_macular_exudates():
    clean = _retina(np.random.default_rng(4), 2, 0, RETINA_CAMERAS["topcon"], 48, "right")
    oedema = _retina(np.random.default_rng(4), 2, 1, RETINA_CAMERAS["topcon"], 48, "right")
    diff = oedema - clean
    changed = np.abs(diff).sum(-1) > 0.05
    assert 5 < changed.sum() < 0.2 * changed.size  # a few small flecks
    assert diff[changed][:, 1].mean() > diff[changed][:, 2].mean()  # yellow: more green than blue added
    ys, xs = np.nonzero(changed)
    assert abs(ys.mean() - 24) < 10 and abs(xs.mean() - 30) < 12  # around the macula, near the centre


def test_edema_correlated_with_grade():
    rng = np.random.default_rng(0)
    draws = [_grade_and_edema(rng, (0.2,) * 5, "brset") for _ in range(3000)]
    rate = {g: np.mean([e for gg, e in draws if gg == g]) for g in range(5)}
    assert rate[0] < 0.03 and rate[1] < 0.1 and rate[2] > 0.15 and rate[4] > 0.4


def test_retina_writers_deterministic(tmp_path):
    for w in (write_synthetic_messidor2, write_synthetic_brset):
        w(tmp_path / f"{w.__name__}_a", n_images=3, image_px=16, seed=2)
        w(tmp_path / f"{w.__name__}_b", n_images=3, image_px=16, seed=2)
        assert tree_digests(tmp_path / f"{w.__name__}_a") == tree_digests(tmp_path / f"{w.__name__}_b")


# ------------------------------------------------------------------------------------------------- RSNA, COVIDx
def test_rsna_writer(tmp_path):
    s = write_synthetic_rsna(tmp_path / "r", n_images=20, image_px=24, seed=0)
    got = load_rsna_pneumonia(tmp_path / "r")
    assert len(got) == 20 and sum(t for _, t in got) == s["positives"] > 0
    assert s["rows"] > 20  # pneumonia patients have one row per box
    with Image.open(got[0][0]) as im:
        assert im.mode == "L" and im.size == (24, 24)
    write_synthetic_rsna(tmp_path / "r2", n_images=20, image_px=24, seed=0)
    assert tree_digests(tmp_path / "r") == tree_digests(tmp_path / "r2")


def test_covidx_writer(tmp_path):
    s = write_synthetic_covidx(tmp_path / "c", n_images=20, image_px=24, seed=0)
    assert covidx_classes(tmp_path / "c") == COVIDX_CLASSES_V3
    train, test = load_covidx(tmp_path / "c", "train"), load_covidx(tmp_path / "c", "test")
    assert (len(train), len(test)) == (s["train"], s["test"]) == (16, 4)
    assert sum(y for _, y in train) == s["positives"]["train"] and sum(y for _, y in test) == s["positives"]["test"]
    line = (tmp_path / "c" / "train.txt").read_text().splitlines()[0].split()
    assert len(line) == 4 and line[2] in ("positive", "negative") and line[3] in s["sources"]
    write_synthetic_covidx(tmp_path / "c2", n_images=20, image_px=24, seed=0)
    write_synthetic_covidx(tmp_path / "c3", n_images=20, image_px=24, seed=1)
    assert tree_digests(tmp_path / "c") == tree_digests(tmp_path / "c2") != tree_digests(tmp_path / "c3")
