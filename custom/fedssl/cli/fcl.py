"""``fedssl fcl <verb>``: ACDC / FCL / FCLOpt (FCL (Wu et al., MedIA 2022)): synthetic ACDC, site folders, U-Net export, local and
centralised fine-tuning with the Dice table, Table 7 and the README's demo."""

from __future__ import annotations

import json
import os

from fedssl.cli import COUNT, NON_NEGATIVE, SEED, Verb, add_family


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


def _export_unet_args(s) -> None:
    s.add_argument("pretrained")
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
    s.add_argument("--profile", default=None)
    s.add_argument("--epochs", type=COUNT, default=None)
    s.add_argument("--out", required=True)


def _finetune(a) -> None:
    from fedssl.eval.report import format_table, summarise
    from fedssl.experiments.fcl_finetune import run_finetune

    rows = run_finetune(a.data_root, _parse_inits(a.init), a.out, modes=a.modes, n_labelled=a.n, folds=a.folds,
                        profile=a.profile, epochs=a.epochs,
                        progress=lambda r: print(f"  {r['mode']:<11} {r['method']:<8} N={r['n_labelled']} fold {r['fold']} {r['site']}: Dice {r['dice']:.3f}", flush=True))
    print(format_table(summarise(rows)))


def _table7_args(s) -> None:
    s.add_argument("--out", default="runs/table7")
    s.add_argument("--sites", type=COUNT, default=3)
    s.add_argument("--rounds", type=COUNT, default=11, help="pre-training rounds (11 include two DP calibrations)")
    s.add_argument("--n", type=COUNT, nargs="+", default=[1, 2, 4, 8])
    s.add_argument("--epochs", type=COUNT, default=None, help="local fine-tuning epochs (default: the profile's)")
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
    s.add_argument("--epochs", type=COUNT, default=None, help="local fine-tuning epochs (default: quick profile)")


def _demo(a) -> None:
    from fedssl.experiments.fcl_demo import run_demo

    run_demo(a.out, n_sites=a.sites, rounds=a.rounds, ft_rounds=a.ft_rounds, n_labelled=a.n, epochs=a.epochs)


VERBS = (
    Verb("synth", "write a synthetic dataset in its real on-disk layout", _synth_args, _synth, alias="synth"),
    Verb("link-sites", "split a real ACDC training/ folder into site-k folders (symlinks)", _link_sites_args,
         _link_sites, alias="link-sites"),
    Verb("finetune", "local / centralised fine-tuning protocol and Dice table", _finetune_args, _finetune,
         alias="finetune"),
    Verb("export-unet", "pre-trained FL_global_model.pt -> U-Net init checkpoint", _export_unet_args, _export_unet,
         alias="export-unet"),
    Verb("table7", "FCL (Wu et al., MedIA 2022) Table 7: bytes per round (FCL = 1) and Dice, six methods", _table7_args, _table7,
         alias="table7"),
    Verb("demo", "synthetic ACDC -> FCL in the simulator -> fine-tuning -> Dice table (quick profile)", _demo_args,
         _demo, alias="demo"),
)


def register(sub) -> None:
    add_family(sub, "fcl", "ACDC segmentation with FCL / FCLOpt: data, fine-tuning, Table 7, demo", VERBS)
