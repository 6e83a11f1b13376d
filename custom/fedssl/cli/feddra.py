"""``fedssl feddra ...``: FedDRA ("Distributionally Robust Alignment for Medical Federated Vision-Language
Pre-training Under Data Heterogeneity", Shuai, Wu, Tang and Shen, TMLR): synthetic MIMIC-CXR / retina layouts, the
paper's client split into site manifests, the demo and the Table 3 comparison."""

from __future__ import annotations

import json
import os
import time

from fedssl.cli import COUNT, POSITIVE, PROBABILITY, SEED, Verb, add_family, add_threads_argument
from fedssl.cli.choices import FEDDRA_VARIANTS


def _synth_args(s) -> None:
    s.add_argument("out", help="folder for mimic/ (MIMIC-CXR + -JPG layout), messidor2/, brset/, rsna/, covidx/")
    s.add_argument("--patients", type=COUNT, default=400, help="MIMIC-CXR patients (1-2 studies each)")
    s.add_argument("--retina-images", type=COUNT, default=300, help="images per retina source")
    s.add_argument("--ood-images", type=COUNT, default=300, help="images of each out-of-distribution set")
    s.add_argument("--size", type=COUNT, default=64, help="image height in pixels")
    s.add_argument("--seed", type=SEED, default=0)


def _synth(a) -> None:
    from fedssl.data import vlp_synthetic as vs

    t = time.perf_counter()
    info = vs.write_synthetic_mimic(os.path.join(a.out, "mimic"), n_patients=a.patients, image_px=a.size, seed=a.seed)
    vs.write_synthetic_messidor2(os.path.join(a.out, "messidor2"), n_images=a.retina_images, image_px=a.size,
                                 seed=a.seed)
    vs.write_synthetic_brset(os.path.join(a.out, "brset"), n_images=a.retina_images, image_px=a.size, seed=a.seed + 1)
    vs.write_synthetic_rsna(os.path.join(a.out, "rsna"), n_images=a.ood_images, image_px=a.size, seed=a.seed + 2)
    vs.write_synthetic_covidx(os.path.join(a.out, "covidx"), n_images=a.ood_images, image_px=a.size, seed=a.seed + 3)
    print(f"wrote synthetic MIMIC-CXR ({info.get('n_studies')} studies), MESSIDOR-2, BRSET, RSNA and COVIDx layouts "
          f"under {os.path.abspath(a.out)} in {time.perf_counter() - t:.1f} s")


def _split_args(s) -> None:
    s.add_argument("out", help="folder for site-1 ... site-N (each a manifest.csv) and split_summary.json")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--mimic", help="MIMIC-CXR(-JPG) root: files/, mimic-cxr-2.0.0-{chexpert,split,metadata}.csv(.gz)")
    src.add_argument("--retina", nargs=2, metavar=("MESSIDOR2", "BRSET"),
                     help="MESSIDOR-2 and BRSET roots: one client each (the ophthalmology setting)")
    s.add_argument("--clients", type=COUNT, default=5, help="clients of the LDA split (paper: 5)")
    s.add_argument("--alpha", type=POSITIVE, default=1.0, help="Dirichlet concentration (paper: 1; analysis: 5)")
    s.add_argument("--seed", type=SEED, default=0)
    s.add_argument("--relative", action="store_true",
                   help="write image / report paths relative to the source root (set the executor's source_root)")


def _split(a) -> None:
    from fedssl.data.vlp import load_brset, load_messidor2, load_mimic_vlp, write_client_manifests, \
        write_source_manifests

    t = time.perf_counter()
    if a.mimic:
        records, counts = load_mimic_vlp(a.mimic, site="mimic")
        paths = write_client_manifests(records, a.out, n_clients=a.clients, alpha=a.alpha, seed=a.seed,
                                       root=a.mimic if a.relative else None)
        print(f"{len(records)} frontal image-report pairs ({json.dumps(counts)}) -> {len(paths)} clients by LDA "
              f"(alpha {a.alpha}, seed {a.seed}) in {time.perf_counter() - t:.1f} s")
    else:
        sources = {"site-1": load_messidor2(a.retina[0], site="site-1", seed=a.seed)[0],
                   "site-2": load_brset(a.retina[1], site="site-2", seed=a.seed)[0]}
        paths = write_source_manifests(sources, a.out)
        print(f"MESSIDOR-2 ({len(sources['site-1'])} pairs) -> site-1, BRSET ({len(sources['site-2'])}) -> site-2")
    for p in paths:
        print(f"  {p}")


def _demo_args(s) -> None:
    s.add_argument("--out", default="runs/feddra_demo", help="output folder (resumable: finished cells are kept)")
    s.add_argument("--ablations", action="store_true", help="also the three Table 3 ablations (about +25 min)")
    s.add_argument("--seed", type=SEED, default=0,
                   help="one seed: the demo says its comparison is not a finding (fedssl feddra table runs 0 1 2)")
    add_threads_argument(s)


def _demo(a) -> None:
    from fedssl.experiments.feddra_demo import run

    variants = ["fedavg", "feddra"] + (["no_two_stage", "no_anchor", "no_dro"] if a.ablations else [])
    run(a.out, variants=variants, seeds=[a.seed], threads=a.threads)


def _table_args(s) -> None:
    s.add_argument("--out", required=True, help="output folder: cells.jsonl (resume), results.{json,md}, PNGs")
    s.add_argument("--variants", nargs="+", choices=list(FEDDRA_VARIANTS), default=list(FEDDRA_VARIANTS))
    s.add_argument("--seeds", type=SEED, nargs="+", default=[0, 1, 2])
    s.add_argument("--turns", type=COUNT, default=None, help="communication turns (default: the demo's)")
    s.add_argument("--patients", type=COUNT, default=None,
                   help="synthetic MIMIC-CXR patients (default: the demo's 1,000, about 55 test pairs per client; "
                        "5,000 gives every client more than the retrieval protocol's batch of 100)")
    s.add_argument("--style-coupling", type=PROBABILITY, default=None,
                   help="probability that a study takes its finding code's institution style (language and "
                        "acquisition; default: the demo's 0.7): the synthetic clients' heterogeneity, to calibrate on "
                        "FedAvg alone")
    s.add_argument("--device-rate", type=PROBABILITY, default=None,
                   help="probability of each line, tube or pacemaker in a study, drawn in its image and named in its "
                        "report (default: the demo's 0, none): without them a study with no finding shares nothing "
                        "with its report but the style, and a client of such studies retrieves at chance")
    s.add_argument("--data-root", default=None, help="a folder with sites/ and ood/ (default: synthetic under --out)")
    add_threads_argument(s)


def table_overrides(a) -> dict | None:
    """The demo settings the table's flags change (None: the demo's own)."""
    out = {k: v for k, v in (("turns", a.turns), ("n_patients", a.patients), ("style_coupling", a.style_coupling),
                             ("device_rate", a.device_rate)) if v is not None}
    return out or None


def _table(a) -> None:
    from fedssl.experiments.feddra_demo import run

    run(a.out, variants=a.variants, seeds=a.seeds, settings=table_overrides(a), data_root=a.data_root,
        threads=a.threads)


def _retina_args(s) -> None:
    s.add_argument("--out", default="runs/feddra_retina", help="output folder: data/, runs/, results.{json,md}")
    s.add_argument("--seed", type=SEED, default=0)
    s.add_argument("--turns", type=COUNT, default=None, help="communication turns (default 4 on the CPU)")


def _retina(a) -> None:
    from fedssl.experiments.feddra_retina import run

    run(a.out, seed=a.seed, settings={"turns": a.turns} if a.turns else None)


VERBS = (
    Verb("synth", "synthetic MIMIC-CXR(-JPG), MESSIDOR-2, BRSET, RSNA-Pneumonia and COVIDx layouts", _synth_args,
         _synth),
    Verb("split", "the paper's client split into per-site manifests: MIMIC-CXR by LDA over the 2^5 finding code, or "
                  "one retina source per client", _split_args, _split),
    Verb("demo", "FedAvg vs FedDRA (and the Table 3 ablations) on synthetic MIMIC-CXR in the FLARE simulator: "
                 "per-client R@1/R@5, average and worst client, DRO weights per turn (12-15 min on 2 shared cores)",
                 _demo_args, _demo),
    Verb("table", "Table 3 (and FedAvg, decentralised, centralised) over seeds with spread; resumable",
         _table_args, _table),
    Verb("retina", "jobs/feddra_retina (FedAvg, FedDRA) on synthetic MESSIDOR-2 + BRSET in the simulator, then "
                   "Table 4: mBRSET few-shot DR / edema accuracy at 10 / 20 / 100 % labels", _retina_args, _retina),
)


def register(sub) -> None:
    add_family(sub, "feddra", "FedDRA vision-language pre-training: synthetic layouts, client split, demo, Table 3",
               VERBS)
