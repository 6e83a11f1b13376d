"""FedDRA's demo and its Table 3 comparison ("Distributionally Robust Alignment for Medical Federated
Vision-Language Pre-training Under Data Heterogeneity", Shuai, Wu, Tang and Shen, TMLR).

Synthetic MIMIC-CXR-layout data (``fedssl.data.vlp_synthetic``: reports that name the findings drawn in the image,
institution styles tied to the finding code) is cut into clients by the paper's LDA split over the 2^5 finding code
(``fedssl.data.vlp.write_client_manifests``).  Each variant is ``jobs/feddra_mimic`` with switches, run in the FLARE
simulator:

| variant        | two-stage | anchor (mu) | DRO | the paper's                  |
|----------------|-----------|-------------|-----|------------------------------|
| fedavg         | off       | 0           | off | FedAvg (Table 2)             |
| no_two_stage   | off       | on          | on  | Table 3, row 1               |
| no_anchor      | on        | 0           | on  | Table 3, row 2               |
| no_dro         | on        | on          | off | Table 3, row 3               |
| feddra         | on        | on          | on  | FedDRA (Table 3, row 4)      |

plus two in-process baselines on the same trainer (``decentralised``: each client alone; ``centralised``: the union).
Every cell reports per-client text-to-image R@1 / R@5 on the clients' test splits (within batches of 100, the
paper's protocol), the average and the worst client, the DRO weights per turn, the matched-pair cosine per turn
(held-out pairs, Fig. 4d-f), and a few-shot linear probe (1 % and 10 % labels) of the frozen image encoder on two
out-of-distribution sets (RSNA-Pneumonia-like and COVIDx-like layouts).  Cells are stored as they finish
(``cells.jsonl``): an interrupted run resumes.  The in-process baselines and the probes compute with ``threads``
torch threads, recorded in ``run_config.json`` with the environment.  Seeds 0, 1 and 2 unless told otherwise; a
run of fewer (the demo: one) says under its table that its comparison is not a finding.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fedssl.core.dro import chi2_divergence
from fedssl.data.vlp import VLPDataset, VLPRecord, load_covidx, load_manifest, load_mimic_vlp, load_rsna_pneumonia, \
    write_client_manifests
from fedssl.data.vocab import build_wordpiece_vocab, make_tokenizer, merge_word_counts, site_word_counts
from fedssl.eval.feddra_report import cosine_per_turn_png, format_table3, lambda_trajectory_png, variants_png
from fedssl.data.vlp_synthetic import devices_named
from fedssl.eval.retrieval import MAX_FLOOR_PAIRS, chance_recall, client_summary, key_recall_ceiling, worst_client_floor
from fedssl.experiments.environment import DEFAULT_THREADS
from fedssl.experiments.fcl_finetune import load_global_state
from fedssl.experiments.table_runner import few_seeds_note, format_duration, run_cells, start_run
from fedssl.models.vlp import VisionLanguageModel
from fedssl.ops.jobs import REPO_ROOT
from fedssl.ops.simulate import global_model_path, run_simulation, server_run_dir
from fedssl.train.feddra import RETRIEVAL_BATCH, FedDRALocalTrainer, FedDRASettings
from fedssl.train.vlp_finetune import few_shot_finetune
from fedssl.train.vlp_probe import few_shot_probe
from fedssl.train.vlp_segment import SegmentationSettings, few_shot_segmentation

JOB = os.path.join(REPO_ROOT, "jobs", "feddra_mimic")
CTRL, SITE = "server.scatter_and_gather", "client.feddra_trainer"
#: the job switches of each federated variant (Table 3's rows and FedAvg)
SWITCHES: dict[str, dict[str, Any]] = {
    "fedavg": {"two_stage": False, "dro": False, "mu": 0.0},
    "no_two_stage": {"two_stage": False, "dro": True, "mu": None},
    "no_anchor": {"two_stage": True, "dro": True, "mu": 0.0},
    "no_dro": {"two_stage": True, "dro": False, "mu": None},
    "feddra": {"two_stage": True, "dro": True, "mu": None},
}
LOCAL = ("decentralised", "centralised")
VARIANTS = tuple(SWITCHES) + LOCAL
#: the demo's settings (2-core CPU, about 2-3 minutes per federated cell)
DEMO = {"n_clients": 5, "alpha": 1.0, "n_patients": 1000, "style_coupling": 0.7, "device_rate": 0.0, "image_px": 64,
        "preset": "small", "vocab_size": 1024,
        "turns": 6, "align_steps": 6, "steps": 15, "batch_size": 32, "lr": 2e-4, "mu": 5.0, "rho": 0.1, "gamma": 0.5,
        "max_text_len": 64, "ood_images": 300, "probe_fractions": [0.01, 0.1],
        # RSNA segmentation (U-Net decoder on the frozen encoder, MGCA's protocol); narrower decoder on the CPU
        "seg_epochs": 50, "seg_decoder_channels": [32, 16, 8]}


def switch_sets(variant: str, settings: Mapping[str, Any], seed: int) -> list[str]:
    """The ``--set`` overrides of one federated variant at these settings (on top of the quick profile)."""
    sw = SWITCHES[variant]
    mu = settings["mu"] if sw["mu"] is None else sw["mu"]
    return [f"shape.preset={json.dumps(settings['preset'])}", f"shape.vocab_size={settings['vocab_size']}",
            f"shape.image_size={settings['image_px']}",
            f"{CTRL}.num_rounds={settings['turns']}", f"{CTRL}.two_stage={json.dumps(sw['two_stage'])}",
            f"{CTRL}.dro={json.dumps(sw['dro'])}", f"{CTRL}.rho={settings['rho']}", f"{CTRL}.gamma={settings['gamma']}",
            f"server.vocabulary.vocab_size={settings['vocab_size']}", f"{SITE}.mu={float(mu)}",
            f"{SITE}.align_steps={settings['align_steps']}", f"{SITE}.steps={settings['steps']}",
            f"{SITE}.batch_size={settings['batch_size']}", f"{SITE}.lr={settings['lr']}",
            f"{SITE}.max_text_len={settings['max_text_len']}", f"{SITE}.seed={seed}", f"server.model.seed={seed}"]


# ------------------------------------------------------------------ data
def write_demo_data(out: str, settings: Mapping[str, Any], seed: int = 0) -> str:
    """Synthetic MIMIC-CXR under ``out/raw``, the clients' manifests under ``out/sites/site-<i>``, the OOD sets
    under ``out/ood``; returns ``out``.  Already written data is kept (a resumed run reuses it)."""
    from fedssl.data.vlp_synthetic import write_synthetic_covidx, write_synthetic_mimic, write_synthetic_rsna

    raw, sites, ood = (os.path.join(out, d) for d in ("raw", "sites", "ood"))
    if not os.path.isdir(sites):
        info = write_synthetic_mimic(raw, n_patients=settings["n_patients"], image_px=settings["image_px"], seed=seed,
                                     style_coupling=settings["style_coupling"], device_rate=settings["device_rate"])
        records, counts = load_mimic_vlp(raw, site="synthetic")
        write_client_manifests(records, sites + ".tmp", n_clients=settings["n_clients"], alpha=settings["alpha"],
                               seed=seed)
        os.replace(sites + ".tmp", sites)
        print(f"synthetic MIMIC-CXR: {info.get('n_studies')} studies, {len(records)} frontal pairs "
              f"({counts}), {settings['n_clients']} clients by LDA (alpha {settings['alpha']})", flush=True)
    if not os.path.isdir(ood):
        write_synthetic_rsna(os.path.join(ood + ".tmp", "rsna"), n_images=settings["ood_images"],
                             image_px=settings["image_px"], seed=seed + 1)
        write_synthetic_covidx(os.path.join(ood + ".tmp", "covidx"), n_images=settings["ood_images"],
                               image_px=settings["image_px"], seed=seed + 2)
        os.replace(ood + ".tmp", ood)
    return out


def client_records(data: str) -> dict[str, tuple[list[VLPRecord], list[VLPRecord]]]:
    sites = os.path.join(data, "sites")
    out = {}
    for site in sorted(os.listdir(sites)):
        path = os.path.join(sites, site, "manifest.csv")
        if os.path.isfile(path):
            recs = load_manifest(path, None, site=site)
            out[site] = ([r for r in recs if r.split == "train"], [r for r in recs if r.split == "test"])
    return out


class _Labelled(torch.utils.data.Dataset):
    """(image tensor, label) items of (path, label) pairs, through VLPDataset's image pipeline."""

    def __init__(self, items: Sequence[tuple[str, int]], image_size: int, channels: int):
        recs = [VLPRecord(image=p, text="", labels=(int(y),), patient=str(i), study=str(i), split="train")
                for i, (p, y) in enumerate(items)]
        self.images, self.labels = VLPDataset(recs, image_size, channels=channels,
                                              cache=False), [int(y) for _, y in items]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i][0], self.labels[i]


def ood_sets(data: str) -> dict[str, tuple[list, list]]:
    """{"rsna": (train, test), "covidx": (train, test)} as (path, label) lists; RSNA has no official test split:
    a fixed 80/20 cut in file order."""
    ood = os.path.join(data, "ood")
    rsna = load_rsna_pneumonia(os.path.join(ood, "rsna"))
    cut = int(0.8 * len(rsna))
    return {"rsna": (rsna[:cut], rsna[cut:]),
            "covidx": (load_covidx(os.path.join(ood, "covidx"), "train"),
                       load_covidx(os.path.join(ood, "covidx"), "test"))}


def probe(model: VisionLanguageModel, data: str, fractions: Sequence[float], seed: int,
          settings: Mapping[str, Any] | None = None) -> dict[str, dict]:
    """On each OOD set: the few-shot logistic-regression probe of the frozen image encoder (accuracy, AUROC) under
    the fraction, and FedDRA's own protocol, a linear layer fine-tuned on the frozen encoder as MGCA's fine-tuner
    (:func:`fedssl.train.vlp_finetune.few_shot_finetune`, the same labelled subset) under ``"<fraction>_ft"``; and
    under ``"rsna_seg"`` the Dice of RSNA segmentation per fraction (:func:`segment`)."""
    model.eval()

    def features(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model.image_features(x)

    out = {}
    for name, (train, test) in ood_sets(data).items():
        tr, te = (_Labelled(items, model.image_size, model.in_chans) for items in (train, test))
        res = few_shot_probe(features, tr, te, fractions=list(fractions), seed=seed, train_labels=tr.labels)
        out[name] = {k: {m: v[m] for m in ("accuracy", "auroc") if m in v} for k, v in res.items()}
        ft = few_shot_finetune(model, tr, te, dataset=name, seed=seed, fractions=tuple(fractions),
                               train_labels=tr.labels, features="image_features")
        out[name].update({f"{k}_ft": {m: v[m] for m in ("accuracy", "auroc") if m in v} for k, v in ft.items()})
    out["rsna_seg"] = segment(model, data, fractions, seed, settings or {})
    return out


def segment(model: VisionLanguageModel, data: str, fractions: Sequence[float], seed: int,
            settings: Mapping[str, Any]) -> dict[str, dict]:
    """RSNA segmentation (FedDRA sec. 5.1.1 (2)): a U-Net decoder fine-tuned on the frozen image encoder with each
    fraction of the RSNA training images (the 80 % cut of :func:`ood_sets`), Dice on the rest
    (:func:`fedssl.train.vlp_segment.few_shot_segmentation`)."""
    from fedssl.data.vlp_segmentation import RSNASegmentationDataset, load_rsna_segmentation

    items = load_rsna_segmentation(os.path.join(data, "ood", "rsna"))
    cut = int(0.8 * len(items))
    tr, te = (RSNASegmentationDataset(part, model.image_size, model.in_chans) for part in (items[:cut], items[cut:]))
    channels = settings.get("seg_decoder_channels", DEMO["seg_decoder_channels"])
    seg = SegmentationSettings(fractions=tuple(fractions), epochs=settings.get("seg_epochs", DEMO["seg_epochs"]),
                               decoder_channels=tuple(channels) if channels else None)
    res = few_shot_segmentation(model.image_encoder, model.patch_size, model.in_chans, tr, te, seed=seed,
                                settings=seg)
    return {k: {"dice": v["dice"], "dice_positive": v["dice_positive"]} for k, v in res.items()}


# ------------------------------------------------------------------ one cell
def _site_turn_records(workspace: str) -> list[dict]:
    """Per-turn held-out cosines of every site (their own metrics files), averaged over the sites per turn."""
    per_turn: dict[int, list[tuple[float, float]]] = {}
    for site in sorted(os.listdir(workspace)):
        path = os.path.join(workspace, site, "simulate_job", "feddra_metrics.jsonl")
        if not os.path.isfile(path):
            path = os.path.join(workspace, site, "simulate_job", "app_" + site, "feddra_metrics.jsonl")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if "holdout_cos_matched" in r:
                    per_turn.setdefault(int(r["round"]),
                                        []).append((r["holdout_cos_matched"], r["holdout_cos_unmatched"]))
    return [{"turn": t, "matched": float(np.mean([a for a, _ in v])), "unmatched": float(np.mean([b for _, b in v]))}
            for t, v in sorted(per_turn.items())]


def _find(root: str, name: str) -> str | None:
    for dirpath, _, files in os.walk(root):
        if name in files:
            return os.path.join(dirpath, name)
    return None


def run_federated(key: Mapping[str, Any], data: str, out: str, settings: Mapping[str, Any]) -> dict:
    variant, seed = key["variant"], key["seed"]
    ws = os.path.join(out, "runs", f"{variant}_s{seed}")
    t0 = time.time()
    summary = run_simulation(JOB, ws, n_sites=settings["n_clients"], data_root=os.path.join(data, "sites", "{site}"),
                             profile="quick", sets=switch_sets(variant, settings, seed), echo=False)
    wall = time.time() - t0
    run_dir = server_run_dir(ws)
    with open(_find(run_dir, "test_metrics.json") or os.path.join(run_dir, "test_metrics.json")) as f:
        test = json.load(f)
    traj_path = _find(run_dir, "dro_weights.json")
    trajectory = json.load(open(traj_path))["trajectory"] if traj_path else []
    model = VisionLanguageModel(preset=settings["preset"], vocab_size=settings["vocab_size"],
                                image_size=settings["image_px"], in_chans=3, seed=seed)
    model.load_state_dict(load_global_state(global_model_path(ws)))
    comm = summary.get("communication", {})
    return {"variant": variant, "seed": seed, "clients": {s: {k: m[k] for k in ("R@1", "R@5", "split_R@1", "split_R@5",
                                                                           "cos_matched", "cos_unmatched", "n_pairs",
                                                                           "retrieval_batch")
                                                              if k in m}
                                                          for s, m in test["sites"].items()},
            "lambda": trajectory, "cosine_per_turn": _site_turn_records(ws),
            "probe": probe(model, data, settings["probe_fractions"], seed, settings), "wall_time_s": round(wall, 1),
            "communication": comm}


def _vocab_for(texts_by_site: Sequence[Sequence[str]], settings: Mapping[str, Any]):
    counts = [site_word_counts(t, min_count=2) for t in texts_by_site]
    return make_tokenizer(vocab=build_wordpiece_vocab(merge_word_counts(counts, min_count=2), settings["vocab_size"]))


def run_local(key: Mapping[str, Any], data: str, out: str, settings: Mapping[str, Any]) -> dict:
    """Decentralised (each client trains alone, evaluated on its own test split) or centralised (one model on the
    union of the clients' training pairs, evaluated on each client's test split); FedAvg's objective (mu 0), the
    steps of a FedAvg run: turns x steps batches."""
    variant, seed = key["variant"], key["seed"]
    sites = client_records(data)
    t0 = time.time()
    common = FedDRASettings(preset=settings["preset"], vocab_size=settings["vocab_size"],
                            image_size=settings["image_px"], in_chans=3, batch_size=settings["batch_size"],
                            lr=settings["lr"], mu=0.0, align_steps=0, steps=settings["steps"],
                            max_text_len=settings["max_text_len"], seed=seed)
    clients, models = {}, {}
    if variant == "decentralised":
        for site, (train, test) in sites.items():
            tr = FedDRALocalTrainer(train, test, common, tokenizer=_vocab_for([[r.text for r in train]], settings),
                                    site=site, model_seed=seed)
            for turn in range(settings["turns"]):
                tr.train_round(turn)
            clients[site] = tr.evaluate("test")
            models[site] = tr.model
    else:
        union = [r for train, _ in sites.values() for r in train]
        tok = _vocab_for([[r.text for r in train] for train, _ in sites.values()], settings)
        tr = FedDRALocalTrainer(union, [], common, tokenizer=tok, site="central", model_seed=seed)
        for turn in range(settings["turns"]):
            tr.train_round(turn)
        for site, (_, test) in sites.items():
            ev = FedDRALocalTrainer(sites[site][0], test, common, tokenizer=tok, site=site, model_seed=seed)
            ev.model.load_state_dict(tr.model.state_dict())
            clients[site] = ev.evaluate("test")
        models["central"] = tr.model
    probes = [probe(m, data, settings["probe_fractions"], seed, settings) for m in models.values()]
    avg_probe = {ds: {fr: {m: _mean_or_none([p[ds][fr][m] for p in probes]) for m in probes[0][ds][fr]}
                      for fr in probes[0][ds]} for ds in probes[0]}
    return {"variant": variant, "seed": seed, "clients": clients,
            "lambda": [], "cosine_per_turn": [], "probe": avg_probe, "wall_time_s": round(time.time() - t0, 1)}


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    v = [x for x in values if x is not None]
    return float(np.mean(v)) if v else None


# ------------------------------------------------------------------ tables
def cell_row(res: Mapping[str, Any]) -> dict:
    summ = client_summary(res["clients"], keys=("R@1", "R@5"), anonymous=True)
    row = {"variant": res["variant"], "seed": res["seed"], **{k: summ[k] for k in ("avg_R@1", "avg_R@5", "worst_R@1",
                                                                                  "worst_R@5")}}
    sizes = [m.get("n_pairs") for m in res["clients"].values()]  # earlier cells lack them; a bool is no count
    if all(isinstance(n, int) and not isinstance(n, bool) and 0 < n <= MAX_FLOOR_PAIRS // len(sizes) for n in sizes):
        for k in ("R@1", "R@5"):
            row[f"floor_{k}"] = worst_client_floor(row[f"avg_{k}"], sizes)
    for ds, fr in res["probe"].items():
        for f, m in fr.items():
            if "dice" in m:  # segmentation: Dice (FedDRA Table 2's "Seg." columns), e.g. rsna_seg_1%_dice
                row[f"{ds}_{f}_dice"] = m.get("dice")
                row[f"{ds}_{f}_dice_pos"] = m.get("dice_positive")
                continue
            row[f"{ds}_{f}_acc"] = m.get("accuracy")
            row[f"{ds}_{f}_auc"] = m.get("auroc")
    if res["lambda"]:
        last = np.array(list(res["lambda"][-1]["lambda"].values()))
        row["lambda_min"], row["lambda_max"], row["lambda_chi2"] = (float(last.min()), float(last.max()),
                                                                    chi2_divergence(last))
    row["wall_time_s"] = res["wall_time_s"]
    return row


def _ms(values: Sequence[float]) -> str:
    v = [x for x in values if x is not None]
    if not v:
        return "n/a"
    return f"{100 * np.mean(v):.1f}" + (f" +- {100 * np.std(v):.1f}" if len(v) > 1 else "")


def format_results(rows: Sequence[Mapping[str, Any]], variants: Sequence[str]) -> str:
    cols = ["avg_R@1", "avg_R@5", "worst_R@1", "worst_R@5"]
    probe_cols = sorted({k for r in rows for k in r if k.endswith("_acc")})
    probe_cols += sorted({k for r in rows for k in r if k.endswith("_dice")})
    head = f"| variant | {' | '.join(cols + probe_cols)} | seeds |"
    lines = [head, "|" + "---|" * (len(cols) + len(probe_cols) + 2)]
    for v in variants:
        rs = [r for r in rows if r["variant"] == v]
        if rs:
            lines.append(f"| {v} | " + " | ".join(_ms([r.get(c) for r in rs]) for c in cols + probe_cols)
                         + f" | {len(rs)} |")
    return "\n".join(lines + floor_lines(rows, variants))


def floor_lines(rows: Sequence[Mapping[str, Any]], variants: Sequence[str]) -> list[str]:
    """Per variant, the measured mean-minus-worst gap next to the gap clients that are all alike would show from
    their test sets' sizes alone (:func:`fedssl.eval.retrieval.worst_client_floor`), in points, mean over seeds:
    a worst-client difference is readable only where the measured gap stands well above that floor."""
    lines = []
    for v in variants:
        rs = [r for r in rows if r["variant"] == v and "floor_R@1" in r]
        if rs:
            parts = [f"{k} {100 * np.mean([r[f'avg_{k}'] - r[f'worst_{k}'] for r in rs]):.1f} vs "
                     f"{100 * np.mean([r[f'floor_{k}'] for r in rs]):.1f}" for k in ("R@1", "R@5")]
            lines.append(f"{v}: mean minus worst client, measured vs alike clients on these test sets (points): "
                         + "; ".join(parts))
    return [""] + lines if lines else []


def table3_text(rows: Sequence[Mapping[str, Any]], variants: Sequence[str]) -> str:
    """The federated variants as the paper's Table 3 (values over seeds), followed by the paper's own rows."""
    out = []
    for v in variants:
        rs = [r for r in rows if r["variant"] == v]
        if v not in SWITCHES or not rs:
            continue
        sw = SWITCHES[v]
        row = {"variant": v, "two_stage": sw["two_stage"], "anchor": sw["mu"] != 0.0, "dro": sw["dro"]}
        for key, col in (("avg_R@1", "avg_R@1"), ("avg_R@5", "avg_R@5"), ("worst_R@1", "worst_R@1"),
                         ("worst_R@5", "worst_R@5"), ("rsna_1%", "rsna_1%_acc"), ("rsna_10%", "rsna_10%_acc"),
                         ("covidx_1%", "covidx_1%_acc"), ("covidx_10%", "covidx_10%_acc")):
            vals = [r[col] for r in rs if r.get(col) is not None]
            row[key] = vals if vals else None
        out.append(row)
    return format_table3(out) if out else ""


def per_client_lines(results: Sequence[Mapping[str, Any]], seed: int) -> list[str]:
    """Per-client R@1 / R@5 (%) of every variant at ``seed``, and the DRO weights per turn."""
    cells = [r for r in results if r["seed"] == seed]
    if not cells:
        return []
    sites = sorted({s for r in cells for s in r["clients"]}, key=lambda x: (len(x), x))
    pairs = {s: r["clients"][s]["n_pairs"] for r in cells for s in r["clients"] if "n_pairs" in r["clients"][s]}
    # a client ranks each text among its own test images (fewer than the protocol's batch): its gallery size
    heads = [f"{s} ({pairs[s]} pairs)" if s in pairs else s for s in sites]
    lines = [f"per client, seed {seed}: R@1 / R@5 (%)", "| variant | " + " | ".join(heads) + " |",
             "|---|" + "---|" * len(sites)]
    for r in cells:
        c = r["clients"]
        lines.append(f"| {r['variant']} | " + " | ".join(
            f"{100 * c[s]['R@1']:.1f} / {100 * c[s]['R@5']:.1f}" if s in c else "n/a" for s in sites) + " |")
    chance = {s: _chance(m) for r in cells for s, m in r["clients"].items()}
    if any(v is not None for v in chance.values()):
        lines.append("| chance | " + " | ".join(
            f"{100 * chance[s]['R@1']:.1f} / {100 * chance[s]['R@5']:.1f}" if chance.get(s) else "n/a"
            for s in sites) + " |")
    for r in cells:
        if r["lambda"]:
            lines.append(f"DRO weights per turn ({r['variant']}):")
            for t in r["lambda"]:
                lines.append(f"  turn {t['turn']}: " + ", ".join(f"{s} {w:.3f}" for s, w in sorted(
                    t["lambda"].items(), key=lambda kv: (len(kv[0]), kv[0]))))
    return lines + [""]


def _chance(metrics: Mapping[str, Any]) -> dict[str, float] | None:
    """A client's recall at chance (:func:`fedssl.eval.retrieval.chance_recall`) for its test pairs and gallery
    batch; cells written before the batch was recorded ranked in the trainer's default batch (RETRIEVAL_BATCH).
    None without a usable pair count (a site's claim: bounded as the floor's is)."""
    n = metrics.get("n_pairs")
    batch = metrics.get("retrieval_batch", min(RETRIEVAL_BATCH, n) if isinstance(n, int) else None)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (n, batch)) or batch > n \
            or n > MAX_FLOOR_PAIRS:
        return None
    return {k: chance_recall(n, int(k[2:]), batch) for k in ("R@1", "R@5")}


def at_chance_lines(results: Sequence[Mapping[str, Any]], z: float = 2.0) -> list[str]:
    """The clients whose R@1 and R@5 both stay within ``z`` binomial standard errors above their chance level, by
    variant, with the seeds where they do: a worst client there has learned nothing its test pairs can show, so
    no client weighting can move it."""
    found: dict[str, dict[str, list]] = {}
    for r in results:
        for site, m in r["clients"].items():
            ch = _chance(m)
            if ch and all(isinstance(m.get(k), float) and m[k] <= ch[k] + z * math.sqrt(ch[k] * (1 - ch[k])
                                                                                   / m["n_pairs"]) for k in ch):
                found.setdefault(r["variant"], {}).setdefault(site, []).append(r["seed"])
    if not found:
        return []
    parts = [f"{v}: " + ", ".join(f"{s} (seeds {', '.join(str(x) for x in sorted(sd))})"
                                  for s, sd in sorted(found[v].items())) for v in found]
    return [f"clients at chance (R@1 and R@5 within {z:g} binomial SE of it): " + "; ".join(parts)]


def device_ceilings(data: str, settings: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """For each client whose test pairs all carry one finding code, when the style follows the code
    (``style_coupling`` 1.0): the recall of a retriever that sees only the lines and tubes each synthetic image shares
    with its report (:func:`fedssl.eval.retrieval.key_recall_ceiling` over
    :func:`fedssl.data.vlp_synthetic.devices_named`, in the protocol's batches).  Such a client's image and report
    share nothing else, so no model can retrieve above it there: the headroom DRO's weight can buy."""
    if float(settings.get("style_coupling", 0.0)) != 1.0:
        return {}
    out = {}
    for site, (_, test) in client_records(data).items():
        if test and len({r.labels for r in test}) == 1:
            keys = [devices_named(r.text) for r in test]
            out[site] = {"n_pairs": len(test), "with_devices": sum(bool(k) for k in keys),
                         **{f"R@{k}": key_recall_ceiling(keys, k, RETRIEVAL_BATCH) for k in (1, 5)}}
    return out


def ceiling_lines(ceilings: Mapping[str, Mapping[str, float]]) -> list[str]:
    """One line a client of :func:`device_ceilings`."""
    return [f"{site}: all {c['n_pairs']} test pairs carry one finding code and the style follows it; "
            f"{c['with_devices']} show a line or tube. Seeing only those, no model retrieves above R@1 "
            f"{100 * c['R@1']:.1f} / R@5 {100 * c['R@5']:.1f} % there (in expectation)"
            for site, c in sorted(ceilings.items())]


def paired_worst(rows: Sequence[Mapping[str, Any]], a: str, b: str, key: str = "worst_R@1") -> dict | None:
    """``a - b`` of ``key`` paired by seed: mean, std, the standard error over seeds (sample std / sqrt(n); None for
    one seed), the per-seed differences, n, and whether the mean exceeds the spread."""
    by = {(r["variant"], r["seed"]): r[key] for r in rows}
    per = {s: by[(a, s)] - by[(b, s)] for (v, s) in by if v == a and (b, s) in by}
    if not per:
        return None
    diffs = list(per.values())
    m, sd = float(np.mean(diffs)), float(np.std(diffs))
    se = float(np.std(diffs, ddof=1) / np.sqrt(len(diffs))) if len(diffs) > 1 else None
    return {"diff": m, "std": sd, "se": se, "by_seed": {int(s): float(d) for s, d in sorted(per.items())},
            "n": len(diffs), "beyond_spread": bool(len(diffs) > 1 and abs(m) > sd)}


def run(out: str, variants: Sequence[str] = ("fedavg", "feddra"), seeds: Sequence[int] = (0, 1, 2),
        settings: Mapping[str, Any] | None = None, data_root: str | None = None,
        threads: int = DEFAULT_THREADS) -> dict:
    """Run (or resume) every (variant, seed) cell; write results.json / results.md / per-seed PNGs under ``out``.
    ``threads``: torch threads of this process (a setting of the folder, in its run_config.json)."""
    settings = {**DEMO, **(settings or {})}
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ValueError(f"unknown variants {bad}; choose from {list(VARIANTS)}")
    out, data, store = start_run(out, {**settings, "variants": list(variants), "seeds": list(seeds)},
                                 ("variants", "seeds"), data_root,
                                 lambda o: write_demo_data(os.path.join(o, "data"), settings, seed=0),
                                 threads=threads)
    cells = [{"variant": v, "seed": s} for s in seeds for v in variants]

    def one(key: dict) -> dict:
        fn = run_local if key["variant"] in LOCAL else run_federated
        return fn(key, data, out, settings)

    t0 = time.time()
    results = run_cells(cells, one, store, label="FedDRA", cost=lambda k: 0.5 if k["variant"] in LOCAL else 1.0,
                        threads=threads)
    rows = [cell_row(r) for r in results]
    table = format_results(rows, variants)
    verdicts = {f"{a} - fedavg, {k}": paired_worst(rows, a, "fedavg", k) for a in variants if a != "fedavg"
                for k in ("worst_R@1", "avg_R@1")}
    for r in results:
        if r["lambda"]:
            lambda_trajectory_png(r["lambda"], os.path.join(out, f"lambda_{r['variant']}_s{r['seed']}.png"),
                                  f"DRO weights per turn ({r['variant']}, seed {r['seed']})")
    cos = [{"turn": c["turn"], "method": r["variant"], "matched": c["matched"], "unmatched": c["unmatched"]}
           for r in results if r["seed"] == seeds[0] for c in r["cosine_per_turn"]]
    variants_png(rows, variants, os.path.join(out, "recall.png"),
                 f"FedDRA variants, seeds {', '.join(str(s) for s in sorted({r['seed'] for r in rows}))}")
    if cos:
        cosine_per_turn_png(cos, os.path.join(out, "cosine_per_turn.png"), "matched image-text cosine (held-out pairs)")
    # a comparison of fewer than three seeds is not a finding: said under the table
    note = few_seeds_note({v: [r["seed"] for r in rows if r["variant"] == v] for v in variants},
                          rerun="fedssl feddra table --seeds 0 1 2") if len(variants) > 1 else None
    ceilings = device_ceilings(data, settings)
    report = {"settings": settings, "rows": rows, "cells": results, "verdicts": verdicts, "seeds_note": note,
              "device_ceilings": ceilings,
              "wall_time_s": round(time.time() - t0, 1)}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = [f"FedDRA on synthetic MIMIC-CXR ({settings['n_clients']} clients, LDA alpha {settings['alpha']}, "
             f"{settings['turns']} turns, preset {settings['preset']}); text-to-image recall (%) on the clients' test "
             "splits, few-shot linear-probe accuracy (%) on the OOD sets, RSNA segmentation Dice (%, "
             "rsna_seg_*_dice); mean +- std over seeds", "", table, ""]
    lines += [table3_text(rows, variants), ""]
    lines += per_client_lines(results, seeds[0]) + at_chance_lines(results) + ceiling_lines(ceilings)
    for name, v in verdicts.items():
        if v:
            verdict = ("one seed: no spread" if v["n"] < 2 else
                       "beyond the spread" if v["beyond_spread"] else "within the spread")
            se = "" if v["se"] is None else f" (SE {100 * v['se']:.1f})"
            per = " / ".join(f"{100 * d:+.1f}" for d in v["by_seed"].values())
            lines.append(f"{name}: {100 * v['diff']:+.1f} +- {100 * v['std']:.1f}{se} points over {v['n']} seed(s) "
                         f"[{per}], {verdict}")
    if note:
        lines.append(note)
    lines.append(f"\nwall time {format_duration(time.time() - t0)}")
    text = "\n".join(lines)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text + "\n")
    print(text, flush=True)
    return report
