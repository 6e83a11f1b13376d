"""``fedssl fcl <verb>``: ACDC / FCL / FCLOpt (FCL (Wu et al., MedIA 2022)): synthetic ACDC, site folders, U-Net export,
local and centralised fine-tuning with the Dice table, Table 7 and the README's demo."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fedssl.cli import (
    COUNT,
    NON_NEGATIVE,
    NON_NEGATIVE_REAL,
    POSITIVE,
    SEED,
    Verb,
    add_family,
    add_threads_argument,
)


def _synth_args(s) -> None:
    s.add_argument("dataset", choices=["acdc"])
    s.add_argument("out")
    s.add_argument("--patients", type=COUNT, default=100)
    s.add_argument("--sites", type=COUNT, default=10)
    s.add_argument("--seed", type=SEED, default=0)
    s.add_argument("--size", type=COUNT, default=128, help="in-plane matrix size of the written volumes")


def _synth(a) -> None:
    from fedssl.data.acdc_synthetic import write_synthetic_acdc

    sites = write_synthetic_acdc(a.out, n_patients=a.patients, n_sites=a.sites, seed=a.seed, shape=(a.size, a.size))
    print(f"wrote {a.patients} synthetic ACDC patients in {len(sites)} site folders under {os.path.abspath(a.out)}")


def _link_sites_args(s) -> None:
    s.add_argument("src")
    s.add_argument("out")
    s.add_argument("--sites", type=COUNT, default=10)
    s.add_argument("--per-site", type=COUNT, default=10)
    s.add_argument("--seed", type=SEED, default=0)


def _link_sites(a) -> None:
    from fedssl.data.acdc_synthetic import link_site_folders

    sites = link_site_folders(a.src, a.out, n_sites=a.sites, per_site=a.per_site, seed=a.seed)
    print(json.dumps(sites, indent=1))


def _volumes_args(s) -> None:
    s.add_argument("data_root", help="a folder of patientNNN/ (one site) or of site-*/ folders")
    s.add_argument("--json", metavar="PATH", help="also write the per-patient rows and the group means as JSON")


def _volumes(a) -> None:
    from fedssl.data.acdc import cavity_volumes, summarise_cavity_volumes
    from fedssl.data.site_config import site_folders

    root = Path(a.data_root)
    sites = [Path(p) for p in site_folders(root, required=False).values()] or [root]
    rows = [dict(r, site=d.name) for d in sites for r in cavity_volumes(d, site=d.name)]
    summary = summarise_cavity_volumes(rows)
    print("| group | n | RV ml (ED / ES) | MYO ml (ED / ES) | LV ml (ED / ES) | RV / LV at ED | RV EF | LV EF |")
    print("|---|---|---|---|---|---|---|---|")
    for g in summary:
        print(f"| {g['group']} | {g['n']} | {g['RV_ED_ml']:.0f} / {g['RV_ES_ml']:.0f} | {g['MYO_ED_ml']:.0f} / "
              f"{g['MYO_ES_ml']:.0f} | {g['LV_ED_ml']:.0f} / {g['LV_ES_ml']:.0f} | {g['RV_LV_ED']:.2f} | "
              f"{g['RV_EF']:.2f} | {g['LV_EF']:.2f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"patients": rows, "groups": summary}, indent=1), encoding="utf-8")


def _export_unet_args(s) -> None:
    s.add_argument("pretrained", help="a pre-training run's FL_global_model.pt, or for Local CL a site's own "
                                      "<workspace>/site-k/<job>/fcl_client_state.pt")
    s.add_argument("out")
    s.add_argument("--features", type=COUNT, nargs=6, default=[48, 96, 192, 384, 768, 48])


def _export_unet(a) -> None:
    from fedssl.experiments.fcl_finetune import export_unet_init

    print(export_unet_init(a.pretrained, a.out, a.features))


def _parse_inits(specs: list[str]) -> dict[str, str]:
    """``--init NAME=PATH|random`` -> {name: path or "random"}."""
    inits: dict[str, str] = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not path:
            raise ValueError(f"--init {spec!r}: use NAME=PATH_TO_FL_global_model.pt or NAME=random")
        inits[name] = path
    return inits


def _finetune_args(s) -> None:
    s.add_argument("--data-root", required=True, help="folder with site-* folders")
    s.add_argument("--init", action="append", required=True, metavar="NAME=PATH|random")
    s.add_argument("--n", type=COUNT, nargs="+", default=[1, 2, 4, 8])
    s.add_argument("--folds", type=NON_NEGATIVE, nargs="+", default=[0, 1, 2, 3, 4])
    s.add_argument("--modes", nargs="+", default=["local"], choices=["local", "centralised"])
    s.add_argument("--labelled-from", default="pooled", choices=["pooled", "per_site"],
                   help="centralised mode: N annotated patients in total from the pooled sites (paper, FCL Table 3) "
                        "or N from every site")
    s.add_argument("--profile", default=None)
    s.add_argument("--epochs", type=COUNT, default=None, help="fine-tuning epochs, without the profile's step floor "
                   "(default: the profile's epochs and floor)")
    s.add_argument("--out", required=True)


def _finetune(a) -> None:
    from fedssl.eval.report import format_table, summarise
    from fedssl.experiments.fcl_finetune import run_finetune

    rows = run_finetune(a.data_root, _parse_inits(a.init), a.out, modes=a.modes, n_labelled=a.n, folds=a.folds,
                        profile=a.profile, epochs=a.epochs, labelled_from=a.labelled_from,
                        progress=lambda r: print(f"  {r['mode']:<11} {r['method']:<8} N={r['n_labelled']} fold "
                                                 f"{r['fold']} {r['site']}: Dice {r['dice']:.3f}", flush=True))
    print(format_table(summarise(rows)))


def _table7_args(s) -> None:
    s.add_argument("--out", default="runs/table7")
    s.add_argument("--sites", type=COUNT, default=3)
    s.add_argument("--rounds", type=COUNT, default=11, help="pre-training rounds (11 include two DP calibrations)")
    s.add_argument("--n", type=COUNT, nargs="+", default=[1, 2, 4, 8])
    s.add_argument("--epochs", type=COUNT, default=None,
                   help="local fine-tuning epochs, without the profile's step floor "
                   "(default: the profile's epochs and floor)")
    s.add_argument("--data-root", default=None, help="folder with site-* folders (default: synthetic)")
    s.add_argument("--profile", default="quick", help="quick on CPU; paper where a GPU is available")


def _table7(a) -> None:
    from fedssl.experiments.table7 import run_table7

    run_table7(a.out, n_sites=a.sites, rounds=a.rounds, n_labelled=a.n, epochs=a.epochs, data_root=a.data_root,
               profile=a.profile)


def _demo_args(s) -> None:
    s.add_argument("--out", default="runs/demo")
    s.add_argument("--sites", type=COUNT, default=3)
    s.add_argument("--rounds", type=COUNT, default=10, help="FCL pre-training rounds")
    s.add_argument("--ft-rounds", type=COUNT, default=10, help="federated fine-tuning rounds")
    s.add_argument("--n", type=COUNT, nargs="+", default=[1, 2])
    s.add_argument("--epochs", type=COUNT, default=None, help="local fine-tuning epochs, without the step floor "
                   "(default: the quick profile's epochs and floor)")
    add_threads_argument(s)


def _demo(a) -> None:
    from fedssl.experiments.fcl_demo import run_demo

    run_demo(a.out, n_sites=a.sites, rounds=a.rounds, ft_rounds=a.ft_rounds, n_labelled=a.n, epochs=a.epochs,
             threads=a.threads)


def _tables_args(s) -> None:
    from fedssl.eval.paper_tables import FCL_METHODS, FCL_TABLE_MODES  # light: argument parsing stays fast

    s.add_argument("--out", required=True, help="output folder: cells.jsonl (resume), table{1,2,3}.{txt,csv,json,png}")
    s.add_argument("--tables", type=COUNT, nargs="+", default=list(FCL_TABLE_MODES), choices=list(FCL_TABLE_MODES))
    s.add_argument("--methods", nargs="+", default=list(FCL_METHODS), choices=list(FCL_METHODS))
    s.add_argument("--n", type=COUNT, nargs="+", default=[1, 2, 4, 8], choices=[1, 2, 4, 8])
    s.add_argument("--folds", type=NON_NEGATIVE, nargs="+", default=None, choices=range(5),
                   help="folds of every table (default: the profile's tables.fcl.folds per table, else 0-4)")
    s.add_argument("--sites", type=COUNT, default=3)
    s.add_argument("--profile", default="bench")
    s.add_argument("--data-root", default=None, help="folder with site-* folders (default: synthetic ACDC under --out)")
    s.add_argument("--difficulty", type=NON_NEGATIVE_REAL, default=None,
                   help="synthetic data difficulty (default: calibrated)")
    s.add_argument("--epochs", type=COUNT, default=None, help="fine-tuning epochs, without the profile's step floor "
                   "(default: the profile's epochs and floor)")
    s.add_argument("--rounds", type=COUNT, default=None, help="pre-training rounds (default: the profile's)")
    s.add_argument("--workers", type=COUNT, default=2, help="processes for local / centralised fine-tuning cells")
    s.add_argument("--pretrained-from", default=None, metavar="DIR",
                   help="reuse the finished pre-training runs of another tables folder (same data, sites, rounds "
                   "and the profile's job settings), e.g. to fine-tune with other epochs; diagnostics run here")
    s.add_argument("--seeds", type=SEED, nargs="+", default=[0, 1, 2],
                   help="training seeds: every pre-training and fine-tuning cell runs once per seed (the labelled "
                   "patients stay the same); paired differences then give the spread over seeds (default: 0 1 2; "
                   "a table of fewer seeds says it is not a finding)")
    add_threads_argument(s)


def _tables(a) -> None:
    from fedssl.experiments.fcl_tables import run_fcl_tables

    run_fcl_tables(a.out, tables=a.tables, methods=a.methods, n_labelled=a.n, folds=a.folds, n_sites=a.sites,
                   profile=a.profile, data_root=a.data_root, difficulty=a.difficulty, epochs=a.epochs,
                   rounds=a.rounds, workers=a.workers, pretrained_from=a.pretrained_from, seeds=a.seeds,
                   threads=a.threads)


def _hvsmr_synth_args(s) -> None:
    s.add_argument("out")
    s.add_argument("--subjects", type=COUNT, default=10, help="labelled subjects pat0... (the challenge has 10)")
    s.add_argument("--size", type=COUNT, nargs=3, default=[128, 128, 96], metavar=("X", "Y", "Z"))
    s.add_argument("--seed", type=SEED, default=0)
    s.add_argument("--archive-folders", action="store_true",
                   help="images under 'Training dataset/', labels under 'Ground truth/' (as the archive unpacks)")


def _hvsmr_synth(a) -> None:
    from fedssl.data.hvsmr_synthetic import write_synthetic_hvsmr

    ids = write_synthetic_hvsmr(a.out, n_subjects=a.subjects, seed=a.seed, shape=tuple(a.size),
                                archive_folders=a.archive_folders)
    print(f"wrote {len(ids)} synthetic HVSMR subjects under {os.path.abspath(a.out)}")


def _transfer_args(s) -> None:
    s.add_argument("--data-root", required=True, help="HVSMR 2016 training folder (see `fedssl fcl hvsmr-synth`)")
    s.add_argument("--init", action="append", required=True, metavar="NAME=PATH|random",
                   help="an ACDC pre-training FL_global_model.pt, an export-unet checkpoint, or random")
    s.add_argument("--n", type=COUNT, nargs="+", default=[1, 2, 4, 8], help="M annotated subjects (FCL Table 5)")
    s.add_argument("--folds", type=NON_NEGATIVE, nargs="+", default=[0, 1, 2, 3, 4])
    s.add_argument("--variant", default="axial_crop", choices=["axial_crop", "axial_full", "sa_crop"])
    s.add_argument("--image-size", type=COUNT, default=192)
    s.add_argument("--spacing", type=POSITIVE, default=0.7, help="in-plane mm after resampling (paper: 0.7)")
    s.add_argument("--features", type=COUNT, nargs=6, default=[48, 96, 192, 384, 768, 48],
                   help="U-Net channels: those of the pre-training run")
    s.add_argument("--norm", choices=["batch", "instance"], default="batch",
                   help="U-Net normalisation: that of the pre-training run (jobs' default: batch)")
    s.add_argument("--epochs", type=COUNT, default=200)
    s.add_argument("--lr", type=POSITIVE, default=5e-4)
    s.add_argument("--seed", type=SEED, default=0)
    s.add_argument("--device", default="cpu")
    s.add_argument("--out", required=True)


def _transfer(a) -> None:
    from fedssl.eval.report import format_table
    from fedssl.experiments.fcl_transfer import run_transfer
    from fedssl.train.transfer import summarise_transfer

    settings = {"n_labelled": a.n, "folds": a.folds, "target_spacing": a.spacing, "features": a.features,
                "norm": a.norm, "epochs": a.epochs, "lr": a.lr, "device": a.device}
    rows = run_transfer(a.data_root, _parse_inits(a.init), a.out, settings=settings, variant=a.variant,
                        image_size=a.image_size, seed=a.seed,
                        progress=lambda r: print(f"  {r['method']:<8} M={r['n_labelled']} fold {r['fold']}: Dice "
                                                 f"{r['dice']:.3f} (myocardium {r['myocardium']:.3f}, blood pool "
                                                 f"{r['blood_pool']:.3f}) {r['seconds']:.1f}s", flush=True))
    print(format_table(summarise_transfer(rows)))


VERBS = (
    Verb("synth", "write a synthetic dataset in its real on-disk layout", _synth_args, _synth),
    Verb("link-sites", "split a real ACDC training/ folder into site-k folders (symlinks)", _link_sites_args,
         _link_sites),
    Verb("volumes", "RV / MYO / LV volumes (ml) at ED and ES per ACDC group, RV / LV and ejection fractions",
         _volumes_args, _volumes),
    Verb("finetune", "local / centralised fine-tuning protocol and Dice table", _finetune_args, _finetune),
    Verb("export-unet", "pre-trained FL_global_model.pt -> U-Net init checkpoint", _export_unet_args, _export_unet),
    Verb("table7", "FCL (Wu et al., MedIA 2022) Table 7: bytes per round (FCL = 1) and Dice, six methods",
         _table7_args, _table7),
    Verb("demo", "synthetic ACDC -> FCL in the simulator -> fine-tuning -> Dice table (CPU, ~10 min)", _demo_args,
         _demo),
    Verb("tables", "FCL Tables 1-3 (local, federated, centralised fine-tuning) beside the paper's; resumable",
         _tables_args, _tables),
    Verb("hvsmr-synth", "write synthetic HVSMR 2016 subjects in the challenge's layout", _hvsmr_synth_args,
         _hvsmr_synth),
    Verb("transfer", "FCL Table 5: fine-tune on HVSMR from ACDC pre-trained encoders vs random init, Dice per class",
         _transfer_args, _transfer),
)


def register(sub) -> None:
    add_family(sub, "fcl", "ACDC segmentation with FCL / FCLOpt: data, fine-tuning, Table 7, demo", VERBS)
