"""Synthetic stand-ins for FedDRA's data, written in the real layouts that :mod:`fedssl.data.vlp` reads unchanged.

No real MIMIC-CXR, MESSIDOR-2, BRSET, RSNA or COVIDx data can be downloaded here; these writers produce small
sets with the structure FedDRA (Distributionally Robust Alignment for Medical Federated Vision-Language
Pre-training Under Data Heterogeneity, TMLR) relies on:

* :func:`write_synthetic_mimic` - MIMIC-CXR + MIMIC-CXR-JPG: per study a set of the 5 FedDRA findings drawn with
  realistic prevalence and co-occurrence (edema with pleural effusion, pneumonia with consolidation, about half
  the studies with none), one frontal image drawn by :func:`fedssl.data.cxr_synthetic.render_cxr` showing
  exactly those findings (the renderer uses the same finding names, so "Pleural Effusion" is its fluid level at
  a lung base, "Pneumothorax" its dark crescent ...), for ~10 % of studies an extra LATERAL image the loader
  drops, and a free-text report whose FINDINGS / IMPRESSION name the drawn findings and negate some absent ones.
  Language is heterogeneous: ``n_styles`` institution styles (:data:`STYLES`) differ in synonyms ("pleural
  effusion" / "pleural fluid" / "effusion", "consolidation" / "airspace opacity" ...), sentence templates,
  section headers (IMPRESSION / CONCLUSION, inline or not, WET READ preambles) and which sections they write
  (some mostly findings-only, one mostly impression-only); ~3 % of reports have neither section (the loader
  skips and counts them).  A study's style - and with it the renderer's acquisition ``source`` - is drawn
  from a preferred style of its FedDRA finding code with probability 0.7, so an LDA split over the code gives
  clients different language and image appearance.
  The CheXpert label file carries 1.0 for every drawn finding; an absent finding is mostly blank (NaN), but
  ~4 % are 0.0 (always one the report negates, as the real CheXpert labeler writes 0.0 for a negated mention)
  and ~2 % -1.0 (the report says "Cannot exclude ..."; the labeler's "uncertain").  FedDRA's split rule turns
  every non-NaN value into 1, so those rare explicit values make a study's code differ from its drawn findings;
  explicit 0.0 is kept rare here (the real labeler would write it for every negation) so that the code stays
  close to the visible findings.  The style is chosen from that FedDRA code (what the loader and the LDA split
  see).
* :func:`write_synthetic_messidor2` / :func:`write_synthetic_brset` - fundus photographs from
  :func:`fedssl.data.image_synthetic.render` (retina: grade-dependent lesions) through a different camera per
  source (MESSIDOR's Topcon; BRSET's Canon and Nikon), edema risk correlated with the grade and drawn as a ring
  of hard exudates around the macula.
* :func:`write_synthetic_rsna` / :func:`write_synthetic_covidx` - the out-of-distribution probe sets: chest
  radiographs from the COVID-FL renderer of :mod:`fedssl.data.image_synthetic` (another anatomy model and
  other acquisitions than the MIMIC stand-in), pneumonia = a lobar consolidation, COVID-19 = bilateral
  peripheral ground-glass opacities.

Everything is deterministic in ``seed`` (gzip headers carry no time stamp).
"""

from __future__ import annotations

import csv
import gzip
import io
import os
import textwrap
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image

from fedssl.core.checks import require, require_int
from fedssl.data.cxr import MIMIC_LABELS, MIMIC_METADATA, MIMIC_SPLIT
from fedssl.data.cxr_synthetic import DEVICES, _anatomy, render_cxr
from fedssl.data.image_synthetic import render, save_image
from fedssl.data.vlp_segmentation import RSNA_FRAME
from fedssl.data.vlp import BRSET_CSVS, FEDDRA_FINDINGS, MESSIDOR2_CSV, N_CODES, finding_code

__all__ = [
    "STYLES",
    "DEVICE_SENTENCES",
    "devices_named",
    "REPORT_TERMS",
    "CHEXPERT_COLUMNS",
    "MESSIDOR2_GRADE_MIX",
    "BRSET_GRADE_MIX",
    "RETINA_CAMERAS",
    "write_synthetic_mimic",
    "write_synthetic_messidor2",
    "write_synthetic_brset",
    "write_synthetic_rsna",
    "write_synthetic_covidx",
]

#: MIMIC-CXR-JPG's chexpert label columns (after subject_id, study_id), in the release's order
CHEXPERT_COLUMNS = ("Atelectasis", "Cardiomegaly", "Consolidation", "Edema", "Enlarged Cardiomediastinum", "Fracture",
                    "Lung Lesion", "Lung Opacity", "No Finding", "Pleural Effusion", "Pleural Other", "Pneumonia",
                    "Pneumothorax", "Support Devices")
METADATA_COLUMNS = ("dicom_id", "subject_id", "study_id", "PerformedProcedureStepDescription", "ViewPosition", "Rows",
                    "Columns", "StudyDate", "StudyTime", "ProcedureCodeSequence_CodeMeaning",
                    "ViewCodeSequence_CodeMeaning", "PatientOrientationCodeSequence_CodeMeaning")

#: severity words per finding ("" = none)
_SEVERITY = {
    "Edema": ("mild", "moderate", "", "mild interstitial"),
    "Pleural Effusion": ("small", "moderate", "large", "small bilateral", ""),
    "Consolidation": ("patchy", "focal", "", "dense"),
    "Pneumothorax": ("small", "tiny", "moderate", ""),
    "Pneumonia": ("", "likely", "early"),
}

#: Institution styles: synonyms per finding, sentence templates, headers, section habits and the acquisition
#: ``source`` of :func:`fedssl.data.cxr_synthetic.render_cxr` their images come from.  Positive templates use no
#: negation cue; negative ones always one ("no", "without", "negative for", "free of").
STYLES: tuple[dict, ...] = (
    {"name": "academic", "source": "mimic",
     "terms": {"Edema": ("pulmonary edema", "interstitial pulmonary edema"), "Pleural Effusion": ("pleural effusion",),
               "Consolidation": ("consolidation",), "Pneumothorax": ("pneumothorax",), "Pneumonia": ("pneumonia",)},
     "positive": ("There is {sev} {term}.", "{Sev} {term} is present."),
     "negative": ("There is no {term}.", "No {term} is seen."), "negative_list": "There is no {terms}.",
     "clear": "The lungs are clear.", "findings": "FINDINGS", "impression": "IMPRESSION", "inline": False,
     "p_findings": 1.0, "p_impression": 0.95, "p_negate": 0.7,
     "impression_positive": ("{Terms}.",), "impression_normal": ("No acute cardiopulmonary process.",),
     "preamble": ("EXAMINATION", "INDICATION", "TECHNIQUE", "COMPARISON"), "wet_read": False},
    {"name": "community", "source": "nih",
     "terms": {"Edema": ("vascular congestion and edema", "interstitial edema"),
               "Pleural Effusion": ("pleural fluid", "layering pleural fluid"), "Consolidation": ("airspace opacity",),
               "Pneumothorax": ("pleural air", "pneumothorax"), "Pneumonia": ("infectious process",)},
     "positive": ("{Sev} {term} noted.", "Findings show {sev} {term}."),
     "negative": ("No {term}.",), "negative_list": "No {terms}.",
     "clear": "Clear lungs.", "findings": "FINDINGS", "impression": "CONCLUSION", "inline": True,
     "p_findings": 1.0, "p_impression": 0.6, "p_negate": 0.5,
     "impression_positive": ("Findings compatible with {terms}.",), "impression_normal": ("No acute findings.",),
     "preamble": ("INDICATION", "COMPARISON"), "wet_read": False},
    {"name": "terse", "source": "chexpert",
     "terms": {"Edema": ("edema",), "Pleural Effusion": ("effusion",), "Consolidation": ("airspace disease",),
               "Pneumothorax": ("pneumothorax",), "Pneumonia": ("pneumonia",)},
     "positive": ("{Sev} {term}.", "{Term}."),
     "negative": ("Without {term}.", "No {term}."), "negative_list": "Without {terms}.",
     "clear": "Lungs clear.", "findings": "FINDINGS", "impression": "IMPRESSION", "inline": True,
     "p_findings": 1.0, "p_impression": 0.3, "p_negate": 0.4,
     "impression_positive": ("{Terms}.",), "impression_normal": ("Normal chest.",),
     "preamble": ("EXAMINATION",), "wet_read": False},
    {"name": "british", "source": "mimic",
     "terms": {"Edema": ("pulmonary oedema", "oedema"), "Pleural Effusion": ("pleural effusion", "effusion"),
               "Consolidation": ("consolidation",), "Pneumothorax": ("pneumothorax",),
               "Pneumonia": ("chest infection",)},
     "positive": ("Appearances in keeping with {sev} {term}.", "{Sev} {term} is demonstrated."),
     "negative": ("No evidence of {term}.",), "negative_list": "No evidence of {terms}.",
     "clear": "The lungs are clear.", "findings": "FINDINGS", "impression": "IMPRESSION", "inline": False,
     "p_findings": 0.15, "p_impression": 1.0, "p_negate": 0.6,
     "impression_positive": ("Appearances in keeping with {terms}.",),
     "impression_normal": ("Normal appearances.",),
     "preamble": ("CLINICAL HISTORY", "COMPARISON"), "wet_read": False},
    {"name": "emergency", "source": "nih",
     "terms": {"Edema": ("interstitial edema", "pulmonary edema"), "Pleural Effusion": ("pleural effusion",),
               "Consolidation": ("airspace opacity", "consolidation"), "Pneumothorax": ("pneumothorax",),
               "Pneumonia": ("pneumonia",)},
     "positive": ("Evidence of {sev} {term}.", "{Sev} {term} has developed."),
     "negative": ("Negative for {term}.", "Free of {term}."), "negative_list": "Negative for {terms}.",
     "clear": "The lungs are well expanded and clear.", "findings": "FINDINGS", "impression": "IMPRESSION",
     "inline": True, "p_findings": 0.9, "p_impression": 0.9, "p_negate": 0.8,
     "impression_positive": ("{Terms}, new since the prior study.", "{Terms}."),
     "impression_normal": ("No acute intrathoracic abnormality.",),
     "preamble": ("REASON FOR EXAMINATION", "TECHNIQUE"), "wet_read": True},
)
#: every phrase a report may use for each finding (over all styles), for checks of the generated text
REPORT_TERMS: dict[str, tuple[str, ...]] = {
    f: tuple(sorted({t for s in STYLES for t in s["terms"][f]})) for f in FEDDRA_FINDINGS}
_FILLER = ("The cardiomediastinal silhouette is normal.", "Heart size is normal.", "Osseous structures are "
           "unremarkable.", "The hilar contours are within normal limits.", "Median sternotomy wires are intact.",
           "Mild degenerative changes of the thoracic spine.")
_INDICATION = ("___M with shortness of breath.", "___F with fever and cough, eval for pneumonia.",
               "___-year-old with chest pain.", "___M with hypoxia.", "___F status post line placement.")
_P_STYLE_PREFERRED = 0.7
#: what a report says of each device :func:`fedssl.data.cxr_synthetic.render_cxr` draws (as MIMIC-CXR's reports
#: do, whatever the findings: a study without any finding still differs from the next by its lines and tubes)
DEVICE_SENTENCES = {
    "endotracheal tube": "Endotracheal tube terminates about 4 cm above the carina.",
    "enteric tube": "An enteric tube courses below the diaphragm with the tip out of view.",
    "right jugular line": "Right internal jugular central venous catheter terminates in the mid SVC.",
    "pacemaker": "Left chest wall pacemaker with leads in the right atrium and right ventricle.",
}


def devices_named(text: str) -> tuple[str, ...]:
    """The devices (:data:`DEVICE_SENTENCES` keys, in their order) a synthetic report names: what a study's image and
    its report share besides the findings and the style."""
    flat = " ".join(text.split())  # a report's lines wrap anywhere
    return tuple(d for d, sentence in DEVICE_SENTENCES.items() if " ".join(sentence.split()) in flat)


_P_NO_SECTIONS = 0.03
_P_LATERAL = 0.10
_P_VALIDATE = 0.05
_P_ZERO, _P_UNCERTAIN = 0.04, 0.02


# --------------------------------------------------------------------------------------------------- helpers
def _write_csv(path: Path, header: Sequence[str], rows: Sequence[Sequence[str]], gz: bool = False) -> None:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    data = buf.getvalue().encode("utf-8")
    if gz:
        with open(path, "wb") as raw, gzip.GzipFile(filename=path.name[:-3], mode="wb", fileobj=raw, mtime=0) as f:
            f.write(data)
    else:
        path.write_bytes(data)


def _check_px(image_px: int) -> None:
    require_int("vlp_synthetic", "image_px", image_px, 16, "use an integer >= 16 (e.g. 64)")


def _choice(rng: np.random.Generator, seq: Sequence):
    return seq[int(rng.integers(0, len(seq)))]


def _ids(rng: np.random.Generator, n: int, base: int, span: int) -> list[int]:
    """``n`` distinct increasing ids in ``[base, base + span)``: stride cells with a random offset each."""
    stride = max(1, span // max(n, 1))
    return [base + i * stride + int(rng.integers(0, stride)) for i in range(n)]


# ----------------------------------------------------------------------------------------------- MIMIC reports
def _draw_findings(rng: np.random.Generator) -> list[str]:
    """Findings of one study: edema 18 % (with effusion 55 %, else 15 %), consolidation 10 % (with pneumonia 45 %,
    else 7 %), pneumothorax 5 %; about half the studies have none."""
    edema = rng.random() < 0.18
    eff = rng.random() < (0.55 if edema else 0.15)
    cons = rng.random() < 0.10
    pna = rng.random() < (0.45 if cons else 0.07)
    ptx = rng.random() < 0.05
    got = {"Edema": edema, "Pleural Effusion": eff, "Consolidation": cons, "Pneumothorax": ptx, "Pneumonia": pna}
    return [f for f in FEDDRA_FINDINGS if got[f]]


def _join(terms: Sequence[str], conj: str) -> str:
    return terms[0] if len(terms) == 1 else ", ".join(terms[:-1]) + f" {conj} " + terms[-1]


def _cap(s: str) -> str:
    s = " ".join(s.split())
    return s[:1].upper() + s[1:]


def _sentence(template: str, term: str, sev: str) -> str:
    out = template.replace("{Sev} {term}", _cap(f"{sev} {term}")).replace("{sev} {term}", f"{sev} {term}")
    out = out.replace("{Term}", _cap(term)).replace("{term}", term)
    return _cap(out)


def _wrap(text: str) -> str:
    return "\n".join(" " + ln for ln in textwrap.wrap(text, 74))


def _section(name: str, body: str, inline: bool) -> str:
    if inline:
        return _wrap(f"{name}:  {body}")
    return f" {name}:\n \n{_wrap(body)}"


def _report(rng: np.random.Generator, style: dict, drawn: Sequence[str], values: dict[str, str],
            no_sections: bool, devices: Sequence[str] = ()) -> tuple[str, bool, bool]:
    """(report text, has findings, has impression); ``values`` = the CheXpert value of every FedDRA finding;
    ``devices`` open the findings (or close the impression when there are no findings), with no draw from ``rng``:
    a report without devices is the one written before they existed."""
    term = {f: _choice(rng, style["terms"][f]) for f in FEDDRA_FINDINGS}
    head = []
    if style["wet_read"]:
        head.append(f"WET READ: ___ ___ {int(rng.integers(1, 12))}:{int(rng.integers(10, 60))} PM")
        head.append(_wrap(f"{_cap(_join([term[f] for f in drawn], 'and')) if drawn else 'No acute process'}."))
    head.append(" " * 33 + "FINAL REPORT")
    pre = {"EXAMINATION": "CHEST (PA AND LAT)", "INDICATION": _choice(rng, _INDICATION),
           "TECHNIQUE": "Chest PA and lateral", "COMPARISON": _choice(rng, ("None.", "___", "Prior study from ___.")),
           "CLINICAL HISTORY": _choice(rng, _INDICATION), "REASON FOR EXAMINATION": _choice(rng, _INDICATION)}
    blocks = [_wrap(f"{h}:  {pre[h]}") for h in style["preamble"]]
    if no_sections:
        blocks.append(_wrap("NOTIFICATION:  The findings were discussed with Dr. ___ by telephone at ___."))
        return "\n".join(head) + "\n" + "\n \n".join(blocks) + "\n", False, False
    absent = [f for f in FEDDRA_FINDINGS if f not in drawn]
    negated = [f for f in absent if values[f] == "0.0" or (values[f] == "" and rng.random() < style["p_negate"])]
    sents = [_sentence(_choice(rng, style["positive"]), term[f], _choice(rng, _SEVERITY[f])) for f in drawn]
    sents += [f"Cannot exclude {term[f]}." for f in absent if values[f] == "-1.0"]
    if negated:
        if len(negated) > 1 and rng.random() < 0.6:
            sents.append(_cap(style["negative_list"].replace("{terms}", _join([term[f] for f in negated], "or"))))
        else:
            sents += [_sentence(_choice(rng, style["negative"]), term[f], "") for f in negated]
    if not drawn and rng.random() < 0.8:
        sents.insert(0, style["clear"])
    order = rng.permutation(len(sents))
    sents = [DEVICE_SENTENCES[d] for d in devices] + [sents[i] for i in order]
    sents += [_FILLER[i] for i in sorted(rng.choice(len(_FILLER), size=int(rng.integers(0, 3)), replace=False))]
    has_f = rng.random() < style["p_findings"]
    has_i = rng.random() < style["p_impression"]
    if not (has_f or has_i):
        has_f, has_i = style["p_findings"] >= style["p_impression"], style["p_findings"] < style["p_impression"]
    if has_f:
        blocks.append(_section(style["findings"], " ".join(sents), style["inline"]))
    if has_i:
        if drawn:
            names = _join([term[f] for f in drawn], "and")
            imp = _choice(rng, style["impression_positive"]).replace("{Terms}", _cap(names)).replace("{terms}", names)
        else:
            imp = _choice(rng, style["impression_normal"])
        if not has_f and absent and negated:  # an impression-only report still states the key negatives
            imp += " " + _cap(style["negative_list"].replace("{terms}", _join([term[f] for f in negated], "or")))
        if not has_f:
            imp += "".join(f" Cannot exclude {term[f]}." for f in absent if values[f] == "-1.0")
            imp += "".join(f" {DEVICE_SENTENCES[d]}" for d in devices)
        blocks.append(_section(style["impression"], imp, style["inline"]))
    return "\n".join(head) + "\n" + "\n \n".join(blocks) + "\n", has_f, has_i


def _label_value(rng: np.random.Generator) -> str:
    """An absent finding's CheXpert value: blank (NaN) mostly, rarely 0.0 (negated) or -1.0 (uncertain)."""
    u = rng.random()
    return "0.0" if u < _P_ZERO else ("-1.0" if u < _P_ZERO + _P_UNCERTAIN else "")


def write_synthetic_mimic(out: object, n_patients: int = 200, studies_per_patient: tuple[int, int] = (1, 2),
                          image_px: int = 64, seed: int = 0, test_fraction: float = 0.2, n_styles: int = 5,
                          style_coupling: float = _P_STYLE_PREFERRED, device_rate: float = 0.0) -> dict:
    """MIMIC-CXR (reports) + MIMIC-CXR-JPG (images, the three ``mimic-cxr-2.0.0-*.csv.gz``) under ``out``.

    Args:
        out: the root (``files/`` and the CSVs; the reports are ``files/pNN/pNNNNNNNN/sNNNNNNNN.txt`` in it).
        n_patients: patients; each has ``studies_per_patient`` = (min, max) studies (uniform).
        image_px: image height in pixels (the "chexpert" acquisition is narrower: aspect 0.85).
        seed: everything is drawn from ``np.random.default_rng([seed, 17])``.
        test_fraction: share of patients in the official "test" split (exact, rounded); ~5 % of the others
            are "validate".
        n_styles: institution styles used, the first ``n_styles`` of :data:`STYLES` (1-5).
        style_coupling: probability that a study is written (and acquired) in its FedDRA code's preferred style,
            else in a uniformly drawn one (default 0.7).  Clients cut by LDA over the codes then differ in language
            and acquisition as much as this couples style to code: the data's heterogeneity knob, to be calibrated
            on FedAvg alone (issue 44, H6); 1 makes every code's studies one institution's.
        device_rate: probability of each of :data:`fedssl.data.cxr_synthetic.DEVICES` in a study (independently),
            drawn in the frontal image and named in the report (CheXpert "Support Devices" 1.0), from a generator
            of their own: the studies, findings, styles and so the clients' split are those of ``device_rate=0``
            (the default, which writes exactly what the writer wrote before devices existed).  Without devices a
            study with no finding shares nothing with its report but the style, so a client of normal studies
            can only retrieve at chance; with them its pairs differ as real ones do.

    Returns:
        summary dict: ``root``, ``n_patients``, ``n_studies``, ``images`` (frontal images with a FINDINGS or
        IMPRESSION section: what :func:`fedssl.data.vlp.load_mimic_vlp` keeps), ``skipped_no_sections``,
        ``skipped_lateral`` (as the loader counts them), ``splits`` (studies per official split), ``styles`` and
        ``sources`` (studies per style / acquisition), ``drawn`` (studies showing each finding), ``feddra_positive``
        (studies whose FedDRA label is 1), ``explicit`` (absent findings written 0.0 / -1.0), ``codes`` (studies per
        FedDRA code), ``study_styles`` (study id -> style name) and ``devices`` (studies showing each device).
    """
    require_int("write_synthetic_mimic", "n_patients", n_patients, 1, "use a positive number of patients")
    _check_px(image_px)
    spp = tuple(studies_per_patient)
    require(len(spp) == 2 and all(isinstance(x, int) for x in spp) and 1 <= spp[0] <= spp[1],
            "write_synthetic_mimic", "studies_per_patient", studies_per_patient, "use (min, max) with 1 <= min <= max")
    require(isinstance(test_fraction, (int, float)) and 0.0 <= test_fraction < 1.0, "write_synthetic_mimic",
            "test_fraction", test_fraction, "use a fraction in [0, 1), e.g. 0.2")
    require_int("write_synthetic_mimic", "n_styles", n_styles, 1, f"use 1 to {len(STYLES)} styles")
    require(n_styles <= len(STYLES), "write_synthetic_mimic", "n_styles", n_styles, f"use 1 to {len(STYLES)} styles")
    require(isinstance(style_coupling, (int, float)) and not isinstance(style_coupling, bool)
            and 0.0 <= style_coupling <= 1.0, "write_synthetic_mimic", "style_coupling", style_coupling,
            "use a probability in [0, 1], e.g. 0.7 (the default)")
    require(isinstance(device_rate, (int, float)) and not isinstance(device_rate, bool)
            and 0.0 <= device_rate <= 1.0, "write_synthetic_mimic", "device_rate", device_rate,
            "use a probability in [0, 1], e.g. 0.3, or 0 for no devices (the default)")
    rp = Path(os.fspath(out))
    rp.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 17])
    device_rng = np.random.default_rng([seed, 17, 1])  # its own stream: devices change nothing else
    styles = STYLES[:n_styles]
    preferred = rng.integers(0, n_styles, size=N_CODES)  # each FedDRA code's preferred style
    n_studies = rng.integers(spp[0], spp[1] + 1, size=n_patients)
    subjects = _ids(rng, n_patients, 10_000_000, 89_999_999)
    studies = _ids(rng, int(n_studies.sum()), 50_000_000, 49_999_999)
    studies = [studies[i] for i in rng.permutation(len(studies))]
    n_test = int(round(test_fraction * n_patients))
    test = set(rng.permutation(n_patients)[:n_test].tolist())
    lab_rows, split_rows, meta_rows = [], [], []
    summary = {"root": str(rp), "n_patients": n_patients, "n_studies": 0, "images": 0, "skipped_no_sections": 0,
               "skipped_lateral": 0, "splits": {"train": 0, "validate": 0, "test": 0},
               "styles": {s["name"]: 0 for s in styles}, "sources": {}, "drawn": {f: 0 for f in FEDDRA_FINDINGS},
               "feddra_positive": {f: 0 for f in FEDDRA_FINDINGS}, "explicit": {"0.0": 0, "-1.0": 0},
               "codes": [0] * N_CODES, "study_styles": {}, "devices": {d: 0 for d in DEVICES}}
    k = 0
    for i, subject in enumerate(subjects):
        an = _anatomy(rng)
        split = "test" if i in test else ("validate" if rng.random() < _P_VALIDATE else "train")
        for _ in range(int(n_studies[i])):
            study = studies[k]
            k += 1
            drawn = _draw_findings(rng)
            values = {f: ("1.0" if f in drawn else _label_value(rng)) for f in FEDDRA_FINDINGS}
            code = finding_code([int(values[f] != "") for f in FEDDRA_FINDINGS])
            s_idx = int(preferred[code]) if rng.random() < style_coupling else int(rng.integers(0, n_styles))
            style = styles[s_idx]
            no_sections = rng.random() < _P_NO_SECTIONS
            devices = [d for d in DEVICES if device_rng.random() < device_rate] if device_rate else []
            text, _, _ = _report(rng, style, drawn, values, no_sections, devices)
            folder = rp / "files" / f"p{str(subject)[:2]}" / f"p{subject}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"s{study}.txt").write_text(text, encoding="utf-8")
            row = {c: "" for c in CHEXPERT_COLUMNS}
            row.update(values)
            row["No Finding"] = "" if drawn else "1.0"
            row["Lung Opacity"] = "1.0" if {"Consolidation", "Pneumonia", "Edema"} & set(drawn) else ""
            row["Support Devices"] = "1.0" if devices else ""
            lab_rows.append([str(subject), str(study)] + [row[c] for c in CHEXPERT_COLUMNS])
            views = [_choice(rng, ("PA", "AP"))] + (["LATERAL"] if rng.random() < _P_LATERAL else [])
            for view in views:
                dicom = "-".join(f"{int(rng.integers(0, 2 ** 32)):08x}" for _ in range(5))
                img = render_cxr(drawn, rng, image_px, style["source"], an, frontal=view != "LATERAL",
                                 devices=devices)
                path = folder / f"s{study}" / f"{dicom}.jpg"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(img).save(path, quality=95)
                split_rows.append([dicom, str(study), str(subject), split])
                meta_rows.append([dicom, str(subject), str(study), "CHEST (PA AND LAT)", view, str(img.shape[0]),
                                  str(img.shape[1]), "21800506", "213014.531", "Chest 2V",
                                  {"PA": "postero-anterior", "AP": "antero-posterior"}.get(view, "lateral"), "Erect"])
                if view == "LATERAL":
                    summary["skipped_lateral"] += 1
                else:
                    summary["skipped_no_sections" if no_sections else "images"] += 1
            summary["n_studies"] += 1
            summary["splits"][split] += 1
            summary["styles"][style["name"]] += 1
            summary["sources"][style["source"]] = summary["sources"].get(style["source"], 0) + 1
            summary["codes"][code] += 1
            summary["study_styles"][str(study)] = style["name"]
            for d in devices:
                summary["devices"][d] += 1
            for f in FEDDRA_FINDINGS:
                summary["drawn"][f] += f in drawn
                summary["feddra_positive"][f] += values[f] != ""
                if values[f] in ("0.0", "-1.0"):
                    summary["explicit"][values[f]] += 1
    _write_csv(rp / (MIMIC_LABELS + ".gz"), ("subject_id", "study_id") + CHEXPERT_COLUMNS, lab_rows, gz=True)
    _write_csv(rp / (MIMIC_SPLIT + ".gz"), ("dicom_id", "study_id", "subject_id", "split"), split_rows, gz=True)
    _write_csv(rp / (MIMIC_METADATA + ".gz"), METADATA_COLUMNS, meta_rows, gz=True)
    return summary


# ------------------------------------------------------------------------------------------------------ retina
#: MESSIDOR-2 adjudicated grade mix (Krause et al. 2018: ICDR 0-4 ~ 1017 / 270 / 347 / 75 / 35 images)
MESSIDOR2_GRADE_MIX = (0.58, 0.155, 0.2, 0.043, 0.022)
#: BRSET-like mix: mostly grade 0 (the real set is ~ 93 % without DR; less extreme here so small sets hold
#: every grade)
BRSET_GRADE_MIX = (0.78, 0.05, 0.09, 0.035, 0.045)
#: P(edema risk | grade 0-4)
_EDEMA_GIVEN_GRADE = {"messidor2": (0.0, 0.04, 0.2, 0.5, 0.5), "brset": (0.01, 0.05, 0.25, 0.5, 0.55)}
_P_UNGRADABLE = 0.03
#: fundus cameras (parameters of fedssl.data.image_synthetic's retina renderer): MESSIDOR's Topcon TRC NW6
#: (warm, bright, sharp, 45 degrees); BRSET's Canon CR-2 (cool, darker, softer, wider field) and Nikon NF5050
RETINA_CAMERAS: dict[str, dict] = {
    "topcon": {"gains": np.array([1.12, 0.96, 0.82], np.float32), "brightness": 1.15, "gamma": 0.9, "blur": 0.2,
               "resolution": 0.95, "noise": 0.012, "fov": 0.46, "vignette": 0.25, "dust": (0.3, 0.7, 0.0)},
    "canon": {"gains": np.array([0.86, 1.02, 1.16], np.float32), "brightness": 0.85, "gamma": 1.15, "blur": 0.6,
              "resolution": 0.7, "noise": 0.03, "fov": 0.54, "vignette": 0.5, "dust": (0.65, 0.3, 0.35)},
    "nikon": {"gains": np.array([0.95, 0.9, 1.1], np.float32), "brightness": 0.95, "gamma": 1.05, "blur": 0.45,
              "resolution": 0.8, "noise": 0.025, "fov": 0.52, "vignette": 0.4, "dust": (0.2, 0.25, 0.2)},
}
_EXUDATE = np.array([1.0, 0.9, 0.4], np.float32)


def _box_blur(a: np.ndarray, r: int) -> np.ndarray:
    if r < 1:
        return a
    p = np.pad(a, r, mode="edge")
    c = np.cumsum(np.cumsum(p, 0), 1)
    c = np.pad(c, ((1, 0), (1, 0)))
    k = 2 * r + 1
    return (c[k:, k:] - c[:-k, k:] - c[k:, :-k] + c[:-k, :-k]) / (k * k)


def _macular_exudates(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Edema risk made visible: a ring (circinate pattern) of hard exudates around the macula.  The optic disc is
    the brightest smoothed spot; the renderer puts the macula opposite it, a quarter of the disc's offset from
    the image centre."""
    h, w = img.shape[:2]
    lum = _box_blur(img.mean(axis=2), max(1, h // 16))
    dy, dx = np.unravel_index(int(np.argmax(lum)), lum.shape)
    cy, cx = h / 2, w / 2
    my, mx = cy - 0.25 * (dy - cy), cx - 0.25 * (dx - cx)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32) + 0.5
    ring = 0.09 * h * rng.uniform(0.8, 1.2)
    out = img.copy()
    for t in rng.uniform(0, 2 * np.pi, size=int(rng.integers(6, 11))):
        y, x = my + ring * np.sin(t) + rng.normal(0, 0.01 * h), mx + ring * np.cos(t) + rng.normal(0, 0.01 * h)
        sigma = max(0.6, 0.012 * h)
        a = 0.85 * np.exp(-((yy - y) ** 2 + (xx - x) ** 2) / (2 * sigma ** 2))[..., None]
        out = out * (1 - a) + a * _EXUDATE
    return np.clip(out, 0.0, 1.0)


def _retina(rng: np.random.Generator, grade: int, edema: int, camera: dict, image_px: int, eye: str) -> np.ndarray:
    img = render("retina", grade, camera, rng, image_px, eye=eye)
    return _macular_exudates(img, rng) if edema else img


def _grade_and_edema(rng: np.random.Generator, mix: Sequence[float], which: str) -> tuple[int, int]:
    grade = int(rng.choice(5, p=np.asarray(mix) / np.sum(mix)))
    return grade, int(rng.random() < _EDEMA_GIVEN_GRADE[which][grade])


def write_synthetic_messidor2(out: object, n_images: int = 100, image_px: int = 64, seed: int = 0) -> dict:
    """MESSIDOR-2 in the Kaggle layout: ``messidor_data.csv`` (image_id, adjudicated_dr_grade, adjudicated_dme,
    adjudicated_gradable) and ``messidor-2/preprocess/<stem>.png``.  Image ids mimic the release (Messidor-Original
    ``2005MMDD_NNNNN_0100_PP.tif``, the extension ``IM00NNNN.JPG``), stored re-encoded as PNG as in the Kaggle
    copy; grades as :data:`MESSIDOR2_GRADE_MIX`, ~3 % ungradable rows (blank grade and DME); one Topcon camera.

    Returns:
        ``{"root", "n_images", "gradable", "ungradable", "grades": [5 counts], "edema": n, "camera"}``.
    """
    require_int("write_synthetic_messidor2", "n_images", n_images, 1, "use a positive number of images")
    _check_px(image_px)
    rp = Path(os.fspath(out))
    img_dir = rp / "messidor-2" / "preprocess"
    img_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 23])
    rows, grades, edema, ungradable = [], [0] * 5, 0, 0
    for i in range(n_images):
        if i % 2 == 0:
            date = f"2005{int(rng.integers(1, 13)):02d}{int(rng.integers(1, 29)):02d}"
            stem, ext = f"{date}_{10000 + 7 * i:05d}_0100_PP", ".tif"
        else:
            stem, ext = f"IM{i:06d}", ".JPG"
        g, e = _grade_and_edema(rng, MESSIDOR2_GRADE_MIX, "messidor2")
        gradable = rng.random() >= _P_UNGRADABLE
        img = _retina(rng, g, e if gradable else 0, RETINA_CAMERAS["topcon"], image_px, ("left", "right")[i % 2])
        save_image(img, str(img_dir / f"{stem}.png"))
        if gradable:
            rows.append([stem + ext, str(g), str(e), "1"])
            grades[g] += 1
            edema += e
        else:
            rows.append([stem + ext, "", "", "0"])
            ungradable += 1
    _write_csv(rp / MESSIDOR2_CSV, ("image_id", "adjudicated_dr_grade", "adjudicated_dme", "adjudicated_gradable"),
               rows)
    return {"root": str(rp), "n_images": n_images, "gradable": n_images - ungradable, "ungradable": ungradable,
            "grades": grades, "edema": edema, "camera": "topcon"}


BRSET_COLUMNS = ("image_id", "patient_id", "camera", "patient_age", "patient_sex", "exam_eye", "diabetes", "DR_SDRG",
                 "DR_ICDR", "diabetic_retinopathy", "macular_edema", "quality")


def write_synthetic_brset(out: object, n_images: int = 100, image_px: int = 64, seed: int = 0) -> dict:
    """BRSET in its PhysioNet layout: ``labels_brset.csv`` (a subset of the real columns, among them image_id,
    patient_id, camera, DR_ICDR, macular_edema) and ``fundus_photos/imgNNNNN.jpg``; patients with both eyes (most)
    or one, grades as :data:`BRSET_GRADE_MIX`, two cameras (Canon CR-2, Nikon NF5050) by patient.

    Returns:
        ``{"root", "n_images", "n_patients", "grades": [5 counts], "edema": n, "cameras": {name: images}}``.
    """
    require_int("write_synthetic_brset", "n_images", n_images, 1, "use a positive number of images")
    _check_px(image_px)
    rp = Path(os.fspath(out))
    img_dir = rp / "fundus_photos"
    img_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 29])
    rows, grades, edema, cams, patient, i = [], [0] * 5, 0, {"canon": 0, "nikon": 0}, 0, 0
    while i < n_images:
        patient += 1
        cam = "canon" if rng.random() < 0.7 else "nikon"
        age, sex, diabetes = int(rng.integers(20, 90)), int(rng.integers(1, 3)), _choice(rng, ("yes", "no"))
        g0, e0 = _grade_and_edema(rng, BRSET_GRADE_MIX, "brset")
        for eye in (("right", "left") if rng.random() < 0.8 else (_choice(rng, ("right", "left")),)):
            if i >= n_images:
                break
            i += 1
            g, e = (g0, e0) if rng.random() < 0.8 else _grade_and_edema(rng, BRSET_GRADE_MIX, "brset")
            image_id = f"img{i:05d}"
            save_image(_retina(rng, g, e, RETINA_CAMERAS[cam], image_px, eye), str(img_dir / f"{image_id}.jpg"))
            rows.append([image_id, str(patient), {"canon": "Canon CR", "nikon": "NIKON NF5050"}[cam], str(age),
                         str(sex),
                         {"right": "1", "left": "2"}[eye], diabetes, str(g), str(g), str(int(g > 0)), str(e),
                         "Adequate"])
            grades[g] += 1
            edema += e
            cams[cam] += 1
    _write_csv(rp / BRSET_CSVS[0], BRSET_COLUMNS, rows)
    return {"root": str(rp), "n_images": n_images, "n_patients": patient, "grades": grades, "edema": edema,
            "cameras": cams}


# -------------------------------------------------------------------------------- out-of-distribution probe sets
def _chest_source(brightness, gamma, contrast, noise, blur, tone, vignette, marker) -> dict:
    """Acquisition parameters of the COVID-FL chest renderer of :mod:`fedssl.data.image_synthetic`."""
    return {"brightness": brightness, "gains": np.ones(3, np.float32), "gamma": gamma, "contrast": contrast,
            "noise": noise, "blur": blur, "tone": tone, "vignette": vignette, "hair": 0.0, "marker": marker}


#: RSNA: one hospital's acquisition (bright, contrasty, collimated, side marker)
_RSNA_SOURCE = _chest_source(1.15, 0.8, 1.25, 0.045, 0.6, 0.3, True, True)
#: COVIDx sources named as in its split files, each with its own acquisition
_COVIDX_SOURCES = {
    "rsna": _chest_source(1.1, 0.85, 1.2, 0.04, 0.5, 0.3, True, True),
    "bimcv": _chest_source(0.9, 1.2, 0.9, 0.03, 0.2, 0.4, False, False),
    "ricord": _chest_source(1.0, 1.0, 1.05, 0.05, 0.8, 0.5, False, True),
    "sirm": _chest_source(1.2, 0.9, 0.85, 0.02, 0.3, 0.2, True, False),
}


def _uuid(rng: np.random.Generator) -> str:
    h = "".join(f"{int(x):08x}" for x in rng.integers(0, 2 ** 32, size=4))
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _rsna_box(rng: np.random.Generator, side: int) -> tuple[float, float, float, float]:
    """One opacity box ``(x, y, width, height)`` in the 1024 px frame, inside the right (side 0) or left lung
    field, sized as RSNA's (about 120-300 px wide, 150-400 px high)."""
    w, h = rng.uniform(120, 300), rng.uniform(150, 400)
    x0 = (150, 540)[side]
    x = rng.uniform(x0, x0 + 330 - w)
    y = rng.uniform(200, 850 - h)
    return float(x), float(y), float(w), float(h)


def _paint_opacities(img: np.ndarray, boxes, rng: np.random.Generator) -> np.ndarray:
    """Airspace opacity in each box: a soft-edged ellipse filling the box, patchy, brightening the image."""
    hpx, wpx = img.shape[:2]
    yy, xx = np.mgrid[0:hpx, 0:wpx].astype(np.float32) + 0.5
    out = img.astype(np.float32).copy()
    for x, y, w, h in boxes:
        sx, sy = wpx / RSNA_FRAME, hpx / RSNA_FRAME
        cx, cy, rx, ry = (x + w / 2) * sx, (y + h / 2) * sy, max(w * sx / 2, 0.5), max(h * sy / 2, 0.5)
        d = ((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2
        blob = np.clip(1.2 - d, 0.0, 1.0) * (0.7 + 0.3 * rng.random((hpx, wpx), dtype=np.float32))
        a = (0.55 * blob)[..., None] if out.ndim == 3 else 0.55 * blob
        out = out * (1 - a) + a * 0.92
    return np.clip(out, 0.0, 1.0)


def write_synthetic_rsna(out: object, n_images: int = 100, image_px: int = 64, seed: int = 0) -> dict:
    """RSNA Pneumonia Detection (Kaggle layout, images already converted to PNG): ``stage_2_train_labels.csv``
    (patientId,x,y,width,height,Target: a pneumonia patient has one row per box (1-3 boxes in the 1024 px frame of
    the original, one or both lungs), a normal patient one box-less row with Target 0) and
    ``stage_2_train_images/<patientId>.png`` (grey).  ~30 % pneumonia.  Every box is where the image shows an
    opacity (painted in it), so the boxes, turned into masks as MGCA does
    (:func:`fedssl.data.vlp_segmentation.load_rsna_segmentation`), are a segmentation target.  The images come
    from another renderer and acquisition than :func:`write_synthetic_mimic`'s: out of distribution for a
    MIMIC-pre-trained encoder.

    Returns:
        ``{"root", "n_images", "positives", "rows"}``.
    """
    require_int("write_synthetic_rsna", "n_images", n_images, 1, "use a positive number of images")
    _check_px(image_px)
    rp = Path(os.fspath(out))
    img_dir = rp / "stage_2_train_images"
    img_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 31])
    rows, positives = [], 0
    for _ in range(n_images):
        pid = _uuid(rng)
        target = int(rng.random() < 0.3)
        img = render("covidfl", "normal", _RSNA_SOURCE, rng, image_px)
        if target:
            positives += 1
            n = int(rng.integers(1, 4))
            sides = [int(rng.integers(0, 2))] if n == 1 else [0, 1] + [int(rng.integers(0, 2))] * (n - 2)
            boxes = [_rsna_box(rng, side) for side in sides]
            img = _paint_opacities(img, boxes, rng)
            for x, y, w, h in boxes:
                rows.append([pid, f"{x:.1f}", f"{y:.1f}", f"{w:.1f}", f"{h:.1f}", "1"])
        else:
            rows.append([pid, "", "", "", "", "0"])
        save_image(img, str(img_dir / f"{pid}.png"), grey=True)
    _write_csv(rp / "stage_2_train_labels.csv", ("patientId", "x", "y", "width", "height", "Target"), rows)
    return {"root": str(rp), "n_images": n_images, "positives": positives, "rows": len(rows)}


def write_synthetic_covidx(out: object, n_images: int = 100, image_px: int = 64, seed: int = 0,
                           test_fraction: float = 0.2) -> dict:
    """COVIDx CXR-3 style: ``train.txt`` / ``test.txt`` lines ``patient_id filename label source`` with label
    ``positive`` (COVID-19: bilateral peripheral opacities) or ``negative`` (normal or non-COVID pneumonia), images
    ``train/<filename>`` / ``test/<filename>`` (grey PNG) from four sources with their own acquisitions; ~50 %
    positive; ``test_fraction`` of the images (one per patient) in test.

    Returns:
        ``{"root", "train": n, "test": n, "positives": {"train": n, "test": n}, "sources": {name: n}}``.
    """
    require_int("write_synthetic_covidx", "n_images", n_images, 2, "use at least 2 images (train and test)")
    _check_px(image_px)
    require(isinstance(test_fraction, (int, float)) and 0.0 < test_fraction < 1.0, "write_synthetic_covidx",
            "test_fraction", test_fraction, "use a fraction in (0, 1), e.g. 0.2")
    rp = Path(os.fspath(out))
    rng = np.random.default_rng([seed, 37])
    n_test = min(n_images - 1, max(1, int(round(test_fraction * n_images))))
    is_test = np.zeros(n_images, bool)
    is_test[rng.permutation(n_images)[:n_test]] = True
    lines: dict[str, list[str]] = {"train": [], "test": []}
    summary = {"root": str(rp), "train": 0, "test": 0, "positives": {"train": 0, "test": 0},
               "sources": {s: 0 for s in _COVIDX_SOURCES}}
    names = list(_COVIDX_SOURCES)
    for i in range(n_images):
        split = "test" if is_test[i] else "train"
        src = _choice(rng, names)
        positive = rng.random() < 0.5
        cls = "covid" if positive else _choice(rng, ("normal", "normal", "pneumonia"))
        pid = f"{src}-{int(rng.integers(0, 10 ** 6)):06d}"
        name = f"{_uuid(rng)}.png"
        (rp / split).mkdir(parents=True, exist_ok=True)
        save_image(render("covidfl", cls, _COVIDX_SOURCES[src], rng, image_px), str(rp / split / name), grey=True)
        lines[split].append(f"{pid} {name} {'positive' if positive else 'negative'} {src}")
        summary[split] += 1
        summary["positives"][split] += int(positive)
        summary["sources"][src] += 1
    for split, ls in lines.items():
        (rp / f"{split}.txt").write_text("\n".join(ls) + "\n", encoding="utf-8")
    return summary
