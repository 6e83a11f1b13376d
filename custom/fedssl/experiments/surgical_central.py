"""Centralised baseline of surgical aggregation (surgical aggregation (Kulkarni et al., ML4H 2024), issue 6 "baselines
in the same job by switches").

The same training and evaluation code as the federated runs (``fedssl.train.multilabel.MultiLabelLocalTrainer``:
warm-up, epochs, validation and test report), on the pooled training data of every site, with the settings of
``jobs/surgical_cxr`` after the profile and ``--set`` overrides (executor ``cxr_trainer``, server ``model``,
``scatter_and_gather.num_rounds``, ``final_evaluation.model``):

- data: each site's patient-level train / validation / test split exactly as its executor makes it (same
  seed, so the same patients); training and validation pool the sites' train / validation splits;
- head: the union of the sites' classes, in the registry's order (``fedssl.core.surgical.union_classes``);
- missing classes (``missing``): "negative" (default): an image's classes that its site does not label are
  negatives in the pooled data, as the paper's centralised baseline (sec. 2.3: "All missing classes in the
  combined dataset are treated as negatives") and its public code (``Dataset.merge``: ``fillna(0)``) do, for
  training and validation alike; "ignore": they are unknown (NaN), masked out of the loss and the validation
  metrics (``fedssl.core.multilabel.pool_targets`` / ``labelled``), as FL with partial loss does;
- schedule: one warm-up (``warmup_epochs``, frozen backbone) then ``num_rounds x local_epochs`` epochs over
  the pool (each image is seen as often as in a federated run); batch-norm (``freeze_bn``) follows the job's
  ``class_registration.backbone`` by default: frozen under ``fedbn_plus`` (the paper's choice, and the public
  code's centralised training, ``src/local.py``, which unfreezes the base model after the warm-up "except
  BatchNormalization layers": their ImageNet statistics and affine parameters stay; issue 47: it was always
  trained), trained under ``fedavg`` / ``fedbn``, so that the baseline matches the federated runs it is compared
  with; True / False force it; ``final_evaluation.model`` "best" keeps the model of the round
  with the lowest pooled validation BCE, "last" the last one;
- evaluation: each site's test split with its own classes (mean AUROC over shared / unique classes, bootstrap
  CIs) and the external set with every class, written as ``results.json`` / ``results.md`` / ``auroc.png``
  by the same ``fedssl.eval.surgical_report.write_results`` as the federated runs (method "centralised").
"""

from __future__ import annotations

import json
import os
import time
from typing import Sequence

from torch.utils.data import Dataset

from fedssl.core.checks import require_choice
from fedssl.core.multilabel import MISSING_CLASS_RULES, expand_targets, pool_targets
from fedssl.core.surgical import check_class_list, union_classes
from fedssl.data.site_config import resolve_site_setting
from fedssl.eval.surgical_report import write_results
from fedssl.ops.jobs import REPO_ROOT, build_job, component_specs, job_configs
from fedssl.train.multilabel import (MultiLabelLocalTrainer, MultiLabelSettings, auroc_report, check_multilabel_args,
                                     load_splits)

JOB = os.path.join(REPO_ROOT, "jobs", "surgical_cxr")
EXECUTOR_ID, MODEL_SELECTIONS = "cxr_trainer", ("best", "last")
CENTRAL = "centralised"


class PooledDataset(Dataset):
    """The concatenation of the sites' datasets with targets over ``head``; a class a site does not label is a
    negative (``missing="negative"``, the paper's centralised baseline) or NaN, not labelled (``"ignore"``)."""

    def __init__(self, parts: Sequence[Dataset], part_classes: Sequence[Sequence[str]], head: Sequence[str],
                 sites: Sequence[str], missing: str = "negative"):
        if not (len(parts) == len(part_classes) == len(sites)) or not parts:
            raise ValueError("PooledDataset needs one class list and one site name per dataset")
        require_choice(type(self).__name__, "missing", missing, MISSING_CLASS_RULES)
        self.parts, self.head, self.missing = list(parts), list(head), missing
        self._index = [(p, i) for p, part in enumerate(self.parts) for i in range(len(part))]
        self._map = [(list(c), s) for c, s in zip(part_classes, sites)]

    def __len__(self) -> int:
        return len(self._index)

    def set_epoch(self, epoch: int) -> None:
        for part in self.parts:
            if hasattr(part, "set_epoch"):
                part.set_epoch(epoch)

    def __getitem__(self, index: int):
        p, i = self._index[index]
        x, y = self.parts[p][i]
        classes, site = self._map[p]
        if self.missing == "negative":
            return x, expand_targets(y.unsqueeze(0), classes, self.head, missing="negative", site=site)[0][0]
        return x, pool_targets(y.unsqueeze(0), classes, self.head, site)[0]


def job_settings(job: str, out: str, profile: str | None, sets: Sequence[str]) -> dict:
    """The executor arguments and server settings of ``job`` after the profile and overrides."""
    built = build_job(job, os.path.join(out, "job"), profile=profile, sets=list(sets))
    comps = {}
    for path, cfg in job_configs(built):
        for c in component_specs(cfg):
            comps[(os.path.basename(path).split("_")[-1].split(".")[0], c["id"])] = c
    try:
        args = dict(comps[("client", EXECUTOR_ID)]["args"])
        model_args = comps[("server", "model")]["args"]
        rounds = int(comps[("server", "scatter_and_gather")]["args"]["num_rounds"])
        selection = comps[("server", "final_evaluation")]["args"].get("model", "best")
        backbone = comps[("server", "class_registration")]["args"].get("backbone", "fedavg")
    except KeyError as e:
        raise ValueError(f"{job}: no component {e} in its configs; centralised training reads the surgical_cxr "
                         "job's cxr_trainer, model, scatter_and_gather, final_evaluation and class_registration"
                         ) from None
    if selection not in MODEL_SELECTIONS:
        raise ValueError(f"final_evaluation.model={selection!r}: centralised training supports "
                         f"{list(MODEL_SELECTIONS)}")
    return {"args": args, "imagenet_path": model_args.get("imagenet_path"), "rounds": rounds, "selection": selection,
            "backbone": backbone}


def with_external_test_root(sets: Sequence[str] | None, external_test_root: str = "") -> list[str]:
    """The job overrides ``sets`` plus the one evaluating ``external_test_root`` (a MIMIC-CXR-JPG folder), if given."""
    sets = list(sets or [])
    if external_test_root:
        sets.append(f"client.cxr_trainer.external_test_root={os.path.abspath(external_test_root)}")
    return sets


def run_centralised(data_root: str, out: str, *, sites: Sequence[str] = ("site-1", "site-2"), job: str = JOB,
                    profile: str | None = None, sets: Sequence[str] = (), missing: str = "negative",
                    freeze_bn: bool | None = None, say=print) -> dict:
    """Train one model on the pooled data of ``sites`` (data under ``data_root``, ``{site}`` = site name) and
    write results.json / results.md / auroc.png in ``out``; returns the results payload (+ ``wall_time_s``).
    ``missing``: a site's unlabelled classes are "negative" (paper sec. 2.3, default) or "ignore"d (masked);
    ``freeze_bn``: batch-norm frozen (True) or trained (False); None: as the job's backbone (frozen under
    ``fedbn_plus``)."""
    require_choice("run_centralised", "missing", missing, MISSING_CLASS_RULES)
    from fedssl.flare.site_executor import pick_device

    if not sites or len(set(sites)) != len(sites):
        raise ValueError(f"sites={list(sites)}: name each site once")
    t0 = time.time()
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    cfg = job_settings(job, out, profile, sets)
    args = cfg["args"]
    if freeze_bn is None:
        freeze_bn = cfg["backbone"] == "fedbn_plus"
    external = args.pop("external_test_root", "") or ""
    args.pop("data_root", None)
    check_multilabel_args(EXECUTOR_ID, args)
    settings = MultiLabelSettings.of(args)
    # each site's classes and data splits, exactly as its executor makes them in a federated run
    splits, site_classes = {}, {}
    for site in sites:
        classes, _ = resolve_site_setting(args.get("classes"), "classes", site)
        dataset, _ = resolve_site_setting(args.get("dataset"), "dataset", site)
        site_classes[site] = check_class_list(classes, site)
        root = os.path.abspath(data_root.replace("{site}", site))
        if not os.path.isdir(root):
            raise ValueError(f"{site}: data root {root} is not a directory")
        splits[site] = load_splits(root, dataset, site, site_classes[site], settings)
    head = union_classes(site_classes)
    pooled = {split: PooledDataset([splits[s][split] for s in sites], [site_classes[s] for s in sites],
                                   head, list(sites), missing=missing) for split in ("train", "val")}
    # one model on the pooled data (the server's initial model); batch-norm frozen as the public code does (the
    # trainer's "fedbn_plus" freezing: inference mode, no gradient, re-applied after the warm-up's unfreeze)
    central = MultiLabelLocalTrainer(pooled, head, head, method=CENTRAL,
                                     backbone="fedbn_plus" if freeze_bn else "fedavg", site=CENTRAL,
                                     settings=settings, imagenet_path=cfg["imagenet_path"],
                                     device=pick_device(args.get("device", "auto")))
    say(f"centralised: {len(sites)} sites pooled, {len(pooled['train'])} train / {len(pooled['val'])} validation "
        f"images, head over {len(head)} classes; warm-up {settings.warmup_epochs} + {cfg['rounds']} x "
        f"{settings.local_epochs} epochs, model selection {cfg['selection']}, missing classes: {missing}, "
        f"batch-norm {'frozen' if freeze_bn else 'trained'}")
    history, best = [], None
    for r in range(cfg["rounds"]):
        stats = central.train_round(r)  # the warm-up first, in round 0
        val = central.evaluate("val")
        history.append({"round": r, "loss": stats.loss, **val})
        if best is None or val["val_loss"] < best[0]:
            best = (val["val_loss"], r, central.global_state())
    if cfg["selection"] == "best" and best is not None:
        central.load_global(best[2])
    chosen = best[1] if cfg["selection"] == "best" and best is not None else cfg["rounds"] - 1
    source = f"centralised model ({cfg['selection']}, round {chosen})"
    # the external set is the same for every site and so is the model: scored once, reported under every site
    replies = {s: auroc_report(central.model, splits[s]["test"], site_classes[s], s, source, settings,
                               external if i == 0 else "") for i, s in enumerate(sites)}
    for s in list(sites)[1:]:
        for key in ("external", "external_mean_auroc"):
            if key in replies[sites[0]]:
                replies[s][key] = replies[sites[0]][key]
    registry = {"method": CENTRAL, "backbone": None, "global_classes": list(head), "site_classes": site_classes}
    payload = write_results(out, replies, registry, "Centralised training on the pooled sites (surgical_cxr baseline)",
                            source)
    payload["wall_time_s"] = round(time.time() - t0, 1)
    payload["history"] = history
    payload["missing_classes"] = missing
    payload["batchnorm"] = "frozen" if freeze_bn else "trained"
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(payload, f, indent=2)
    return payload
