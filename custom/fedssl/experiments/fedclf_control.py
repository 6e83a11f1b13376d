"""FedMoCo's pooled control (issue 44 H2-H4 for "Federated Self-Supervised Learning for Dermatological Disease
Diagnosis"): is the MoCo loss of ``fedssl fedclf tables`` at chance because of the federation, or because of the
compute?

One MoCo trainer (:class:`fedssl.train.fedclf.FedCLFLocalTrainer`, FedMoCo's loss: queue ``"none"``, the local
bank only) gets every device's unlabelled training images pooled, with the pre-training job's settings at the
profile (network, batch, lr, tau, momentum, K), in a bare loop without FLARE.  "1x" is the optimiser steps the
largest device makes in the table's pre-training (rounds x its full batches per epoch: 30 x 10 = 300 at bench);
multiplier ``m`` trains for the pooled epochs closest to ``m`` times that, with the cosine schedule over them.
The federated arm (:func:`pretrain_federated`) runs FedMoCo itself, in process, for ``m`` times the table's
rounds: at 1x it is the table's FedMoCo pre-training.  At the same multiplier its largest device makes about the
pooled trainer's steps; the federation as a whole makes (and shows each image) about 7 times as many at bench.

Each pre-training records its loss per epoch against chance, ln(K+1), and the feature spread, judged by the
bundle's loss-health rule (:func:`fedssl.experiments.diagnostics.pretraining_health`).  Then a frozen-encoder
linear probe: logistic regression on the encoder's pooled features (standardised) of every device's labelled
training images, balanced accuracy (mean recall over the classes, the tables' recall) on every device's test
images; the same probe on the untrained network of the same seed is the random-init line, paired by seed.

If the pooled loss also stays at chance at the table's compute, the federation is not what keeps it there; if it
falls with more steps, the table's pre-training is short of compute; if the pooled probe gains with compute and
the federated one does not, the federation loses it.  Each finished cell is a line of
``control.jsonl`` under ``out`` (resumable).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from functools import partial

import numpy as np
import torch

from fedssl.core.checks import require, require_int
from fedssl.core.classification import classification_metrics
from fedssl.core.state_dict import RunningAverage
from fedssl.data.fedclf_devices import load_device
from fedssl.data.images import ImageDataset, ImageRecord, batches, class_names
from fedssl.experiments.diagnostics import CHANCE_MARGIN, pretraining_health
from fedssl.experiments.environment import check_threads
from fedssl.experiments.fedclf_tables import prepare_devices, table_settings
from fedssl.experiments.sslfl_control import component_args
from fedssl.experiments.table_runner import ENVIRONMENTS, CellStore, begin_run, key_id, run_cells
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


def load_split(devices: str) -> tuple[dict[str, list[ImageRecord]], list[ImageRecord], list[ImageRecord]]:
    """(each device's training records, every device's test records, the training records pooled) of the device
    folders under ``devices``, devices in name order."""
    sites = sorted(d for d in os.listdir(devices) if os.path.isdir(os.path.join(devices, d)))
    train = {site: split_records(devices, site, "train") for site in sites}
    test = [r for site in sites for r in split_records(devices, site, "test")]
    return train, test, [r for site in sites for r in train[site]]


def pretrain_federated(train: Mapping[str, Sequence[ImageRecord]], settings: FedCLFSettings, rounds: int,
                       say: Callable[[str], None] = print) -> tuple[PretrainingResNet, list[dict]]:
    """FedMoCo as ``jobs/fedclf_derm`` runs it with ``queue="none"`` (the tables' FedMoCo row), in process: every
    device with at least one full batch gets its own trainer (its local bank, optimiser and cosine schedule over
    ``rounds``); each round every trainer loads the global model, trains one local epoch of full batches, and the
    global model becomes the average of the devices' models weighted by their image counts (the job's
    ``FedAvgAggregator``, ``weighting: num_samples``; BatchNorm statistics and the momentum network included).
    Returns the global model and one record per round: the image-weighted ``loss`` and ``chance_loss``, the
    devices' mean ``feature_std``, ``steps`` (the largest device's, the 1x unit) and ``total_steps`` (all
    devices'); ``say`` gets a line every 10 rounds and at the last."""
    settings = replace(settings, federated=True, queue="none")
    trainers = {site: FedCLFLocalTrainer(records, settings, num_rounds=rounds, site=site)
                for site, records in train.items() if len(records) >= settings.batch_size}
    require(bool(trainers), "fedclf control", "batch_size", settings.batch_size,
            "no device has a full batch of training images; lower it")
    model = PretrainingResNet(settings.method, settings.width, settings.proj_dim, seed=settings.seed,
                              depth=settings.depth)
    average, curve = RunningAverage(), []
    for r in range(rounds):
        state, stats = model.state_dict(), []
        average.clear()
        for tr in trainers.values():
            tr.load_global(state)
            stats.append(tr.train_round(r))
            average.add(tr.global_state(), stats[-1].samples)
        model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in average.result().items()})
        weights = [st.samples for st in stats]
        curve.append({"round": r, "loss": float(np.average([st.loss for st in stats], weights=weights)),
                      "chance_loss": float(np.average([st.metrics["chance_loss"] for st in stats], weights=weights)),
                      "feature_std": float(np.mean([st.metrics["feature_std"] for st in stats])),
                      "steps": max(st.steps for st in stats), "total_steps": sum(st.steps for st in stats),
                      "lr_end": stats[0].metrics["lr"]})
        if (r + 1) % 10 == 0 or r + 1 == rounds:
            last = curve[-1]
            say(f"  seed {settings.seed} federated round {r + 1}/{rounds}: loss {last['loss']:.3f} (chance "
                f"{last['chance_loss']:.3f}), spread {last['feature_std']:.3f}")
    return model, curve


def control_cell(key: Mapping, devices: str, pretrain_sets: Sequence[str], table_rounds: int | None, threads: int,
                 say: Callable[[str], None] | None = None) -> dict:
    """One cell of :func:`run_control` (a picklable function of its key, for a worker process): the seed's network,
    pre-trained by the key's arm at its multiplier (``random``: untrained), and its linear probe."""
    say = say or _print
    seed, m = key["seed"], key["multiplier"]
    settings, rounds = control_settings(key["profile"], seed, pretrain_sets)
    rounds = table_rounds or rounds
    train, test, pooled = load_split(devices)
    base = one_x_steps(train, settings.batch_size, rounds)
    model = PretrainingResNet(settings.method, settings.width, settings.proj_dim, seed=seed, depth=settings.depth)
    result: dict = {"one_x_steps": base, "threads": threads, "settings": asdict(settings)}
    if key["arm"] == "moco":
        epochs = pooled_epochs(len(pooled), settings.batch_size, m * base)
        model, curve = pretrain(pooled, settings, epochs, say)
        result |= {"epochs": epochs, "steps": sum(r["steps"] for r in curve), "rounds": curve}
    elif key["arm"] == "federated":
        model, curve = pretrain_federated(train, settings, m * rounds, say)
        result |= {"federated_rounds": m * rounds, "steps": sum(r["steps"] for r in curve),
                   "total_steps": sum(r["total_steps"] for r in curve), "rounds": curve}
    if key["arm"] != "random":
        result["health"] = pretraining_health(result["rounds"], dim=settings.proj_dim)
    result["probe"] = linear_probe(model, pooled, test, settings, seed)
    return result


def _print(message: str) -> None:
    print(message, flush=True)


def _cost(key: Mapping) -> float:
    """A cell's relative cost: its pre-training steps over all devices in units of 1x (the federation trains every
    device: about 8 times the pooled arm's steps at bench), 0.05 for the probe alone."""
    return {"random": 0.05, "moco": 1.0, "federated": 8.0}[key["arm"]] * max(1, key["multiplier"])


def run_control(out: str, *, profile: str = "bench", multipliers: Sequence[int] = (1, 4, 16),
                federated_multipliers: Sequence[int] = (), seeds: Sequence[int] = (0, 1, 2),
                n_isic: int | None = None, threads: int = 1, workers: int = 1,
                say: Callable[[str], None] = print) -> dict:
    """Every (seed, random / pooled multiplier / federated multiplier) cell not yet in ``out/control.jsonl``, in
    ``workers`` processes (the costliest cells first); writes and returns ``out/control.json`` (settings, cells,
    :func:`summarise`'s rows and lines) and ``out/control.png``."""
    check_threads(threads, "fedclf control: argument threads")
    for name, values in (("multipliers", multipliers), ("federated_multipliers", federated_multipliers)):
        for m in values:
            require_int("fedclf control", name, m, 1, "use positive multiples of the table's steps, e.g. 1 4 16")
    require(bool(multipliers) or bool(federated_multipliers), "fedclf control", "multipliers", list(multipliers),
            "give at least one pooled or federated multiplier")
    for seed in seeds:
        require_int("fedclf control", "seeds", seed, 0, "use integers >= 0, e.g. 0 1 2")
    require_int("fedclf control", "workers", workers, 1, "use the number of processes (1 = this one)")
    s = table_settings(profile, n_isic=n_isic)
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    # run_config.json: the settings a resumed folder must share, and every environment its cells were computed in
    config = begin_run(out, {"experiment": "fedclf control", "profile": profile, "n_isic": s["n_isic"]},
                       threads=threads, say=say)
    devices = prepare_devices(out, s, say)
    store = CellStore(os.path.join(out, "control.jsonl"))
    keys = [{"stage": "control", "arm": arm, "multiplier": m, "seed": seed, "profile": profile, "n_isic": s["n_isic"]}
            for seed in seeds for arm, ms in (("random", (0,)), ("moco", multipliers),
                                              ("federated", federated_multipliers)) for m in ms]
    order = sorted(keys, key=_cost, reverse=True) if workers > 1 else keys
    cell = partial(control_cell, devices=devices, pretrain_sets=list(s["pretrain_sets"]),
                   table_rounds=s["pretrain_rounds"], threads=threads, say=None if workers > 1 else say)
    results = run_cells(order, cell, store, say=say, cost=_cost, workers=workers, threads=threads,
                        label="FedMoCo control cells")
    done = {key_id(k): r for k, r in zip(order, results)}
    cells = [{**k, **done[key_id(k)]} for k in keys]
    for c in cells:
        say(cell_line(c))
    with open(os.path.join(out, "run_config.json"), encoding="utf-8") as f:
        environments = json.load(f)[ENVIRONMENTS]
    report = {"profile": profile, "n_isic": s["n_isic"], "multipliers": list(multipliers),
              "federated_multipliers": list(federated_multipliers), "seeds": list(seeds), "threads": config["threads"],
              ENVIRONMENTS: environments, "cells": cells}
    report["summary"], report["lines"] = summarise(cells)
    with open(os.path.join(out, "control.json"), "w") as f:
        json.dump(report, f, indent=1)
    if report["summary"]:
        report["png"] = plot_control(report, os.path.join(out, "control.png"))
    for line in report["lines"]:
        say(line)
    return report


#: how a line, a row and the plot name an arm
ARM_NAMES = {"moco": "MoCo", "federated": "FedMoCo federated"}


def cell_line(cell: Mapping) -> str:
    """One line per finished cell: the probe, and for a pre-training its loss against chance and its verdict."""
    probe = f"probe balanced accuracy {100 * cell['probe']['balanced_accuracy']:.1f} %"
    if cell["arm"] == "random":
        return f"seed {cell['seed']} random init: {probe}"
    first, last = cell["rounds"][0], cell["rounds"][-1]
    health = cell["health"]
    verdict = "failed pre-training: " + "; ".join(health["reasons"]) if health["failed"] else "healthy"
    steps = f"{cell['steps']} steps" + (f", {cell['total_steps']} over all devices" if "total_steps" in cell else "")
    return (f"seed {cell['seed']} {ARM_NAMES[cell['arm']]} x{cell['multiplier']} ({steps}): loss {first['loss']:.3f} "
            f"-> {last['loss']:.3f} (chance {last.get('chance_loss', float('nan')):.3f}), spread "
            f"{last.get('feature_std', float('nan')):.3f}, {verdict}; {probe}")


def summarise(cells: Sequence[Mapping]) -> tuple[list[dict], list[str]]:
    """Per arm (pooled ``moco``, then ``federated``) and multiplier: the last epoch's (round's) loss over chance
    (mean over seeds), how many pre-trainings failed the loss-health rule, the probe's balanced accuracy and its
    difference from random init paired by seed (mean, SE = sample std / sqrt(seeds), per seed; points)."""
    random = {c["seed"]: c["probe"]["balanced_accuracy"] for c in cells if c["arm"] == "random"}
    rows, lines = [], []
    for arm in ("moco", "federated"):
        for m in sorted({c["multiplier"] for c in cells if c["arm"] == arm}):
            these = [c for c in cells if c["arm"] == arm and c["multiplier"] == m]
            ratio = [c["rounds"][-1]["loss"] / c["rounds"][-1]["chance_loss"] for c in these
                     if c["rounds"][-1].get("chance_loss")]
            diffs = {c["seed"]: 100 * (c["probe"]["balanced_accuracy"] - random[c["seed"]]) for c in these
                     if c["seed"] in random}
            se = statistics.stdev(diffs.values()) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
            row = {"arm": arm, "multiplier": m, "steps": these[0]["steps"],
                   "total_steps": these[0].get("total_steps", these[0]["steps"]),
                   "seeds": sorted(c["seed"] for c in these),
                   "last_loss_over_chance": statistics.mean(ratio) if ratio else None,
                   "failed": sum(bool(c["health"]["failed"]) for c in these),
                   "probe": 100 * statistics.mean(c["probe"]["balanced_accuracy"] for c in these),
                   "minus_random": statistics.mean(diffs.values()) if diffs else None, "se": se, "by_seed": diffs}
            rows.append(row)
            spread = "one seed: not a finding" if se is None else f"SE {se:.1f} over {len(diffs)} seeds"
            per = " / ".join(f"{d:+.1f}" for d in diffs.values())
            lines.append(f"{ARM_NAMES[arm]} x{m} ({row['steps']} steps): last loss {row['last_loss_over_chance']:.3f} "
                         f"of chance, {row['failed']} of {len(these)} failed; probe {row['probe']:.1f} %, minus random "
                         "init " + (f"{row['minus_random']:+.1f} points ({spread}; per seed {per})" if diffs
                                    else "(no pair)"))
    return rows, lines


def distinct_ticks(values, apart: float = 0.1) -> list:
    """``values`` in order, leaving out each one within ``apart`` (relative) of the last one kept: the two arms'
    steps at a multiplier (316 pooled, 300 federated) get one tick, not two labels on top of each other."""
    kept: list = []
    for v in sorted(values):
        if not kept or v > kept[-1] * (1 + apart):
            kept.append(v)
    return kept


def plot_control(report: Mapping, path: str) -> str:
    """Left: the probe's balanced accuracy minus random init against pre-training steps (the largest device's for
    the federation: the 1x unit; log x), per arm the mean with its SE over seeds, each seed a dot, the zero line.
    Right: each pre-training's loss per step over its chance level, the chance line at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    colours = {"moco": "#3b75af", "federated": "#c4622d"}
    labels = {"moco": "pooled MoCo", "federated": "FedMoCo, 10 devices"}
    ticks = set()
    for arm in ("moco", "federated"):
        rows = [r for r in report["summary"] if r["arm"] == arm]
        if not rows:
            continue
        shift = 1.06 if arm == "federated" else 1.0  # side by side at the same steps
        steps = [r["steps"] * shift for r in rows]
        ticks.update(r["steps"] for r in rows)
        left.errorbar(steps, [r["minus_random"] for r in rows], yerr=[r["se"] or 0.0 for r in rows], marker="s",
                      capsize=3, color=colours[arm], label=f"{labels[arm]} (mean, SE over seeds)")
        for x, r in zip(steps, rows):
            left.scatter([x] * len(r["by_seed"]), list(r["by_seed"].values()), color=colours[arm], alpha=0.4, s=12)
    left.axhline(0.0, color="grey", linestyle="--", linewidth=1, label="random init")
    left.set_xscale("log")
    shown = distinct_ticks(ticks)
    left.set_xticks(shown, [str(v) for v in shown])
    left.minorticks_off()
    left.set_xlabel("pre-training steps (federated: the largest device's)")
    left.set_ylabel("probe balanced accuracy minus random (points)")
    left.legend(fontsize=8)
    for c in report["cells"]:
        if c["arm"] != "random":
            done = [sum(r["steps"] for r in c["rounds"][:i + 1]) for i in range(len(c["rounds"]))]
            right.plot(done, [r["loss"] / r["chance_loss"] for r in c["rounds"]], color=colours[c["arm"]], alpha=0.6,
                       linewidth=1)
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="chance, ln(K+1)")
    right.axhline(1.0 - CHANCE_MARGIN, color="grey", linestyle=":", linewidth=1, label="health margin")
    right.set_xscale("log")
    right.set_xlabel("pre-training steps (federated: the largest device's)")
    right.set_ylabel("epoch's (round's) mean loss / chance")
    right.legend(fontsize=8)
    fig.suptitle(f"FedMoCo control ({report['profile']}, seeds {', '.join(map(str, report['seeds']))}): pooled (blue) "
                 "and federated (orange)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
