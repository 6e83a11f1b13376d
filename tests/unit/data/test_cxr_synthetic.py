"""Synthetic CXR writers: every finding leaves its own visible mark, sources differ, arguments are checked.

(The writers' on-disk layouts are read back by the real loaders in test_cxr.py.)"""

import numpy as np
import pytest
import torch
from PIL import Image

from fedssl.data import cxr_synthetic
from fedssl.data.cxr import ALL_CLASSES, CHEXPERT_CLASSES, NIH_CLASSES, dataset_classes, load_cxr_site
from fedssl.data.cxr_synthetic import (render_cxr, write_synthetic_mimic_cxr, write_synthetic_nih,
                                       write_synthetic_surgical)
from fedssl.eval.auroc import auroc


def _noiseless(monkeypatch, source):
    """Sources without noise, one patient's anatomy and its image without findings (generator seed 1)."""
    quiet = {k: dict(v, noise=0.0) for k, v in cxr_synthetic.SOURCES.items()}
    monkeypatch.setattr(cxr_synthetic, "SOURCES", quiet)
    anatomy = cxr_synthetic._anatomy(np.random.default_rng(0))
    return anatomy, render_cxr([], np.random.default_rng(1), 64, source, anatomy).astype(int)


def test_every_finding_leaves_a_visible_mark(monkeypatch):
    anatomy, base = _noiseless(monkeypatch, "nih")
    marks = {}
    for c in ALL_CLASSES:
        img = render_cxr([c], np.random.default_rng(1), 64, "nih", anatomy).astype(int)
        changed = np.abs(img - base) > 20
        assert changed.sum() >= 6, f"{c} leaves no visible mark"
        marks[c] = changed
    # marks differ between classes (not all the same pixels)
    sigs = {c: m.tobytes() for c, m in marks.items()}
    assert len(set(sigs.values())) == len(ALL_CLASSES)


def test_every_device_leaves_its_own_mark_on_a_frontal_view_only(monkeypatch):
    """Devices are drawn without a draw from the generator: the image around them is the one without them."""
    anatomy, base = _noiseless(monkeypatch, "mimic")
    marks = {}
    for d in cxr_synthetic.DEVICES:
        rng = np.random.default_rng(1)
        img = render_cxr([], rng, 64, "mimic", anatomy, devices=[d]).astype(int)
        changed = np.abs(img - base) > 20
        assert changed.sum() >= 10, f"{d} leaves no visible mark"
        assert changed.mean() < 0.1  # the rest of the image is the one without it
        marks[d] = changed.tobytes()
        # the generator is left where an image without devices leaves it
        assert rng.random() == pytest.approx(_after_plain_render(anatomy))
    assert len(set(marks.values())) == len(cxr_synthetic.DEVICES)
    lateral = render_cxr([], np.random.default_rng(1), 64, "mimic", anatomy, frontal=False)
    assert np.array_equal(render_cxr([], np.random.default_rng(1), 64, "mimic", anatomy, frontal=False,
                                     devices=list(cxr_synthetic.DEVICES)), lateral)
    with pytest.raises(ValueError, match="devices"):
        render_cxr([], np.random.default_rng(0), devices=["stent"])


def _after_plain_render(anatomy) -> float:
    rng = np.random.default_rng(1)
    render_cxr([], rng, 64, "mimic", anatomy)
    return rng.random()


def test_sources_look_different():
    a = render_cxr([], np.random.default_rng(0), 48, "nih").astype(float)
    b = render_cxr([], np.random.default_rng(0), 48, "chexpert").astype(float)
    assert b.shape == (48, 41)  # CheXpert-like aspect
    assert abs(a.mean() - b.mean()) > 3


def test_patient_anatomy_shared_across_images(tmp_path):
    write_synthetic_nih(tmp_path / "n", n_patients=2, seed=0, image_size=32, prevalence=0.0, unlabelled_prevalence=0.0)
    imgs = sorted((tmp_path / "n" / "images").iterdir())
    arr = {p.name: np.asarray(Image.open(p), dtype=float) for p in imgs}
    same = [a for n, a in arr.items() if n.startswith("00000001_")]
    other = [a for n, a in arr.items() if n.startswith("00000002_")]
    assert len(same) > 1  # (seed 0) two images of patient 1: only the noise differs between them
    assert np.abs(same[0] - same[1]).mean() < np.abs(same[0] - other[0]).mean()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="variant"):
        write_synthetic_nih(tmp_path / "never", variant="2019")
    with pytest.raises(ValueError, match="prevalence"):
        write_synthetic_nih(tmp_path / "never", prevalence=1.5)
    with pytest.raises(ValueError, match="split_fractions"):
        write_synthetic_mimic_cxr(tmp_path / "never", split_fractions=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="not classes"):
        render_cxr(["Flu"], np.random.default_rng(0))
    assert not (tmp_path / "never").exists()  # checked before anything is written


def test_findings_are_learnable_by_a_linear_model():
    """Logistic regression on raw 32 px pixels, 400 training images: the marks carry the labels."""
    rng = np.random.default_rng(0)
    n, n_train = 600, 400
    y = rng.random((n, len(ALL_CLASSES))) < 0.2
    x = np.stack([render_cxr([c for c, on in zip(ALL_CLASSES, y[i]) if on], rng, 32, "nih") for i in range(n)])
    x = torch.tensor(x.reshape(n, -1) / 255.0, dtype=torch.float32)
    x = (x - x[:n_train].mean(0)) / (x[:n_train].std(0) + 1e-3)
    yt = torch.tensor(y, dtype=torch.float32)
    torch.manual_seed(0)
    lin = torch.nn.Linear(x.shape[1], len(ALL_CLASSES))
    opt = torch.optim.Adam(lin.parameters(), lr=1e-2, weight_decay=1e-3)
    for _ in range(200):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(lin(x[:n_train]), yt[:n_train])
        opt.zero_grad()
        loss.backward()
        opt.step()
    scores = lin(x[n_train:]).detach().numpy()
    per_class = [auroc(scores[:, j], y[n_train:, j]) for j in range(len(ALL_CLASSES))]
    assert np.mean(per_class) > 0.75 and min(per_class) > 0.5


def test_surgical_layout_and_unlabelled_findings(tmp_path):
    info = write_synthetic_surgical(tmp_path, n_patients=6, seed=0, image_size=32)
    nih = load_cxr_site(tmp_path / "site-1", "nih", site="site-1")
    chex = load_cxr_site(tmp_path / "site-2", "chexpert", site="site-2")
    ext = load_cxr_site(tmp_path / "mimic", "mimic", split="all", site="mimic")
    assert (len(nih), len(chex), len(ext)) == (info["site-1"]["n_images"], info["site-2"]["n_images"],
                                              info["mimic"]["n_images"])
    assert {c for r in nih for c in r.labels} <= set(NIH_CLASSES)
    assert {c for r in chex for c in r.labels} <= set(CHEXPERT_CLASSES)
    assert dataset_classes("mimic", tmp_path / "mimic") == list(ALL_CLASSES)
    # a source shows findings it does not label: same seed, only the unlabelled prevalence differs
    a = write_synthetic_nih(tmp_path / "a", n_patients=3, seed=1, image_size=32, prevalence=0.0,
                            unlabelled_prevalence=0.0)
    b = write_synthetic_nih(tmp_path / "b", n_patients=3, seed=1, image_size=32, prevalence=0.0,
                            unlabelled_prevalence=1.0)
    assert a["positives"] == b["positives"] == {c: 0 for c in NIH_CLASSES}
    assert (tmp_path / "a" / "Data_Entry_2017_v2020.csv").read_text().count("No Finding") == a["n_images"]
    assert (tmp_path / "b" / "Data_Entry_2017_v2020.csv").read_text().count("No Finding") == b["n_images"]
    name = sorted((tmp_path / "a" / "images").iterdir())[0].name
    ia = np.asarray(Image.open(tmp_path / "a" / "images" / name), dtype=float)
    ib = np.asarray(Image.open(tmp_path / "b" / "images" / name), dtype=float)
    assert (np.abs(ia - ib) > 60).sum() > 20  # devices, fractures ... drawn but not labelled
