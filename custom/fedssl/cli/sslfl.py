"""``fedssl sslfl <verb>``: SSL-FL (Yan et al., IEEE TMI 2023) and FedMAE-KS image data sets and ViT fine-tuning:
synthetic retina / derm / covidfl / derm_mel data and its site folders, the demo, local fine-tuning, encoder
export, evaluation, training throughput."""

from __future__ import annotations

import json
import os
import time

from fedssl.cli import (
    COUNT,
    FRACTION,
    NON_NEGATIVE,
    NON_NEGATIVE_REAL,
    POSITIVE,
    SEED,
    Verb,
    add_family,
    add_threads_argument,
)
from fedssl.cli.choices import SSLFL_CONTROL_ARMS, SSLFL_DATASETS, SSLFL_TABLE_METHODS, SSLFL_TABLE_SPLITS


def _synth_args(s) -> None:
    s.add_argument("dataset", choices=list(SSLFL_DATASETS))
    s.add_argument("out")
    s.add_argument("--images", type=COUNT, default=2000, help="total number of images")
    s.add_argument("--size", type=COUNT, default=64, help="image height in pixels")
    s.add_argument("--seed", type=SEED, default=0)
    s.add_argument("--sources", type=COUNT, default=None,
                   help="acquisition sources (retina/derm default 4; derm_mel 3; covidfl real sites, 1-8, default 8)")
    s.add_argument("--difficulty", type=NON_NEGATIVE_REAL, default=None,
                   help="retina only: lesion visibility 1/(1+d) and camera / illumination nuisance x d "
                        "(default: the calibrated setting)")


def _synth(a) -> None:
    from fedssl.data.image_synthetic import write_synthetic_images

    t = time.perf_counter()
    info = write_synthetic_images(a.out, a.dataset, a.images, seed=a.seed, image_size=a.size, n_sources=a.sources,
                                  difficulty=a.difficulty)
    counts = ", ".join(f"{k} {v}" for k, v in info["class_counts"].items())
    print(f"wrote {a.images} synthetic {a.dataset} images ({a.size} px) under {os.path.abspath(a.out)} "
          f"in {time.perf_counter() - t:.1f} s")
    print(f"classes: {counts}")
    print(f"sources: {', '.join(f'{k} {v}' for k, v in info['sources'].items())}")
    if "clients" in info:
        print(f"clients (split_real): {', '.join(f'{k} {v}' for k, v in info['clients'].items())}")


#: the partition verb's built-in defaults (a job's ``meta.json`` "partition" object overrides them; flags win)
PARTITION_DEFAULTS = {"sites": None, "alpha": 0.5, "split": "dirichlet", "release_split": None, "seed": 0,
                      "test_fraction": 0.2, "min_per_site": 10}


def _partition_args(s) -> None:
    s.add_argument("dataset", choices=list(SSLFL_DATASETS))
    s.add_argument("src", help="the full data set in its real layout (covidfl / derm_mel: SSL-FL's release)")
    s.add_argument("out")
    s.add_argument("--job", default=None, metavar="NAME|PATH",
                   help="take the defaults from the job's meta.json \"partition\" object "
                        "(e.g. fedmae_derm: IID, 10 sites)")
    s.add_argument("--split", choices=["dirichlet", "iid"], default=None,
                   help="dirichlet (SSL-FL, default) or iid (FedMAE-KS: random near-equal shards)")
    s.add_argument("--sites", type=COUNT, default=None, help="number of split sites (default 5)")
    s.add_argument("--alpha", type=POSITIVE, default=None,
                   help="Dirichlet alpha: 100 / 1.0 / 0.5 = Split-1 / 2 / 3 (default 0.5)")
    s.add_argument("--release-split", default=None,
                   help="covidfl / derm_mel: the release's client lists <N>_clients/NAME (covidfl default split_real; "
                        "'' = split anew with --split)")
    s.add_argument("--seed", type=SEED, default=None)
    s.add_argument("--test-fraction", type=FRACTION, default=None, help="retina/derm held-out share (default 0.2)")
    s.add_argument("--min-per-site", type=NON_NEGATIVE, default=None,
                   help="minimum training images per Dirichlet site (SSL-FL: 10)")


def job_partition_defaults(job: str) -> dict:
    """The "partition" object of a job's meta.json (``job`` = a job name under the repository's jobs/ or a folder),
    checked against :data:`PARTITION_DEFAULTS`'s keys; {} when the job has none."""
    from fedssl.ops.jobs import REPO_ROOT

    folder = job if os.path.isdir(job) else os.path.join(REPO_ROOT, "jobs", job)
    path = os.path.join(folder, "meta.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--job {job}: cannot read {path} ({e}); name a job folder with a meta.json") from e
    part = meta.get("partition", {})
    unknown = sorted(set(part) - set(PARTITION_DEFAULTS) - {"dataset"})
    if not isinstance(part, dict) or unknown:
        raise ValueError(f"{path}: \"partition\" must be an object with keys from {sorted(PARTITION_DEFAULTS)} "
                         f"and dataset; unknown: {unknown}")
    return part


def partition_settings(a) -> dict:
    """The partition arguments: a flag given on the command line, else the job's meta.json, else the default."""
    job = job_partition_defaults(a.job) if a.job else {}
    if job.get("dataset", a.dataset) != a.dataset:
        raise ValueError(f"--job {a.job} partitions {job['dataset']} data, not {a.dataset}")
    return {k: getattr(a, k) if getattr(a, k) is not None else job.get(k, d) for k, d in PARTITION_DEFAULTS.items()}


def _partition(a) -> None:
    from fedssl.data.image_sites import format_partition_table, write_site_folders

    o = partition_settings(a)
    part = write_site_folders(a.src, a.dataset, a.out, n_sites=o["sites"], alpha=o["alpha"], seed=o["seed"],
                              test_fraction=o["test_fraction"], min_per_site=o["min_per_site"], split=o["split"],
                              release_split=o["release_split"])
    how = (f"release clients {part['release_split']}" if part.get("release_split")
           else "IID shards" if part["split"] == "iid" else f"Dirichlet alpha={part['alpha']}")
    print(f"{part['n_sites']} site folders + test/ under {os.path.abspath(a.out)} ({how}, seed {part['seed']}, "
          f"images as {part['files']}s); counts in partition.json:")
    print(format_partition_table(part))


def _demo_args(s) -> None:
    s.add_argument("--out", default="runs/sslfl_demo")
    s.add_argument("--methods", nargs="+", default=["fedmae"], choices=["fedmae", "fedbeit", "fedmae_ks"],
                   help="pre-training methods, one data set: fedmae / fedbeit (retina) or fedmae_ks (derm)")
    s.add_argument("--no-scratch", action="store_true", help="leave out the ViT-from-scratch baseline")
    s.add_argument("--images", type=COUNT, default=2800,
                   help="images written (retina: a balanced subset, ~53%%, is kept)")
    s.add_argument("--px", type=COUNT, default=40, help="height of the synthetic fundus images")
    s.add_argument("--sites", type=COUNT, default=5)
    s.add_argument("--alpha", type=POSITIVE, default=0.5, help="Dirichlet alpha (0.5 = SSL-FL Split-3)")
    s.add_argument("--pre-rounds", type=COUNT, default=20)
    s.add_argument("--ft-rounds", type=COUNT, default=60)
    s.add_argument("--ft-epochs", type=COUNT, default=1, help="local epochs per fine-tuning round")
    s.add_argument("--ft-steps", type=NON_NEGATIVE, default=4,
                   help="at most this many local steps per epoch (0 = full epochs); few steps limit client drift under "
                        "Split-3")
    s.add_argument("--ft-lr", type=POSITIVE, default=0.003)
    s.add_argument("--seed", type=SEED, default=0)
    add_threads_argument(s)


def _demo(a) -> None:
    from fedssl.experiments.sslfl_demo import run_sslfl_demo

    run_sslfl_demo(a.out, methods=a.methods, scratch=not a.no_scratch, n_images=a.images, image_px=a.px,
                   n_sites=a.sites, alpha=a.alpha, pre_rounds=a.pre_rounds,
                   ft_rounds=a.ft_rounds, ft_epochs=a.ft_epochs, ft_steps=a.ft_steps, ft_lr=a.ft_lr, seed=a.seed,
                   threads=a.threads)


def _tables_args(s) -> None:
    s.add_argument("--out", required=True, help="output folder (cells.jsonl there: a re-run resumes)")
    s.add_argument("--splits", nargs="+", type=COUNT, choices=list(SSLFL_TABLE_SPLITS), default=None,
                   help="SSL-FL splits: 1 / 2 / 3 = Dirichlet alpha 100 / 1.0 / 0.5 (default: the profile's, all)")
    s.add_argument("--methods", nargs="+", choices=list(SSLFL_TABLE_METHODS), default=None,
                   help="scratch (random init), fedmae, fedbeit (default: the profile's, all three)")
    s.add_argument("--profile", default="bench", help="profile of the jobs and of tables.sslfl (default bench)")
    s.add_argument("--seeds", nargs="+", type=SEED, default=None,
                   help="data + job seeds (default: the profile's, 0 1 2; a row of fewer seeds is marked as not a "
                        "finding)")
    s.add_argument("--pretrain-rounds", type=COUNT, default=None,
                   help="pre-training rounds of every pre-trained method (default: the profile's job setting; the "
                        "learning-rate schedule spans them): the compute curve's multiples of the table's rounds")
    s.add_argument("--finetune-rounds", type=COUNT, default=None,
                   help="fine-tuning rounds of the pre-trained rows (default: the profile's job setting); ViT "
                        "scratch gets scratch_rounds_ratio times as many")
    s.add_argument("--scratch-rounds-ratio", type=COUNT, default=None,
                   help="ViT scratch's fine-tuning rounds over the pre-trained rows' (default: the profile's, else "
                        "the paper's 10; 1 = equal rounds, the random-init line of a compute curve)")
    add_threads_argument(s)


def _tables(a) -> None:
    from fedssl.experiments.sslfl_tables import run_sslfl_table, table_settings

    settings = table_settings(a.profile, splits=a.splits, methods=a.methods, seeds=a.seeds,
                              pretrain_rounds=a.pretrain_rounds, finetune_rounds=a.finetune_rounds,
                              scratch_rounds_ratio=a.scratch_rounds_ratio)
    run_sslfl_table(a.out, settings, say=lambda m: print(m, flush=True), threads=a.threads)


def _control_args(s) -> None:
    s.add_argument("--out", required=True, help="a `fedssl sslfl tables` output folder holding Fed-MAE pre-trainings "
                                                "(control.jsonl is written there: a re-run resumes)")
    s.add_argument("--profile", default="bench", help="the table's profile: the fine-tuning job's ViT and trainer")
    s.add_argument("--split", type=COUNT, choices=list(SSLFL_TABLE_SPLITS), default=3)
    s.add_argument("--seeds", nargs="+", type=SEED, default=[0, 1, 2])
    s.add_argument("--arms", nargs="+", choices=list(SSLFL_CONTROL_ARMS), default=list(SSLFL_CONTROL_ARMS),
                   help="starts: scratch (the ViT's init), fedmae (the table's pre-training), mae_init (MAE's "
                        "untrained init)")
    s.add_argument("--epochs", type=COUNT, default=40, help="passes over the pooled labelled images (default 40)")
    add_threads_argument(s)


def _control(a) -> None:
    from fedssl.experiments.sslfl_control import paired_lines, run_control

    rows = run_control(a.out, a.profile, a.split, a.seeds, a.arms, epochs=a.epochs, threads=a.threads,
                       say=lambda m: print(m, flush=True))
    for line in paired_lines(rows):
        print(line)


def _vit_opts(s) -> None:
    s.add_argument("--dataset", default="retina", choices=list(SSLFL_DATASETS))
    s.add_argument("--tiny", action="store_true", help="tiny ViT (32 px, patch 4, width 48, depth 2) on CPU")
    s.add_argument("--layer-scale", type=POSITIVE, default=None, help="0.1 for a Fed-BEiT encoder")
    s.add_argument("--rel-pos-bias", default=None, choices=["none", "per_layer", "shared"],
                   help="BEiT's relative position bias: per_layer for a Fed-BEiT encoder (default: none)")
    s.add_argument("--device", default=None)


def _settings(a) -> dict:
    from fedssl.experiments.sslfl_local import local_settings

    return local_settings(a.tiny, **{key: getattr(a, key, None)
                                     for key in ("epochs", "lr", "label_fraction", "val_fraction", "device",
                                                 "layer_scale", "rel_pos_bias")})


def _reference_args(s) -> None:
    s.add_argument("--out", required=True, help="output folder (the table's data is written there, or reused from a "
                                                "`fedssl sslfl tables` folder): reconstruction_reference.json")
    s.add_argument("--profile", default="bench", help="profile of the pre-training job and of tables.sslfl")
    s.add_argument("--splits", nargs="+", type=COUNT, choices=list(SSLFL_TABLE_SPLITS), default=[3])
    s.add_argument("--seeds", nargs="+", type=SEED, default=None, help="data seeds (default: the profile's, 0 1 2)")


def _reference(a) -> None:
    from fedssl.experiments.sslfl_tables import run_reconstruction_reference, table_settings

    settings = table_settings(a.profile, splits=a.splits, methods=["fedmae"], seeds=a.seeds)
    os.makedirs(a.out, exist_ok=True)
    run_reconstruction_reference(a.out, settings, say=lambda m: print(m, flush=True))


def _finetune_args(s) -> None:
    s.add_argument("--data-root", required=True, help="folder with site-* folders (and test/) from `fedssl sslfl "
                                                      "partition`")
    s.add_argument("--init", action="append", required=True, metavar="NAME=PATH|scratch|imagenet:PATH")
    s.add_argument("--test-root", default="", help="default: DATA_ROOT/test")
    s.add_argument("--epochs", type=COUNT, default=None)
    s.add_argument("--lr", type=POSITIVE, default=None)
    s.add_argument("--label-fraction", type=FRACTION, default=None)
    s.add_argument("--val-fraction", type=FRACTION, default=None)
    s.add_argument("--verbose", action="store_true")
    s.add_argument("--out", default="finetune_vit.json")
    _vit_opts(s)


def _parse_inits(specs: list[str]) -> dict[str, tuple[str, str]]:
    """``--init NAME=PATH|scratch|imagenet:PATH`` -> {name: (pretrained_path, imagenet_path)}."""
    inits = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not path:
            raise ValueError(f"--init {spec!r}: use NAME=PATH (pre-training FL_global_model.pt), NAME=scratch or "
                             "NAME=imagenet:PATH")
        inits[name] = ("", "") if path == "scratch" else ("", path[9:]) if path.startswith("imagenet:") else (path, "")
    return inits


def _finetune(a) -> None:
    from fedssl.core.classification import format_metric
    from fedssl.experiments.sslfl_local import run_finetune_local

    rows = run_finetune_local(a.data_root, a.dataset, _parse_inits(a.init), a.out, settings=_settings(a),
                              test_root=a.test_root,
                              progress=(lambda m: print("  " + m, flush=True)) if a.verbose else None)
    for r in rows:
        t = r["test"]
        print(f"{r['method']:<12} {r['site']:<8} best epoch {r['best_epoch']:>3}: test accuracy "
              f"{format_metric(t['accuracy'])}, balanced {format_metric(t['balanced_accuracy'])}, AUC "
              f"{format_metric(t['auc'])}")
    print(f"wrote {a.out}")


def _export_args(s) -> None:
    s.add_argument("pretrained")
    s.add_argument("out")


def _export(a) -> None:
    from fedssl.models.vit_classifier import export_encoder

    print(json.dumps(export_encoder(a.pretrained, a.out)))


def _evaluate_args(s) -> None:
    s.add_argument("checkpoint")
    s.add_argument("--test-root", required=True)
    _vit_opts(s)


def _evaluate(a) -> None:
    from fedssl.experiments.sslfl_local import evaluate_checkpoint

    m = evaluate_checkpoint(a.checkpoint, a.test_root, a.dataset, settings=_settings(a))
    print(json.dumps({k: v for k, v in m.items() if k != "confusion_matrix"}, indent=1))


def _bench_args(b) -> None:
    b.add_argument("--methods", nargs="+", default=["mae", "beit", "finetune"], choices=["mae", "beit", "finetune"])
    b.add_argument("--size", default="vit_b16", choices=["vit_b16", "tiny"],
                   help="vit_b16 = paper (224 px); tiny = CPU twin")
    b.add_argument("--batch-sizes", nargs="+", type=COUNT, default=[64])
    b.add_argument("--steps", type=COUNT, default=20, help="timed steps per measurement")
    b.add_argument("--warmup", type=NON_NEGATIVE, default=5, help="untimed steps before timing")
    b.add_argument("--no-amp", action="store_true", help="float32 instead of bfloat16 autocast (GPU)")
    b.add_argument("--device", default="auto", help="auto (GPU when present), cpu, cuda, cuda:1 ...")
    b.add_argument("--out", default=None, help="write the measurements to this JSON file")


def _bench(a) -> None:
    from fedssl.experiments.bench import run_bench

    run_bench(a.out, methods=a.methods, size=a.size, batch_sizes=a.batch_sizes, steps=a.steps, warmup=a.warmup,
              amp=not a.no_amp, device=a.device)


VERBS = (
    Verb("synth", "write a synthetic retina / derm / covidfl / derm_mel data set in its real layout", _synth_args,
         _synth),
    Verb("partition", "held-out test set + Dirichlet / IID (or the release's COVID-FL clients) site folders",
         _partition_args, _partition),
    Verb("demo", "synthetic retina -> Split-3 -> Fed-MAE (or Fed-BEiT; FedMAE-KS on derm) -> federated fine-tuning "
                 "vs scratch (quick)", _demo_args, _demo),
    Verb("tables", "SSL-FL's retina table (Table II): Split-1/2/3 x scratch / Fed-MAE / Fed-BEiT in the simulator, "
                   "resumable, beside the paper's numbers", _tables_args, _tables),
    Verb("control", "pooled control of the table's Fed-MAE: all sites' labels in one bare fine-tuning loop from "
                    "scratch, the pre-trained and MAE's untrained init", _control_args, _control),
    Verb("mae-reference", "MAE's loss without learning on the table's data: predicting the mean and harmonic "
                          "inpainting of the masked patches from the visible pixels", _reference_args, _reference),
    Verb("finetune", "local (per-site) ViT fine-tuning: epoch chosen on validation, then test", _finetune_args,
         _finetune),
    Verb("export-encoder", "pre-training FL_global_model.pt -> encoder-only state dict", _export_args, _export),
    Verb("evaluate", "test metrics of a fine-tuned checkpoint (refuses an untrained head)", _evaluate_args, _evaluate),
    Verb("bench", "training throughput (images/s) of the ViT-B/16 MAE, BEiT and fine-tuning steps", _bench_args,
         _bench),
)


def register(sub) -> None:
    add_family(sub, "sslfl", "SSL-FL image classification with Fed-MAE / Fed-BEiT: data, demo, ViT fine-tuning, "
                             "export, evaluation, throughput", VERBS)
