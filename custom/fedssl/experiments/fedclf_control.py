"""FedMoCo's pooled control (issue 44 H2-H4 for "Federated Self-Supervised Learning for Dermatological Disease
Diagnosis"): is the MoCo loss of ``fedssl fedclf tables`` at chance because of the federation, or because of the
compute?

One MoCo trainer (:class:`fedssl.train.fedclf.FedCLFLocalTrainer`, FedMoCo's loss: queue ``"none"``, the local
bank only) gets every device's unlabelled training images pooled, with the pre-training job's settings at the
profile (network, batch, lr, tau, momentum, K), in a bare loop without FLARE.  "1x" is the optimiser steps the
largest device makes in the table's pre-training (rounds x its full batches per epoch: 30 x 10 = 300 at bench);
multiplier ``m`` trains for the pooled epochs closest to ``m`` times that, with the cosine schedule over them.

Each pre-training records its loss per epoch against chance, ln(K+1), and the feature spread, judged by the
bundle's loss-health rule (:func:`fedssl.experiments.diagnostics.pretraining_health`).  Then a frozen-encoder
linear probe: logistic regression on the encoder's pooled features (standardised) of every device's labelled
training images, balanced accuracy (mean recall over the classes, the tables' recall) on every device's test
images; the same probe on the untrained network of the same seed is the random-init line, paired by seed.

If the pooled loss also stays at chance at the table's compute, the federation is not what keeps it there; if it
falls with more steps, the table's pre-training is short of compute.  Each finished cell is a line of
``control.jsonl`` under ``out`` (resumable).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict

import torch

from fedssl.core.checks import require, require_int
from fedssl.core.classification import classification_metrics
from fedssl.data.fedclf_devices import load_device
from fedssl.data.images import ImageDataset, ImageRecord, batches, class_names
from fedssl.experiments.diagnostics import CHANCE_MARGIN, pretraining_health
from fedssl.experiments.environment import check_threads, set_threads
from fedssl.experiments.fedclf_tables import prepare_devices, table_settings
from fedssl.experiments.sslfl_control import component_args
from fedssl.experiments.table_runner import CellStore
from fedssl.models.resnet import PretrainingResNet
from fedssl.train.fedclf import FedCLFLocalTrainer, FedCLFSettings
from fedssl.train.probe import fit_logistic

PRETRAIN_JOB = "fedclf_derm"
#: the pre-training trainer's arguments the bare loop takes over (data, federation and device are its own)
TRAINER_KEYS = ("dataset", "image_size", "width", "proj_dim", "depth", "batch_size", "lr", "tau", "momentum",
                "bank_size")
PROBE_BATCH = 64


def control_settings(profile: str, seed: int, sets: Sequence[str] = ()) -> tuple[FedCLFSettings, int]:
    """(FedMoCo's settings for one pooled trainer, the table's pre-training rounds): the ``fedclf_derm`` job's
    ``fedclf_trainer`` at ``profile`` with ``sets``, queue ``"none"``, not federated, full epochs, CPU."""
    args = component_args(PRETRAIN_JOB, profile, "fedclf_trainer", sets)
    rounds = component_args(PRETRAIN_JOB, profile, "scatter_and_gather", sets)["num_rounds"]
    settings = FedCLFSettings(**{k: args[k] for k in TRAINER_KEYS if k in args}, method="moco", queue="none",
                              federated=False, max_steps_per_round=0, seed=seed, device="cpu", split="train")
    settings.check("fedclf control")
    return settings, int(rounds)


def one_x_steps(train: Mapping[str, Sequence[ImageRecord]], batch_size: int, rounds: int) -> int:
    """The optimiser steps of the largest device in the table's pre-training: ``rounds`` epochs of full batches."""
    return rounds * max(len(r) // batch_size for r in train.values())


def pooled_epochs(n_images: int, batch_size: int, steps: int) -> int:
    """The whole pooled epochs (at least one) whose full batches come closest to ``steps``."""
    per_epoch = n_images // batch_size
    require(per_epoch >= 1, "fedclf control", "batch_size", batch_size,
            f"the {n_images} pooled images cannot fill one batch; lower it")
    return max(1, round(steps / per_epoch))


def pretrain(records: Sequence[ImageRecord], settings: FedCLFSettings, epochs: int,
             say: Callable[[str], None] = print) -> tuple[PretrainingResNet, list[dict]]:
    """MoCo on ``records`` for ``epochs`` pooled epochs; returns the network and one record per epoch (``round``,
    ``loss``, ``steps``, the trainer's metrics: ``chance_loss``, ``feature_std``, ``lr_end`` ...); ``say`` gets a
    progress line per epoch."""
    trainer = FedCLFLocalTrainer(records, settings, num_rounds=epochs, site="pooled")
    rounds = []
    for r in range(epochs):
        stats = trainer.train_round(r)
        numbers = {k: v for k, v in stats.metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        rounds.append({"round": r, "loss": stats.loss, "steps": stats.steps, **numbers})
        say(f"  seed {settings.seed} epoch {r + 1}/{epochs}: loss {stats.loss:.3f} (chance "
            f"{numbers.get('chance_loss', float('nan')):.3f}), spread {numbers.get('feature_std', float('nan')):.3f}")
    return trainer.model, rounds


def encoder_features(model: PretrainingResNet, records: Sequence[ImageRecord], settings: FedCLFSettings
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the query encoder's pooled features ``[N, D]`` in eval mode, labels ``[N]``) of ``records`` without
    augmentation, in a fixed order."""
    encoder = model.main.encoder
    was_training = encoder.training
    encoder.eval()
    feats, labels = [], []
    dataset = ImageDataset(records, settings.image_size, "eval", settings.dataset, site="pooled")
    with torch.no_grad():
        for x, y in batches(dataset, PROBE_BATCH, seed=0, epoch=0):
            feats.append(encoder(x).flatten(1))
            labels.append(y)
    encoder.train(was_training)
    return torch.cat(feats), torch.cat(labels)


def linear_probe(model: PretrainingResNet, train: Sequence[ImageRecord], test: Sequence[ImageRecord],
                 settings: FedCLFSettings, seed: int) -> dict:
    """Logistic regression on the frozen encoder's features of ``train`` (standardised with their mean and std),
    scored on ``test`` by :func:`fedssl.core.classification.classification_metrics`: ``balanced_accuracy`` (macro
    recall, the tables' recall), ``accuracy``, the counts."""
    xs, ys = encoder_features(model, train, settings)
    xt, yt = encoder_features(model, test, settings)
    mean, std = xs.mean(dim=0), xs.std(dim=0, unbiased=False).clamp(min=1e-6)
    names = class_names(settings.dataset)
    head = fit_logistic((xs - mean) / std, ys, len(names), seed=seed)
    with torch.no_grad():
        probs = torch.softmax(head((xt - mean) / std), dim=1)
    m = classification_metrics(probs, yt.tolist(), names)
    return {"balanced_accuracy": m["balanced_accuracy"], "accuracy": m["accuracy"], "n_train": len(train),
            "n_test": len(test)}


def split_records(devices: str, site: str, split: str) -> list[ImageRecord]:
    """A device's records of ``split``; none where the device has no image in it (a small synthetic draw)."""
    return load_device(devices, site, split) if os.path.isdir(os.path.join(devices, site, split)) else []


def run_control(out: str, *, profile: str = "bench", multipliers: Sequence[int] = (1, 4, 16),
                seeds: Sequence[int] = (0, 1, 2), n_isic: int | None = None, threads: int = 1,
                say: Callable[[str], None] = print) -> dict:
    """Every (seed, random / multiplier) cell not yet in ``out/control.jsonl``; writes and returns
    ``out/control.json`` (settings, cells, :func:`summarise`'s rows and lines)."""
    set_threads(check_threads(threads, "fedclf control: argument threads"))
    for m in multipliers:
        require_int("fedclf control", "multipliers", m, 1, "use positive multiples of the table's steps, e.g. 1 4 16")
    for seed in seeds:
        require_int("fedclf control", "seeds", seed, 0, "use integers >= 0, e.g. 0 1 2")
    s = table_settings(profile, n_isic=n_isic)
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    devices = prepare_devices(out, s, say)
    sites = sorted(d for d in os.listdir(devices) if os.path.isdir(os.path.join(devices, d)))
    train = {site: split_records(devices, site, "train") for site in sites}
    test = [r for site in sites for r in split_records(devices, site, "test")]
    pooled = [r for site in sites for r in train[site]]
    store = CellStore(os.path.join(out, "control.jsonl"))
    cells = []
    for seed in seeds:
        settings, rounds = control_settings(profile, seed, s["pretrain_sets"])
        rounds = s["pretrain_rounds"] or rounds
        base = one_x_steps(train, settings.batch_size, rounds)
        for m in (0, *multipliers):
            key = {"stage": "control", "arm": "random" if m == 0 else "moco", "multiplier": m, "seed": seed,
                   "profile": profile, "n_isic": s["n_isic"]}
            if not store.done(key):
                t0 = time.time()
                model = PretrainingResNet(settings.method, settings.width, settings.proj_dim, seed=seed,
                                          depth=settings.depth)
                result: dict = {"one_x_steps": base, "threads": threads, "settings": asdict(settings)}
                if m:
                    epochs = pooled_epochs(len(pooled), settings.batch_size, m * base)
                    model, curve = pretrain(pooled, settings, epochs, say)
                    result |= {"epochs": epochs, "steps": sum(r["steps"] for r in curve), "rounds": curve,
                               "health": pretraining_health(curve, dim=settings.proj_dim)}
                result["probe"] = linear_probe(model, pooled, test, settings, seed)
                store.put(key, result, time.time() - t0)
            result = store.get(key)
            cells.append({**key, **result})
            say(cell_line(cells[-1]))
    report = {"profile": profile, "n_isic": s["n_isic"], "multipliers": list(multipliers), "seeds": list(seeds),
              "cells": cells}
    report["summary"], report["lines"] = summarise(cells)
    with open(os.path.join(out, "control.json"), "w") as f:
        json.dump(report, f, indent=1)
    if report["summary"]:
        report["png"] = plot_control(report, os.path.join(out, "control.png"))
    for line in report["lines"]:
        say(line)
    return report


def cell_line(cell: Mapping) -> str:
    """One line per finished cell: the probe, and for a pre-training its loss against chance and its verdict."""
    probe = f"probe balanced accuracy {100 * cell['probe']['balanced_accuracy']:.1f} %"
    if cell["arm"] == "random":
        return f"seed {cell['seed']} random init: {probe}"
    first, last = cell["rounds"][0], cell["rounds"][-1]
    health = cell["health"]
    verdict = "failed pre-training: " + "; ".join(health["reasons"]) if health["failed"] else "healthy"
    return (f"seed {cell['seed']} MoCo x{cell['multiplier']} ({cell['steps']} steps): loss {first['loss']:.3f} -> "
            f"{last['loss']:.3f} (chance {last.get('chance_loss', float('nan')):.3f}), spread "
            f"{last.get('feature_std', float('nan')):.3f}, {verdict}; {probe}")


def summarise(cells: Sequence[Mapping]) -> tuple[list[dict], list[str]]:
    """Per multiplier: the last epoch's loss over chance (mean over seeds), how many pre-trainings failed the
    loss-health rule, the probe's balanced accuracy and its difference from random init paired by seed (mean, SE =
    sample std / sqrt(seeds), per seed; points)."""
    random = {c["seed"]: c["probe"]["balanced_accuracy"] for c in cells if c["arm"] == "random"}
    rows, lines = [], []
    for m in sorted({c["multiplier"] for c in cells if c["arm"] == "moco"}):
        these = [c for c in cells if c["arm"] == "moco" and c["multiplier"] == m]
        ratio = [c["rounds"][-1]["loss"] / c["rounds"][-1]["chance_loss"] for c in these
                 if c["rounds"][-1].get("chance_loss")]
        diffs = {c["seed"]: 100 * (c["probe"]["balanced_accuracy"] - random[c["seed"]]) for c in these
                 if c["seed"] in random}
        se = statistics.stdev(diffs.values()) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
        row = {"multiplier": m, "steps": these[0]["steps"], "seeds": sorted(c["seed"] for c in these),
               "last_loss_over_chance": statistics.mean(ratio) if ratio else None,
               "failed": sum(bool(c["health"]["failed"]) for c in these),
               "probe": 100 * statistics.mean(c["probe"]["balanced_accuracy"] for c in these),
               "minus_random": statistics.mean(diffs.values()) if diffs else None, "se": se, "by_seed": diffs}
        rows.append(row)
        spread = "one seed: not a finding" if se is None else f"SE {se:.1f} over {len(diffs)} seeds"
        per = " / ".join(f"{d:+.1f}" for d in diffs.values())
        lines.append(f"MoCo x{m} ({row['steps']} steps): last loss {row['last_loss_over_chance']:.3f} of chance, "
                     f"{row['failed']} of {len(these)} failed; probe {row['probe']:.1f} %, minus random init "
                     + (f"{row['minus_random']:+.1f} points ({spread}; per seed {per})" if diffs else "(no pair)"))
    return rows, lines


def plot_control(report: Mapping, path: str) -> str:
    """Left: the probe's balanced accuracy minus random init against pre-training steps (log x), mean with its SE
    over seeds, each seed a dot, the zero line.  Right: each pre-training's loss per step over its chance level,
    the chance line at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    rows = report["summary"]
    steps = [r["steps"] for r in rows]
    left.errorbar(steps, [r["minus_random"] for r in rows], yerr=[r["se"] or 0.0 for r in rows], marker="s",
                  capsize=3, color="#3b75af", label="pooled MoCo (mean, SE over seeds)")
    for r in rows:
        left.scatter([r["steps"]] * len(r["by_seed"]), list(r["by_seed"].values()), color="#3b75af", alpha=0.4, s=12)
    left.axhline(0.0, color="grey", linestyle="--", linewidth=1, label="random init")
    left.set_xscale("log")
    left.set_xticks(steps, [str(v) for v in steps])
    left.minorticks_off()
    left.set_xlabel("pre-training optimiser steps")
    left.set_ylabel("probe balanced accuracy minus random (points)")
    left.legend(fontsize=8)
    for c in report["cells"]:
        if c["arm"] == "moco":
            done = [sum(r["steps"] for r in c["rounds"][:i + 1]) for i in range(len(c["rounds"]))]
            right.plot(done, [r["loss"] / r["chance_loss"] for r in c["rounds"]], color="#c4622d", alpha=0.6,
                       linewidth=1)
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="chance, ln(K+1)")
    right.axhline(1.0 - CHANCE_MARGIN, color="grey", linestyle=":", linewidth=1, label="health margin")
    right.set_xscale("log")
    right.set_xlabel("pre-training optimiser steps")
    right.set_ylabel("epoch's mean loss / chance")
    right.legend(fontsize=8)
    fig.suptitle(f"FedMoCo pooled control ({report['profile']}, seeds {', '.join(map(str, report['seeds']))})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
