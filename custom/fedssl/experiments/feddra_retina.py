"""FedDRA's ophthalmology setting end to end (appendix A.2, Table 4): ``jobs/feddra_retina`` (MESSIDOR-2 and BRSET,
one client each) in the FLARE simulator on synthetic data in the real layouts, then the Table 4 evaluation on an
mBRSET-like out-of-distribution set (:func:`fedssl.train.vlp_mbrset.mbrset_evaluation`: a linear layer on the
frozen image encoder, 10 % / 20 % / 100 % of the training labels, diabetic retinopathy and edema, accuracy).

``fedssl feddra retina --out runs/feddra_retina`` runs FedAvg and FedDRA (the job's switches, as
:mod:`fedssl.experiments.feddra_demo`) at CPU scale and writes ``results.json`` / ``results.md``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from fedssl.experiments.fcl_finetune import load_global_state
from fedssl.experiments.feddra_demo import SWITCHES, _find
from fedssl.models.vlp import VisionLanguageModel
from fedssl.ops.jobs import REPO_ROOT
from fedssl.ops.simulate import global_model_path, run_simulation, server_run_dir
from fedssl.train.vlp_mbrset import MBRSET_FRACTIONS, mbrset_evaluation

JOB = os.path.join(REPO_ROOT, "jobs", "feddra_retina")
CTRL, SITE = "server.scatter_and_gather", "client.feddra_trainer"
#: CPU settings (the job keeps the paper's: ViT-B / BERT-base at 224 px, 20 turns of 20 batches of 100)
RETINA = {"images": 300, "mbrset_images": 300, "image_px": 64, "preset": "small", "vocab_size": 256, "turns": 4,
          "align_steps": 4, "steps": 10, "batch_size": 32, "lr": 2e-4, "mu": 1.0, "rho": 0.5, "gamma": 0.2,
          "max_text_len": 32, "fractions": list(MBRSET_FRACTIONS), "finetune": {}}


def write_retina_data(out: str, settings: Mapping[str, Any], seed: int = 0) -> str:
    """Synthetic MESSIDOR-2, BRSET and mBRSET under ``out``; site manifests under ``out/sites``."""
    from fedssl.data.vlp import load_brset, load_messidor2, write_source_manifests
    from fedssl.data.vlp_mbrset import write_synthetic_mbrset
    from fedssl.data.vlp_synthetic import write_synthetic_brset, write_synthetic_messidor2

    sites = os.path.join(out, "sites")
    if not os.path.isdir(sites):
        px = settings["image_px"]
        write_synthetic_messidor2(os.path.join(out, "messidor2"), n_images=settings["images"], image_px=px, seed=seed)
        write_synthetic_brset(os.path.join(out, "brset"), n_images=settings["images"], image_px=px, seed=seed + 1)
        write_synthetic_mbrset(os.path.join(out, "mbrset"), n_images=settings["mbrset_images"], image_px=px,
                               seed=seed + 2)
        sources = {"site-1": load_messidor2(os.path.join(out, "messidor2"), site="site-1", seed=seed)[0],
                   "site-2": load_brset(os.path.join(out, "brset"), site="site-2", seed=seed)[0]}
        write_source_manifests(sources, sites + ".tmp")
        os.replace(sites + ".tmp", sites)
    return out


def switch_sets(variant: str, settings: Mapping[str, Any], seed: int) -> list[str]:
    sw = SWITCHES[variant]
    mu = settings["mu"] if sw["mu"] is None else sw["mu"]
    return [f"shape.preset={json.dumps(settings['preset'])}", f"shape.vocab_size={settings['vocab_size']}",
            f"shape.image_size={settings['image_px']}", f"{CTRL}.num_rounds={settings['turns']}",
            f"{CTRL}.two_stage={json.dumps(sw['two_stage'])}", f"{CTRL}.dro={json.dumps(sw['dro'])}",
            f"{CTRL}.rho={settings['rho']}", f"{CTRL}.gamma={settings['gamma']}",
            f"server.vocabulary.vocab_size={settings['vocab_size']}", f"{SITE}.mu={float(mu)}",
            f"{SITE}.align_steps={settings['align_steps']}", f"{SITE}.steps={settings['steps']}",
            f"{SITE}.batch_size={settings['batch_size']}", f"{SITE}.lr={settings['lr']}",
            f"{SITE}.max_text_len={settings['max_text_len']}", f"{SITE}.seed={seed}", f"server.model.seed={seed}"]


def format_table4(results: Mapping[str, Mapping[str, Any]], fractions: Sequence[str]) -> str:
    """Table 4's layout: one row per variant, DR and edema accuracy (%) per fraction."""
    head = "| variant | " + " | ".join(f"DR {f}" for f in fractions) + " | " + \
           " | ".join(f"edema {f}" for f in fractions) + " |"
    lines = [head, "|---|" + "---|" * (2 * len(fractions))]
    for variant, res in results.items():
        cells = [res["mbrset"][task].get(f, {}).get("accuracy") for task in ("dr", "edema") for f in fractions]
        lines.append(f"| {variant} | " + " | ".join("n/a" if c is None else f"{100 * c:.1f}" for c in cells) + " |")
    return "\n".join(lines)


def run(out: str, variants: Sequence[str] = ("fedavg", "feddra"), seed: int = 0,
        settings: Mapping[str, Any] | None = None) -> dict:
    """Pre-train each variant on the two retina clients, evaluate it on mBRSET; results.json / results.md."""
    settings = {**RETINA, **(settings or {})}
    os.makedirs(out, exist_ok=True)
    data = write_retina_data(os.path.join(out, "data"), settings, seed)
    results: dict[str, dict] = {}
    for variant in variants:
        ws = os.path.join(out, "runs", f"{variant}_s{seed}")
        t0 = time.time()
        run_simulation(JOB, ws, n_sites=2, data_root=os.path.join(data, "sites", "{site}"), profile="quick",
                       sets=switch_sets(variant, settings, seed), echo=False)
        wall = time.time() - t0
        with open(_find(server_run_dir(ws), "test_metrics.json")) as f:
            test = json.load(f)
        model = VisionLanguageModel(preset=settings["preset"], vocab_size=settings["vocab_size"],
                                    image_size=settings["image_px"], in_chans=3, seed=seed)
        model.load_state_dict(load_global_state(global_model_path(ws)))
        results[variant] = {"retrieval": test.get("sites", {}), "wall_time_s": round(wall, 1),
                            "mbrset": mbrset_evaluation(model, os.path.join(data, "mbrset"), seed=seed,
                                                        fractions=settings["fractions"], **settings["finetune"])}
    keys = list(next(iter(results.values()))["mbrset"]["dr"]) if results else []
    table = format_table4(results, keys)
    text = (f"FedDRA ophthalmology (synthetic MESSIDOR-2 + BRSET, {settings['turns']} turns, preset "
            f"{settings['preset']}, seed {seed}); Table 4: mBRSET-like few-shot accuracy (%)\n\n{table}\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"settings": settings, "seed": seed, "results": results}, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
    return results
