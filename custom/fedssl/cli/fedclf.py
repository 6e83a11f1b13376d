"""``fedssl fedclf ...``: FedCLF's dermatology devices ("Federated Self-Supervised Learning for Dermatological
Disease Diagnosis", sec. V-A): synthetic stand-ins of the four public sources, and the 10 device folders built from
the real (or synthetic) sources."""

from __future__ import annotations

import os
import time

from fedssl.cli import COUNT, FRACTION, NON_NEGATIVE_REAL, SEED, Verb, add_family, add_threads_argument
from fedssl.cli.choices import FEDCLF_FRACTIONS, FEDCLF_METHODS, FEDCLF_TABLES, TABLE3_METHODS

SOURCE_FLAGS = (("isic", "ISIC 2019 training set (ground-truth CSV + ISIC_2019_Training_Input/)"),
                ("atlasderm", "AtlasDerm class-per-folder tree"), ("dermnet", "Dermnet class-per-folder tree"),
                ("darkderm", "DarkDerm class-per-folder tree"))


def _synth_args(s) -> None:
    s.add_argument("out", help="folder for isic2019/, atlasderm/, dermnet/, darkderm/")
    s.add_argument("--isic-images", type=COUNT, default=2000, help="ISIC five-class images (the paper's: 21,587)")
    s.add_argument("--size", type=COUNT, default=80, help="image height in pixels (width 4/3 of it)")
    s.add_argument("--seed", type=SEED, default=0)
    s.add_argument("--difficulty", type=NON_NEGATIVE_REAL, default=None,
                   help="acquisition nuisance (lesion contrast / (1 + d), more noise and blur); default: calibrated")


def _synth(a) -> None:
    from fedssl.data.fedclf_synthetic import write_synthetic_derm_sources

    t = time.perf_counter()
    info = write_synthetic_derm_sources(a.out, n_isic=a.isic_images, seed=a.seed, image_size=a.size,
                                        difficulty=a.difficulty)
    print(f"wrote the four synthetic sources under {os.path.abspath(a.out)} in {time.perf_counter() - t:.1f} s")
    for source, v in info.items():
        if source != "settings":
            print(f"  {source}: {sum(v['class_counts'].values())} images {v['class_counts']}")


def _devices_args(s) -> None:
    s.add_argument("out", help="folder for site-1 ... site-10 (train/val/test class folders) and devices.json")
    for flag, text in SOURCE_FLAGS:
        s.add_argument(f"--{flag}", required=True, help=text)
    s.add_argument("--seed", type=SEED, default=0, help="seeds the ISIC shards and the 60/20/20 splits")
    s.add_argument("--short-edge", type=COUNT, default=72, help="shorter image edge in pixels (paper: 72)")


def _devices(a) -> None:
    from fedssl.data.fedclf_devices import build_devices

    t = time.perf_counter()
    report = build_devices(a.out, a.isic, a.atlasderm, a.dermnet, a.darkderm, seed=a.seed, short_edge=a.short_edge)
    print(f"10 devices under {os.path.abspath(a.out)} in {time.perf_counter() - t:.1f} s (devices.json has the counts)")
    for site, d in report["devices"].items():
        counts = {split: sum(c.values()) for split, c in d["counts"].items()}
        print(f"  {site}: {d['source']}, {d['images']} images, {counts}")
    for source, info in report["skipped"].items():
        print(f"  {source}: skipped {info}")


def _tables_args(s) -> None:
    s.add_argument("--out", required=True, help="output folder: cells.jsonl (resume), tableI/II_{recall,precision}.*")
    s.add_argument("--tables", type=COUNT, nargs="+", choices=list(FEDCLF_TABLES), default=None)
    s.add_argument("--methods", nargs="+", choices=list(FEDCLF_METHODS), default=None)
    s.add_argument("--fractions", type=FRACTION, nargs="+", choices=list(FEDCLF_FRACTIONS), default=None)
    s.add_argument("--profile", default="bench")
    s.add_argument("--seeds", type=SEED, nargs="+", default=None,
                   help="training seeds: every pre-training and fine-tuning cell runs once per seed (initial weights, "
                        "sampling, augmentations) on the same data and labelled images; paired differences then "
                        "give the spread over seeds (default: the profile's, 0 1 2; a table of fewer seeds says it "
                        "is not a finding; a later run may add seeds to the folder)")
    s.add_argument("--split-seed", type=SEED, default=None,
                   help="seed of the data draw, the same for every training seed: the synthetic sources, the device "
                        "splits and which training images are labelled at each L (default: the profile's, 0; a "
                        "folder keeps its split seed)")
    s.add_argument("--data-root", default=None, help="device folders (fedssl fedclf devices); default: synthetic")
    s.add_argument("--workers", type=COUNT, default=1, help="processes for Table I's local fine-tuning cells")
    add_threads_argument(s)


def _tables(a) -> None:
    from fedssl.experiments.fedclf_tables import run_fedclf_tables, table_settings

    settings = table_settings(a.profile, tables=a.tables, methods=a.methods, fractions=a.fractions, seeds=a.seeds,
                              split_seed=a.split_seed)
    run_fedclf_tables(a.out, settings, data_root=a.data_root, workers=a.workers, say=lambda m: print(m, flush=True),
                      threads=a.threads)


def _table3_args(s) -> None:
    s.add_argument("--out", required=True, help="output folder: cells.jsonl (resume), tableIII.{json,csv,txt,png}")
    s.add_argument("--methods", nargs="+", choices=list(TABLE3_METHODS), default=None)
    s.add_argument("--profile", default="bench")
    s.add_argument("--seed", type=SEED, default=None,
                   help="seed of the synthetic images, the partitions and the models (one --out per seed)")
    s.add_argument("--data-root", default=None,
                   help="a partition folder (fedssl sslfl partition derm SRC OUT --job fedmae_derm); default: "
                        "synthetic")
    s.add_argument("--workers", type=COUNT, default=1, help="processes for the local fine-tuning cells")
    add_threads_argument(s)


def _table3(a) -> None:
    from fedssl.experiments.fedmae_table3 import run_table3, table3_settings

    settings = table3_settings(a.profile, methods=a.methods, seed=a.seed)
    run_table3(a.out, settings, data_root=a.data_root, workers=a.workers, say=lambda m: print(m, flush=True),
               threads=a.threads)


def _demo_args(s) -> None:
    s.add_argument("--out", default="runs/fedclf_demo", help="output folder (resumable: finished cells are kept)")
    s.add_argument("--workers", type=COUNT, default=2, help="processes for the local fine-tuning cells")
    add_threads_argument(s)


def _demo(a) -> None:
    from fedssl.experiments.fedclf_tables import run_fedclf_demo

    run_fedclf_demo(a.out, workers=a.workers, say=lambda m: print(m, flush=True), threads=a.threads)


def _control_args(s) -> None:
    s.add_argument("--out", required=True, help="output folder: the synthetic devices, control.jsonl (resume), "
                                                "control.json")
    s.add_argument("--profile", default="bench", help="the table's profile: the pre-training job's MoCo settings and "
                                                      "rounds, and the synthetic data's size")
    s.add_argument("--multipliers", nargs="+", type=COUNT, default=[1, 4, 16],
                   help="pre-training steps in multiples of the largest device's steps in the table (bench: 300)")
    s.add_argument("--federated-multipliers", nargs="*", type=COUNT, default=[],
                   help="FedMoCo federated over the ten devices in process (the job's FedAvg by image count, each "
                        "device's own bank) for these multiples of the table's rounds (bench: 30); none by default")
    s.add_argument("--seeds", nargs="+", type=SEED, default=[0, 1, 2])
    s.add_argument("--workers", type=COUNT, default=1, help="processes computing cells, the costliest first")
    add_threads_argument(s)


def _control(a) -> None:
    from fedssl.experiments.fedclf_control import run_control

    run_control(a.out, profile=a.profile, multipliers=a.multipliers, federated_multipliers=a.federated_multipliers,
                seeds=a.seeds, threads=a.threads, workers=a.workers, say=lambda m: print(m, flush=True))


VERBS = (
    Verb("synth", "synthetic ISIC 2019 / AtlasDerm / Dermnet / DarkDerm in the layouts the real sets ship in",
         _synth_args, _synth),
    Verb("devices", "the paper's 10 devices (7 ISIC shards + AtlasDerm, Dermnet, DarkDerm), 5 classes, 60/20/20, "
                    "72 px shorter edge", _devices_args, _devices),
    Verb("tables", "FedCLF Tables I (local) and II (federated fine-tuning) and Fig. 6 beside the paper's; resumable",
         _tables_args, _tables),
    Verb("table3", "Table III (FedMAE-KS setting, 8 ISIC classes, 10 IID clients): local fine-tuning at 80 % labels "
                   "of the CNN methods (ResNet-50) and FedMAE / random ViT beside the paper's; resumable",
         _table3_args, _table3),
    Verb("demo", "FedCLF vs FedMoCo vs random init on synthetic devices, local and federated fine-tuning at "
                 "L = 10 / 80 % (quick profile, about 15 min on 2 cores)", _demo_args, _demo),
    Verb("control", "FedMoCo's pooled control: one MoCo trainer on every device's images at 1x / 4x / 16x the "
                    "table's steps, its loss against chance and a frozen-encoder probe against random init",
         _control_args, _control),
)


def register(sub) -> None:
    add_family(sub, "fedclf", "FedCLF dermatology: synthetic sources, device folders, Tables I-III", VERBS)
