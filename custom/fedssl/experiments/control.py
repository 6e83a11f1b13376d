"""``fedssl bench control``: the centralised control of issue 44 hypothesis H2 for FCL (Wu et al., "Distributed
contrastive learning for medical image segmentation", MedIA 2022) on synthetic ACDC.

The question: on this data, can FCL's pre-training beat random init in Table 1's local fine-tuning at all at the
bench profile's compute?  If a centralised pre-training -- the same encoder, the same FCL loss, every site's
unlabelled volumes pooled into ONE trainer, no federation -- cannot beat random init at this compute, the federated
one cannot be expected to; if it can and the federated one cannot, federation loses it.

Arms, per multiplier m and seed (:data:`BENCH`: the bench profile's FCL settings, ``jobs/fcl_acdc`` with
``app_config/profiles/bench.json`` on ``quick.json``: 64 px at 2.5 mm, U-Net [8, 16, 32, 64, 128, 8], projection 32,
batch 16 = 4 volumes x 4 partitions, bank 1,024, SGD lr 0.005 cosine over the run, 20 rounds of one full local
epoch, 10 sites x 10 patients x 10 cine frames):

* "1x" = the optimiser steps one site makes in the bench run: 20 rounds x its 25 steps per round = 500.
* ``central xm``: one :class:`fedssl.train.fcl.FCLLocalTrainer` on the pooled volumes of all sites (1,000), m x 500
  steps in m x 20 rounds of ``max_steps_per_round`` = one site's steps per round (25), so the cosine schedule spans
  the whole run and a round draws 100 of the pooled volumes.  Feature exchange is OFF: with one site,
  :func:`fedssl.core.memory_bank.remote_bank_for` has no other site to pool from and returns no row, so exchange
  would change nothing.  The loss is FCL's local loss (partition positives across
  volume pairs) plus global structural matching on the pooled run's own bank (its partition-labelled momentum
  features: with one site the bank holds every site's features); the negatives are that bank (negative sampling
  draws K of its K entries: all of them).
* ``federated xm``: :func:`fedssl.experiments.evidence.federated_fcl` (in-process FedAvg of the same trainers, feature
  exchange + NS + GSM, no FLARE) over the 10 sites for m x 20 rounds: each site makes m x 500 steps, so the
  federation spends 10x the total compute of ``central xm`` (the same steps per trainer, ten trainers).
* ``federated-resend xm``: the same federation with the feature exchange before issue 45 (every site re-sends its
  whole bank every round; each receiver trains with K rows drawn from the others' banks, padded with random unit
  vectors; :func:`fedssl.experiments.evidence.resent_remote_bank`).  The bundle no longer exchanges this way; the arm
  measures what sending each feature once costs in accuracy: the report pairs ``federated xm`` against it by
  (site, fold, seed).
* ``random``: random init, once per seed, shared by all arms.

Every encoder is fine-tuned with Table 1's local protocol (:func:`fedssl.train.protocol.local_finetune`: each site
alone on N = 1 and 2 annotated patients, validated on every site's validation patients of the fold, pooled) at the
bench fine-tuning settings (:func:`fedssl.experiments.fcl_finetune.protocol_settings` ``("bench")``: 60 epochs, at
least 140 optimiser steps, lr 0.005, batch 10), as ``fedssl.experiments.fcl_tables`` passes them (``min_steps``
included, which :func:`fedssl.experiments.evidence.run_finetuning` does not pass; hence the direct calls here), in
this process, site by site.

``out/control.json`` is written after every pre-training and every fine-tuned site: a second call with the same
settings skips what is done (the saved encoders ``out/encoders/*.pt`` are reused, not retrained), and can add
multipliers or seeds.  The report (:func:`control_report`): a table of Dice at N = 1 and 2 per arm (mean over seeds)
with the paired difference against random init (:func:`fedssl.eval.report.paired_against`, SE over seeds), one
verdict line per arm and multiplier, and ``out/control.png``.  ``size="tiny"`` runs the same code at toy sizes (the
tests).
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from fedssl.core.discrimination import instance_discrimination
from fedssl.core.fcl_loss import contrastive_term, paired_local_positives
from fedssl.core.seeds import derived_seed
from fedssl.data.acdc import load_site
from fedssl.data.transforms import augment_views
from fedssl.experiments.environment import environment, environment_changes, set_threads
from fedssl.eval.features import slice_partitions, volume_slices
from fedssl.eval.report import paired_against
from fedssl.experiments.evidence import (
    FCL_SIZES,
    _n_steps,
    _seed_points,
    _write_json,
    fcl_settings,
    federated_fcl,
    pick_device,
    prepare_acdc,
    se_over_seeds,
    verdict_line,
)
from fedssl.models.unet import encoder_state_from_global
from fedssl.train.fcl import FCLLocalTrainer
from fedssl.train.protocol import local_finetune

#: the bench profile's FCL pre-training (jobs/fcl_acdc at profile "bench") and its data (``fedssl fcl synth acdc``'s
#: defaults); fine-tuning: ``protocol_settings("bench")``
BENCH: dict = {
    "data": {"n_patients": 100, "n_sites": 10, "shape": [128, 128], "n_frames": 10, "slices_range": [8, 10]},
    "pretrain": {"image_size": 64, "target_spacing": 2.5, "features": [8, 16, 32, 64, 128, 8], "batch_size": 16,
                 "lr": 0.005, "bank_size": 1024, "proj_dim": 32, "max_steps_per_round": 0, "amp": False},
    "rounds": 20,
    "finetune": "bench",
}

#: toy sizes for the tests: evidence's tiny FCL settings, 2 base rounds
TINY: dict = {
    "data": FCL_SIZES["tiny"]["data"],
    "pretrain": FCL_SIZES["tiny"]["pretrain"],
    "rounds": 2,
    "finetune": {"image_size": 32, "target_spacing": 2.5, "features": FCL_SIZES["tiny"]["pretrain"]["features"],
                 "epochs": FCL_SIZES["tiny"]["finetune"]["epochs"], "lr": FCL_SIZES["tiny"]["finetune"]["lr"],
                 "min_steps": 0, "norm": "batch", "device": "cpu"},
}

CONTROL_SIZES = {"bench": BENCH, "tiny": TINY}
ARMS = ("central", "federated", "federated-resend")
#: control.json's list of the environments its cells were computed in (each cell lists its indices into it)
ENVIRONMENTS = "environments"
N_LABELLED = (1, 2)
#: a budget with no end
_NO_END = 1e9
#: the first data epoch of the loss trace's own draws (far from any training round's epoch)
_TRACE_EPOCH = 1_000_000


def finetune_settings(size: str) -> dict:
    """The fine-tuning settings of ``size``: the bench profile's (``protocol_settings("bench")``) or the tiny ones."""
    spec = CONTROL_SIZES[size]["finetune"]
    if isinstance(spec, str):
        from fedssl.experiments.fcl_finetune import protocol_settings

        return protocol_settings(spec)
    return dict(spec)


def finetune_kwargs(ft: dict, folds: Sequence[int], seed: int) -> dict:
    """:func:`local_finetune`'s arguments for Table 1 at the settings ``ft``, as ``fcl_tables.finetune_one`` passes
    them (``min_steps`` included; batch 10, the protocol's default)."""
    return dict(n_labelled=list(N_LABELLED), folds=[int(f) for f in folds], features=ft["features"],
                epochs=ft["epochs"], lr=ft["lr"], device=ft["device"], min_steps=ft["min_steps"], seed=int(seed),
                norm=ft["norm"])


def method_name(arm: str, multiplier: int | None) -> str:
    return "random" if arm == "random" else f"{arm} x{int(multiplier)}"


def cell_key(arm: str, multiplier: int | None, seed: int) -> str:
    return f"{method_name(arm, multiplier)} seed {int(seed)}"


# ---------------------------------------------------------------------------------------------- data
def _data_marker(root: str) -> str:
    return os.path.join(root, "written.json")


def load_or_write_data(root: str, cfg: dict, say: Callable[[str], None]) -> dict[str, list]:
    """The unlabelled volumes of every site: written once with :func:`prepare_acdc` (in this process, threads
    restored afterwards: its site loader sets one thread), then read back from ``root`` when its marker says the
    same data settings."""
    threads = torch.get_num_threads()
    marker = _data_marker(root)
    want = {"data": cfg["data"], "seed": 0}
    t = time.time()
    same = False
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as f:
            same = json.load(f) == json.loads(json.dumps(want))
    if same:
        pre = cfg["pretrain"]
        sites = [f"site-{k}" for k in range(1, cfg["data"]["n_sites"] + 1)]
        vols = {s: load_site(os.path.join(root, s), with_labels=False, frames="all", site=s,
                             target_spacing=pre["target_spacing"], image_size=pre["image_size"]) for s in sites}
        say(f"data: {len(vols)} sites read from {root} in {time.time() - t:.0f} s")
        return vols
    try:
        vols = prepare_acdc(root, cfg, processes=1)
    finally:
        torch.set_num_threads(threads)
    _write_json(marker, want)
    say(f"data: {len(vols)} sites written and loaded in {time.time() - t:.0f} s")
    return vols


def _labelled(root: str, sites: Sequence[str], ft: dict) -> dict[str, list]:
    return {s: load_site(os.path.join(root, s), with_labels=True, site=s, target_spacing=ft["target_spacing"],
                         image_size=ft["image_size"]) for s in sites}


# ---------------------------------------------------------------------------------------------- pre-training
def pretrain_central(site_volumes: dict, cfg: dict, seed: int, rounds: int, steps_per_round: int, device: str,
                     say: Callable[[str], None], *, structural_matching: bool = True,
                     after_round: Callable[[FCLLocalTrainer, int], dict] | None = None) -> tuple[dict, dict]:
    """One FCL trainer on every site's volumes pooled: ``rounds`` rounds of ``steps_per_round`` steps, feature
    exchange off (module docstring).  ``after_round(trainer, round)``: a measurement after each round, its values
    appended to the record's lists of the same names (it must not train or draw from the trainer's generator).
    Returns (the model's state, the record)."""
    pooled = [v for site in sorted(site_volumes) for v in site_volumes[site]]
    size = {"pretrain": dict(cfg["pretrain"], max_steps_per_round=int(steps_per_round), feature_exchange=False,
                             structural_matching=bool(structural_matching))}
    s = fcl_settings(size, seed, device)
    t0 = time.perf_counter()
    tr = FCLLocalTrainer(pooled, s, num_rounds=int(rounds), device=device, site="pooled")
    build_s = time.perf_counter() - t0
    rec: dict = {"loss": [], "loss_local": [], "loss_remote": [], "feature_std": [], "steps": [],
                 "remote_features": [], "volumes": len(tr.dataset), "build_s": round(build_s, 1),
                 "feature_exchange": tr.feature_exchange}
    t0 = time.perf_counter()
    for r in range(int(rounds)):
        st = tr.train_round(r)
        rec["loss"].append(float(st.loss))
        rec["loss_local"].append(float(st.metrics["loss_local"]))
        rec["loss_remote"].append(float(st.metrics["loss_remote"]))
        rec["feature_std"].append(float(st.metrics["feature_std"]))
        rec["remote_features"].append(int(st.metrics["remote_features"]))
        rec["steps"].append(int(st.steps))
        rec.setdefault("lr_end", []).append(float(st.metrics["lr_end"]))
        rec.setdefault("chance_local", []).append(float(st.metrics["chance_loss_local"]))
        rec.setdefault("bank_fill", []).append(float(st.metrics["bank_fill"]))  # the share of real (not random) rows
        for name, value in (after_round(tr, r) if after_round is not None else {}).items():
            rec.setdefault(name, []).append(value)
        done = r + 1
        if r == 0 or done % 10 == 0 or done == rounds:
            say(f"  central seed {seed} round {done}/{rounds} ({time.perf_counter() - t0:.0f} s): loss "
                f"{st.loss:.3f} (local {st.metrics['loss_local']:.3f}), feature spread "
                f"{st.metrics['feature_std']:.4f}")
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    rec["total_steps"] = int(sum(rec["steps"]))
    rec["steps_per_trainer"] = rec["total_steps"]
    return {k: v.detach().cpu() for k, v in tr.model.state_dict().items()}, rec


# ---------------------------------------------------------------------------------------------- the loss trace
@torch.no_grad()
def fixed_view_discrimination(net: torch.nn.Module, view1: torch.Tensor, view2: torch.Tensor, groups: torch.Tensor,
                              tau: float, batch_size: int = 64) -> dict:
    """InfoNCE of ``net``'s projections (eval mode, its mode restored) of two fixed views of the same slices,
    negatives the slices of other patients (``groups``): no bank, so no feature older than the network
    (:func:`fedssl.core.discrimination.instance_discrimination`)."""
    was = net.training
    net.eval()
    try:
        z1 = torch.cat([net(view1[i:i + batch_size]).float() for i in range(0, len(view1), batch_size)])
        z2 = torch.cat([net(view2[i:i + batch_size]).float() for i in range(0, len(view2), batch_size)])
    finally:
        net.train(was)
    d = instance_discrimination(z1.cpu(), z2.cpu(), tau, groups)
    return {"fixed_infonce": d.loss, "fixed_chance": d.chance, "fixed_top1": d.top1}


def _draws(tr: FCLLocalTrainer, first_epoch: int, n: int):
    """``n`` batches of the trainer's dataset from epochs ``first_epoch``, ``first_epoch + 1`` ... (reproducible from
    the dataset's seed and the epoch; the trainer sets its own epoch again at the start of every round)."""
    got, epoch = 0, int(first_epoch)
    while got < n:
        for batch in tr.dataset.batches(tr.volumes_per_batch, epoch):
            yield batch
            got += 1
            if got == n:
                return
        epoch += 1


def _staleness_draws(tr: FCLLocalTrainer, epoch: int, seed: int, query_batches: int):
    """A training-mode copy of the trainer's networks, the measurement's generator and its batches: enough to fill
    a bank, then ``query_batches``."""
    n_bank = -(-tr.bank.capacity // (tr.volumes_per_batch * tr.dataset.n_partitions))
    return (copy.deepcopy(tr.model).train(), torch.Generator().manual_seed(int(seed)),
            _draws(tr, epoch, n_bank + int(query_batches)))


@torch.no_grad()
def fresh_bank(tr: FCLLocalTrainer, model: torch.nn.Module, batches, g: torch.Generator) -> torch.Tensor:
    """A bank of the trainer's size ``[K, D]`` whose every row ``model``'s momentum network encodes now (one
    augmented view per slice, as a training step enqueues), from the next batches of ``batches``."""
    n_rows = tr.bank.capacity
    feats: list[torch.Tensor] = []
    while sum(len(f) for f in feats) < n_rows:
        x, _ = next(batches)
        x = x.reshape(-1, *x.shape[2:]).to(tr.device)
        feats.append(model.momentum(tr.augment(x, g)).float().cpu())
    return torch.cat(feats)[-n_rows:]


@torch.no_grad()
def bank_staleness(tr: FCLLocalTrainer, epoch: int, seed: int, query_batches: int = 8) -> dict:
    """The same queries scored against two banks: the trainer's own (features written by the networks of earlier
    steps: what the logged loss reads) and a fresh one of the same size, every row encoded now by the current
    momentum network.  Both with FCL's local term (partition positives across volume pairs, the whole bank as
    negatives), networks in training mode as in a step, on deep copies (the trainer, its bank, its generator and its
    BatchNorm statistics untouched); batches from ``epoch`` on, augmentations from a generator of ``seed``.
    Returns ``stale_bank_local`` and ``fresh_bank_local``: fresh minus stale > 0 means the stale bank made the
    negatives easier."""
    s = tr.settings
    model, g, batches = _staleness_draws(tr, epoch, seed, query_batches)
    fresh = fresh_bank(tr, model, batches, g).to(tr.device)
    stale = tr.bank.features.to(tr.device)
    losses: dict[str, list[float]] = {"stale_bank_local": [], "fresh_bank_local": []}
    for x, part in batches:
        v, n_part = int(x.shape[0]), int(x.shape[1])
        x = x.reshape(v * n_part, *x.shape[2:]).to(tr.device)
        q = model.main(tr.augment(x, g)).float()
        pos = paired_local_positives(model.momentum(tr.augment(x, g)).float(), v, n_part)
        for name, bank in (("stale_bank_local", stale), ("fresh_bank_local", fresh)):
            losses[name].append(float(contrastive_term(q, pos, bank, s.tau).mean()))
    return {name: float(np.mean(vals)) for name, vals in losses.items()}


def loss_trace(out: str, *, seed: int = 0, multiplier: int = 1, structural_matching: bool = True,
               size: str = "bench", probe_slices: int = 400, fresh_bank: bool = True, device: str = "cpu",
               say: Callable[[str], None] = print) -> dict:
    """Why FCL's logged local loss rises as the learning rate decays: the centralised arm's pre-training
    (:func:`pretrain_central`, the same data, settings and numbers as ``central x<multiplier>``), and after every
    round the bank-free InfoNCE of two fixed augmented views of ``probe_slices`` pooled slices
    (:func:`fixed_view_discrimination`).  The logged loss scores each query against the bank, features made by
    earlier networks; the fixed-view loss scores the network as it is.  With ``fresh_bank`` also
    :func:`bank_staleness` after every round (the same queries against the trainer's bank and a bank encoded
    now; doubles the time).  Writes
    ``out/loss_trace_{gsm|nogsm}_x{m}_seed{s}.json`` and ``.png``; returns the record."""
    if size not in CONTROL_SIZES:
        raise ValueError(f"size={size!r}: use one of {sorted(CONTROL_SIZES)}")
    if isinstance(probe_slices, bool) or not isinstance(probe_slices, int) or probe_slices < 2:
        raise ValueError(f"probe_slices={probe_slices!r}: give an integer >= 2 (slices to discriminate between)")
    cfg, device = CONTROL_SIZES[size], pick_device(device)
    site_volumes = load_or_write_data(os.path.join(out, "data", "acdc"), cfg, say)
    sites = sorted(site_volumes, key=lambda s: int(s.split("-")[-1]))
    s0 = fcl_settings(cfg, 0, device)
    cap = int(cfg["pretrain"].get("max_steps_per_round", 0))
    base_spr = int(round(float(np.mean([_n_steps(site_volumes[s], s0, cap) for s in sites]))))
    pooled = [v for site in sorted(site_volumes) for v in site_volumes[site]]
    x, groups = volume_slices(pooled), slice_partitions(pooled)[1]
    pick = torch.linspace(0, len(x) - 1, min(probe_slices, len(x))).round().long()
    x, groups = x[pick], groups[pick]
    g = torch.Generator().manual_seed(int(seed))  # the probe's own generator: the trainer's draws are untouched
    view1, view2 = augment_views(x, g).to(device), augment_views(x, g).to(device)
    tau = float(cfg["pretrain"].get("tau", s0.tau))

    def measure(tr: FCLLocalTrainer, r: int) -> dict:
        out = fixed_view_discrimination(tr.model.main, view1, view2, groups, tau)
        if fresh_bank:
            out.update(bank_staleness(tr, epoch=_TRACE_EPOCH + 1000 * r, seed=derived_seed(int(seed), f"bank{r}")))
        return out

    rounds = int(multiplier) * int(cfg["rounds"])
    _, rec = pretrain_central(site_volumes, cfg, seed, rounds, base_spr, device, say,
                              structural_matching=structural_matching, after_round=measure)
    rec.update(seed=int(seed), multiplier=int(multiplier), rounds=rounds, structural_matching=bool(structural_matching),
               size=size, probe_slices=int(len(x)))
    name = f"loss_trace_{'gsm' if structural_matching else 'nogsm'}_x{int(multiplier)}_seed{int(seed)}"
    _write_json(os.path.join(out, name + ".json"), rec)
    plot_loss_trace(rec, os.path.join(out, name + ".png"))
    low = lowest_full_bank_round(rec)
    say(f"logged local loss (bank full): lowest {rec['loss_local'][low]:.3f} at round {low + 1} (lr "
        f"{rec['lr_end'][low]:.2g}), last {rec['loss_local'][-1]:.3f} (chance {rec['chance_local'][-1]:.3f}); "
        f"fixed-view InfoNCE: round {low + 1} {rec['fixed_infonce'][low]:.3f}, last {rec['fixed_infonce'][-1]:.3f} "
        f"(chance {rec['fixed_chance'][-1]:.3f})")
    if fresh_bank:
        gap = [f - st for f, st in zip(rec["fresh_bank_local"], rec["stale_bank_local"])]
        say(f"the same queries, a bank encoded now minus the trainer's bank: round 1 {gap[0]:+.3f}, round {low + 1} "
            f"{gap[low]:+.3f}, last {gap[-1]:+.3f}")
    return rec


def lowest_full_bank_round(rec: dict) -> int:
    """The round (0-based) of the lowest logged local loss once the bank holds only real features (``bank_fill``
    1): before that part of the negatives are the bank's random initial rows, easy to tell from any query, and the
    loss is low for that reason alone.  A run whose bank never fills: its last round."""
    full = [r for r, f in enumerate(rec["bank_fill"]) if f >= 1.0] or [len(rec["bank_fill"]) - 1]
    return min(full, key=lambda r: rec["loss_local"][r])


def plot_loss_trace(rec: dict, path: str) -> str:
    """The logged local loss and the fixed-view InfoNCE against the round, the learning rate on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.set_title(f"FCL central x{rec['multiplier']}, seed {rec['seed']}, "
                 f"{'with' if rec['structural_matching'] else 'without'} structural matching", fontsize=9)
    rounds = range(1, len(rec["loss_local"]) + 1)
    ax.plot(rounds, rec["loss_local"], color="#3b75af", label="logged local loss (bank negatives)")
    if "fresh_bank_local" in rec:
        ax.plot(rounds, rec["fresh_bank_local"], color="#3a8f4b", label="local loss, a bank encoded now")
    ax.plot(rounds, rec["fixed_infonce"], color="#c4622d", label="fixed-view InfoNCE (no bank)")
    ax.axhline(rec["chance_local"][-1], color="#3b75af", linestyle=":", linewidth=1, label="chance, ln(K+1)")
    ax.axhline(rec["fixed_chance"][-1], color="#c4622d", linestyle=":", linewidth=1, label="chance, fixed views")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("loss")
    twin = ax.twinx()
    twin.plot(rounds, rec["lr_end"], color="grey", linestyle="--", linewidth=1)
    twin.set_ylabel("learning rate (dashed)")
    ax.legend(fontsize=7, loc="lower left")
    try:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def pretrain_federated(site_volumes: dict, cfg: dict, seed: int, rounds: int, steps_per_site_round: Sequence[int],
                       device: str, say: Callable[[str], None], exchange: str = "once") -> tuple[dict, dict]:
    """:func:`federated_fcl` over every site for ``rounds`` rounds with the feature ``exchange`` ("once": the
    bundle's; "resend": before issue 45); returns (the global state, the record)."""
    pre = federated_fcl(site_volumes, {"pretrain": dict(cfg["pretrain"])}, [seed], int(rounds), device, _NO_END,
                        lambda m: say(f"  federated ({exchange}) seed {seed}: {m}"), exchange=exchange)
    run = pre["runs"][seed]
    per_site = [int(n) * pre["rounds_done"] for n in steps_per_site_round]
    rec = {k: run[k] for k in ("loss", "loss_local", "feature_std", "remote_features")}
    rec.update(seconds=round(pre["seconds"], 1), build_s=round(pre["build_s"], 1), rounds_done=pre["rounds_done"],
               volumes=sum(len(v) for v in site_volumes.values()), sites=len(site_volumes),
               steps_per_trainer=int(round(float(np.mean(per_site)))), total_steps=int(sum(per_site)),
               feature_exchange=True, exchange=exchange)
    return {k: v.detach().cpu() for k, v in run["global"].items()}, rec


# ---------------------------------------------------------------------------------------------- the run
def _plan(multipliers: Sequence[int], seeds: Sequence[int], federated_multipliers: Sequence[int],
          first_seed_only: Sequence[int], resend_multipliers: Sequence[int] = ()) -> list[tuple[str, int | None, int]]:
    """The cells in the order they run: random init of every seed, then the centralised arm by multiplier, then
    the federated arm, then the federated-resend arm, every seed of a multiplier before the next; the multipliers
    of ``first_seed_only`` run for the first seed only and last (one seed is no finding: the cells that can give a
    verdict come first)."""
    few = {int(m) for m in first_seed_only}
    cells: list[tuple[str, int | None, int]] = [("random", None, s) for s in seeds]
    for full in (True, False):
        for arm, ms in (("central", multipliers), ("federated", federated_multipliers),
                        ("federated-resend", resend_multipliers)):
            cells += [(arm, int(m), s) for m in ms if (int(m) not in few) == full
                      for s in (seeds if full else seeds[:1])]
    return cells


def fcl_control(out: str, *, multipliers: Sequence[int] = (1, 4, 16), seeds: Sequence[int] = (0, 1, 2),
                federated_multipliers: Sequence[int] = (1,), folds: Sequence[int] = (0,), size: str = "bench",
                device: str = "auto", first_seed_only: Sequence[int] = (), budget_s: float | None = None,
                resend_multipliers: Sequence[int] = (), threads: int | None = None,
                say: Callable[[str], None] = print) -> dict:
    """The centralised control (module docstring): every cell of :func:`_plan` not yet in ``out/control.json``,
    then the report.  ``budget_s``: no cell starts after that many seconds (the cell running then finishes).
    ``threads``: torch threads of this process (None: as it is); each cell records the count it ran with, since
    another count can change the numbers (and two 2-thread jobs on 2 cores slow each other 5-10x).
    Returns the result (what ``control.json`` holds)."""
    if size not in CONTROL_SIZES:
        raise ValueError(f"size={size!r}: use one of {sorted(CONTROL_SIZES)}")
    for name, vals in (("multipliers", multipliers), ("federated_multipliers", federated_multipliers),
                       ("resend_multipliers", resend_multipliers)):
        if any(int(m) < 1 for m in vals) or len(set(vals)) != len(vals):
            raise ValueError(f"{name}={list(vals)}: give distinct positive integers")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds={list(seeds)}: give distinct seeds (3 for a finding)")
    if not folds:
        raise ValueError("folds: give at least one fold")
    t_start = time.time()
    if threads is not None:
        set_threads(threads)
    cfg, device = CONTROL_SIZES[size], pick_device(device)
    ft = dict(finetune_settings(size), device=device)
    settings = {"size": size, "data": cfg["data"], "pretrain": cfg["pretrain"], "rounds": cfg["rounds"],
                "finetune": ft, "folds": [int(f) for f in folds], "n_labelled": list(N_LABELLED)}
    settings = json.loads(json.dumps(settings))
    path = os.path.join(out, "control.json")
    result: dict = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
        if result.get("settings") != settings:
            raise ValueError(f"{path} was written with other settings ({result.get('settings')}); use another out "
                             "folder or remove it")
    result.setdefault("experiment", "FCL centralised control (issue 44 H2): central and federated pre-training "
                                    "against random init, Table 1 local fine-tuning")
    result["settings"] = settings
    result["device"] = device
    result.setdefault("cells", {})
    cells = result["cells"]
    env_index = _note_environment(result, environment(), path, say)

    def save() -> None:
        result["rows"] = [r for c in cells.values() for r in c.get("rows", [])]
        _write_json(path, result)

    root = os.path.join(out, "data", "acdc")
    site_volumes = load_or_write_data(root, cfg, say)
    sites = sorted(site_volumes, key=lambda s: int(s.split("-")[-1]))
    s0 = fcl_settings(cfg, 0, device)
    cap = int(cfg["pretrain"].get("max_steps_per_round", 0))
    per_site = [_n_steps(site_volumes[s], s0, cap) for s in sites]
    base_spr = int(round(float(np.mean(per_site))))
    result["data"] = {"volumes_per_site": {s: len(site_volumes[s]) for s in sites}}
    result["base"] = {"rounds": int(cfg["rounds"]), "steps_per_round": base_spr, "steps_per_round_by_site": per_site,
                      "steps": int(cfg["rounds"]) * base_spr}
    result["chance_loss_local"] = math.log(cfg["pretrain"]["bank_size"] + 1)
    save()
    say(f"1x = {result['base']['steps']} steps ({cfg['rounds']} rounds x {base_spr}); centralised: one trainer on "
        f"{sum(len(v) for v in site_volumes.values())} pooled volumes; federated: {len(sites)} sites, each m x "
        f"{result['base']['steps']} steps ({len(sites)}x the compute of central at the same m)")
    labelled: dict | None = None
    plan = _plan(multipliers, seeds, federated_multipliers, first_seed_only, resend_multipliers)
    os.makedirs(os.path.join(out, "encoders"), exist_ok=True)
    for arm, m, seed in plan:
        key = cell_key(arm, m, seed)
        cell = cells.get(key)
        if cell is not None and cell.get("done"):
            continue
        if budget_s is not None and time.time() - t_start > budget_s:
            say(f"the budget ({budget_s:.0f} s) is spent: {key} and the cells after it are left for a later call")
            break
        method = method_name(arm, m)
        if cell is None:
            cell = cells[key] = {"arm": arm, "multiplier": m, "seed": int(seed), "method": method, "rows": []}
        cell.setdefault("threads", [])
        if torch.get_num_threads() not in cell["threads"]:  # a cell finished by a later call may list two counts
            cell["threads"].append(torch.get_num_threads())
        cell.setdefault(ENVIRONMENTS, [])
        if env_index not in cell[ENVIRONMENTS]:  # indices into result["environments"], as the thread counts
            cell[ENVIRONMENTS].append(env_index)
        say(f"== {key}")
        init: object = "random"
        if arm != "random":
            enc_path = os.path.join(out, "encoders", f"{arm}_x{m}_seed{seed}.pt")
            if "pretrain" in cell and os.path.isfile(enc_path):
                state = torch.load(enc_path, map_location="cpu", weights_only=True)
            else:
                rounds = int(m) * int(cfg["rounds"])
                if arm == "central":
                    state, rec = pretrain_central(site_volumes, cfg, seed, rounds, base_spr, device, say)
                else:
                    exchange = "resend" if arm == "federated-resend" else "once"
                    state, rec = pretrain_federated(site_volumes, cfg, seed, rounds, per_site, device, say, exchange)
                rec.update(rounds=rounds, encoder=os.path.relpath(enc_path, out))
                torch.save(state, enc_path)
                cell["pretrain"] = rec
                save()
                say(f"  {method} seed {seed}: {rec['total_steps']} steps ({rec['steps_per_trainer']} per trainer) "
                    f"in {rec['seconds']:.0f} s; final local loss {rec['loss_local'][-1]:.3f} (chance "
                    f"{result['chance_loss_local']:.3f}), feature spread {rec['feature_std'][-1]:.4f}")
            init = encoder_state_from_global(state)
        if labelled is None:
            labelled = _labelled(root, sites, ft)
        t0 = time.time()
        done_sites = {r["site"] for r in cell["rows"]}
        for site in sites:
            if site in done_sites:
                continue
            rows = local_finetune(labelled, {method: init}, sites=[site], **finetune_kwargs(ft, folds, seed))
            cell["rows"] += [_plain(dict(r, seed=int(seed))) for r in rows]
            cell["finetune_seconds"] = round(cell.get("finetune_seconds", 0.0) + time.time() - t0, 1)
            t0 = time.time()
            save()
            say(f"  {method} seed {seed} {site}: " + ", ".join(f"N={r['n_labelled']} fold {r['fold']} Dice "
                                                               f"{r['dice']:.3f}" for r in rows))
        cell["done"] = True
        save()
        say(f"  {key} done (fine-tuning {cell['finetune_seconds']:.0f} s)")
    result["seconds_this_call"] = round(time.time() - t_start, 1)
    save()
    return control_report(out, say=say)


def _note_environment(result: dict, env: dict, path: str, say: Callable[[str], None]) -> int:
    """The index of ``env`` in ``result["environments"]`` (every machine and library set the folder's cells were
    computed in), appended when it is new; a new one beside earlier ones is said as a warning line naming what
    differs, since its cells may differ from theirs in the last digits and more."""
    envs = result.setdefault(ENVIRONMENTS, [])
    if env not in envs:
        if envs:
            say(f"warning: {path}: this run's environment differs from the one its cells were last computed in ("
                + environment_changes(envs[-1], env) + "); resuming, and recording it: a cell computed here may "
                "differ from the same cell computed there")
        envs.append(env)
    return envs.index(env)


def environment_lines(result: dict) -> list[str]:
    """One warning line per pre-trained cell whose environments (``cell["environments"]``) are not its seed's
    random-init cell's: its paired difference then mixes machines or libraries (oneDNN at AVX2 instead of AVX-512
    moved a seed's random-init mean by up to 0.011 Dice at N = 1, one site by up to 0.075).  Cells that record no
    environment are not judged."""
    envs, cells = result.get(ENVIRONMENTS, []), result.get("cells", {})
    lines = []
    for cell in cells.values():
        if cell.get("arm") == "random" or not cell.get("done") or not cell.get(ENVIRONMENTS):
            continue
        random = cells.get(cell_key("random", None, cell["seed"]), {})
        mine, theirs = sorted(cell[ENVIRONMENTS]), sorted(random.get(ENVIRONMENTS) or [])
        if theirs and mine != theirs:
            what = ", ".join(environment_changes(envs[a], envs[b]) for a in theirs for b in mine
                             if a != b and max(a, b) < len(envs))
            lines.append(f"warning: {cell['method']} seed {cell['seed']} was computed in environment {mine} and its "
                         f"random init in {theirs} ({what or 'see environments'}): its paired difference mixes them; "
                         "compute both in one environment")
    return lines


def _plain(row: dict) -> dict:
    return json.loads(json.dumps(row, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def merge_controls(out: str, sources: Sequence[str], *, say: Callable[[str], None] = print) -> dict:
    """Merge the ``control.json`` of several control folders (seeds run as separate processes, the CPU way) into
    ``out/control.json``, then :func:`control_report`.  Every source, and ``out`` if it holds a control already, must
    have the same settings; a cell present in two folders must be the same there (the same rows) unless only one of
    them is done, which then wins.  The saved encoders are copied, so a later call on ``out`` resumes from them.
    Nothing is computed.  Returns the report."""
    import shutil

    if not sources:
        raise ValueError("merge: give at least one control folder to merge")
    path = os.path.join(out, "control.json")
    results = []
    for src in ([out] if os.path.isfile(path) else []) + list(sources):
        src_path = os.path.join(src, "control.json")
        if not os.path.isfile(src_path):
            raise ValueError(f"merge: {src_path} does not exist; give folders written by `fedssl bench control`")
        with open(src_path, encoding="utf-8") as f:
            results.append((src, json.load(f)))
    first, base = results[0]
    merged, origin = dict(base, cells={}, **{ENVIRONMENTS: []}), {}
    for src, result in results:
        if result.get("settings") != base.get("settings"):
            raise ValueError(f"merge: {os.path.join(src, 'control.json')} was written with other settings "
                             f"({result.get('settings')}) than {first} ({base.get('settings')}); merge only runs "
                             "of the same size and folds")
        index = []  # this source's environment i is the merged one index[i]
        for env in result.get(ENVIRONMENTS, []):
            if env not in merged[ENVIRONMENTS]:
                merged[ENVIRONMENTS].append(env)
            index.append(merged[ENVIRONMENTS].index(env))
        for key, cell in result.get("cells", {}).items():
            if cell.get(ENVIRONMENTS):
                cell = dict(cell, **{ENVIRONMENTS: sorted({index[i] for i in cell[ENVIRONMENTS] if i < len(index)})})
            have = merged["cells"].get(key)
            if have is None or (cell.get("done") and not have.get("done")):
                merged["cells"][key], origin[key] = cell, src
            elif cell.get("done") and have.get("rows") != cell.get("rows"):
                raise ValueError(f"merge: the cell {key!r} differs between {origin[key]} and {src}; keep one of them")
        encoders = os.path.join(src, "encoders")
        for enc in sorted(os.listdir(encoders)) if os.path.isdir(encoders) else []:
            dst = os.path.join(out, "encoders", enc)
            if not os.path.isfile(dst):
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copy2(os.path.join(encoders, enc), dst)
    merged["rows"] = [r for c in merged["cells"].values() for r in c.get("rows", [])]
    merged["merged_from"] = sorted({os.path.basename(os.path.normpath(s)) for s in sources})
    os.makedirs(out, exist_ok=True)
    _write_json(path, merged)
    done = sum(1 for c in merged["cells"].values() if c.get("done"))
    say(f"merged {len(sources)} control folders into {path}: {done} cells done of {len(merged['cells'])}")
    return control_report(out, say=say)


# ---------------------------------------------------------------------------------------------- the report
def _methods_in(cells: dict) -> list[tuple[str, int | None]]:
    seen = {(c["arm"], c["multiplier"]) for c in cells.values() if c.get("done")}
    order = {"random": 0, "central": 1, "federated": 2, "federated-resend": 3}
    return sorted(seen, key=lambda am: (order[am[0]], am[1] or 0))


def summarise(result: dict) -> tuple[list[dict], list[str]]:
    """Per arm and multiplier (done cells only): Dice at each N (mean over seeds of the mean over sites and folds),
    the paired difference against random init (:func:`paired_against`: the mean over (site, fold, seed) pairs, SE
    over seeds) and the per-seed differences; and one verdict line per arm and multiplier."""
    cells = result["cells"]
    rows = [r for c in cells.values() if c.get("done") for r in c["rows"]]
    paired = {(p["method"], p["n_labelled"]): p for p in paired_against(rows, "random", mode="local")}
    summary, verdicts = [], []
    for arm, m in _methods_in(cells):
        method = method_name(arm, m)
        pre = [c["pretrain"] for c in cells.values() if c.get("done") and c["method"] == method and "pretrain" in c]
        entry: dict = {"method": method, "arm": arm, "multiplier": m,
                       "seeds": sorted({c["seed"] for c in cells.values() if c.get("done") and c["method"] == method})}
        if pre:
            entry["steps_per_trainer"] = pre[0]["steps_per_trainer"]
            entry["total_steps"] = pre[0]["total_steps"]
            entry["pretrain_seconds_mean"] = float(np.mean([p["seconds"] for p in pre]))
            entry["final_loss_local"] = float(np.mean([p["loss_local"][-1] for p in pre]))
            entry["final_feature_std"] = float(np.mean([p["feature_std"][-1] for p in pre]))
        parts = []
        for n in N_LABELLED:
            by_seed: dict[int, list[float]] = {}
            for r in rows:
                if r["method"] == method and r["n_labelled"] == n:
                    by_seed.setdefault(int(r["seed"]), []).append(float(r["dice"]))
            means = {s: float(np.mean(v)) for s, v in sorted(by_seed.items())}
            e = {"dice": float(np.mean(list(means.values()))) if means else None, "dice_by_seed": means,
                 "dice_seed_se": se_over_seeds(list(means.values()))}
            p = paired.get((method, n))
            if p is not None:
                seed_diffs = p.get("by_seed") or {str(s): p["diff_mean"] for s in sorted(by_seed)}
                e.update(diff=p["diff_mean"], diff_seed_se=p.get("seed_se"), diff_by_seed=seed_diffs,
                         pairs=p["pairs"], ahead=p["ahead"], n_seeds=p["seeds"])
                parts.append(verdict_line(f"N={n}", p["diff_mean"], p.get("seed_se"), int(p["seeds"]), "Dice"))
            entry[f"N={n}"] = e
        summary.append(entry)
        if arm != "random" and parts:
            steps = entry.get("steps_per_trainer")
            what = (f"{steps} steps on the pooled data" if arm == "central" else
                    f"{steps} steps per site, {entry.get('total_steps')} in all")
            verdicts.append(f"{method} ({what}) vs random init, Table 1 local: " + "; ".join(parts))
    return summary, verdicts


def exchange_cost(result: dict) -> tuple[list[dict], list[str]]:
    """What sending each feature once costs (issue 45): per multiplier with both federated arms done, ``federated
    xm`` minus ``federated-resend xm`` per N, paired by (site, fold, seed) (:func:`paired_against`, SE over seeds);
    a negative difference is the cost.  Returns the entries and one line per multiplier."""
    cells = result["cells"]
    rows = [r for c in cells.values() if c.get("done") for r in c["rows"]]
    entries, lines = [], []
    for arm, m in _methods_in(cells):
        if arm != "federated-resend":
            continue
        once, resend = method_name("federated", m), method_name(arm, m)
        pairs = [p for p in paired_against([r for r in rows if r["method"] in (once, resend)], resend, mode="local")
                 if p["method"] == once]
        if not pairs:
            continue
        entry = {"multiplier": m, "method": once, "baseline": resend}
        parts = []
        for p in pairs:
            entry[f"N={p['n_labelled']}"] = {"diff": p["diff_mean"], "diff_seed_se": p.get("seed_se"),
                                             "diff_by_seed": p.get("by_seed"), "pairs": p["pairs"],
                                             "n_seeds": p["seeds"]}
            parts.append(verdict_line(f"N={p['n_labelled']}", p["diff_mean"], p.get("seed_se"), int(p["seeds"]),
                                      "Dice"))
        entries.append(entry)
        lines.append(f"{once} (each feature sent once) minus {resend} (whole banks re-sent, before issue 45), "
                     "Table 1 local: " + "; ".join(parts))
    return entries, lines


def format_table(summary: Sequence[dict]) -> str:
    head = (f"{'method':<20} {'steps/trainer':>13} {'seeds':>6}  {'Dice N=1':>8} {'diff N=1 (SE seeds)':>20}  "
            f"{'Dice N=2':>8} {'diff N=2 (SE seeds)':>20}")
    lines = [head, "-" * len(head)]
    for e in summary:
        cols = []
        for n in N_LABELLED:
            d = e[f"N={n}"]
            dice = "-" if d["dice"] is None else f"{d['dice']:.3f}"
            if "diff" in d:
                se = "n/a" if d["diff_seed_se"] is None else f"{d['diff_seed_se']:.3f}"
                diff = f"{d['diff']:+.3f} ({se})"
            else:
                diff = ""
            cols.append(f"{dice:>8} {diff:>20}")
        steps = str(e.get("steps_per_trainer", "-"))
        lines.append(f"{e['method']:<20} {steps:>13} {len(e['seeds']):>6}  " + "  ".join(cols))
    return "\n".join(lines)


def control_report(out: str, *, say: Callable[[str], None] = print) -> dict:
    """The table, the verdicts and ``out/control.png`` from ``out/control.json`` (what is done so far); writes the
    summary back into the JSON and returns it."""
    path = os.path.join(out, "control.json")
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    summary, verdicts = summarise(result)
    cost, cost_lines = exchange_cost(result)
    verdicts = verdicts + cost_lines + environment_lines(result)
    result["summary"], result["verdicts"], result["exchange_cost"] = summary, verdicts, cost
    result["table"] = format_table(summary)
    pre_lines = []
    for e in summary:
        if "final_loss_local" in e:
            pre_lines.append(f"{e['method']}: final local loss {e['final_loss_local']:.3f} (chance ln(K+1) = "
                             f"{result['chance_loss_local']:.3f}), feature spread {e['final_feature_std']:.4f}, "
                             f"pre-training {e['pretrain_seconds_mean']:.0f} s per seed")
    result["pretrain_lines"] = pre_lines
    _write_json(path, result)
    if summary:
        plot_control(result, os.path.join(out, "control.png"))
    say(result["table"])
    for line in pre_lines + verdicts:
        say(line)
    return result


def plot_control(result: dict, path: str) -> str:
    """Dice minus random init at N = 1 and N = 2 against pre-training steps per trainer (log x), one line per arm,
    error bars = SE over seeds, each seed a dot, the zero line; and the local loss per round against chance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = [e for e in result["summary"] if e["arm"] != "random"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), squeeze=False)
    colours = {"central": "#3b75af", "federated": "#c4622d", "federated-resend": "#7a7a7a"}
    for ax, n in zip(axes[0][:2], N_LABELLED):
        for arm in ARMS:
            pts = sorted((e["steps_per_trainer"], e[f"N={n}"]) for e in summary
                         if e["arm"] == arm and "diff" in e[f"N={n}"] and "steps_per_trainer" in e)
            if not pts:
                continue
            xs = [p[0] * {"federated": 1.06, "federated-resend": 1.12}.get(arm, 1.0) for p in pts]  # apart
            ys = [p[1]["diff"] for p in pts]
            err = [p[1]["diff_seed_se"] or 0.0 for p in pts]
            ax.errorbar(xs, ys, yerr=err, color=colours[arm], marker="s", capsize=3,
                        label=f"{arm}" + (" (steps per site)" if arm != "central" else ""))
            for x, p in zip(xs, pts):
                _seed_points(ax, x, list(p[1]["diff_by_seed"].values()))
        ax.axhline(0.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        steps = sorted({e["steps_per_trainer"] for e in summary if "steps_per_trainer" in e})
        if steps:  # ticks at the measured step counts only (one count made matplotlib crowd the log axis)
            ax.set_xticks(steps, [str(v) for v in steps])
            ax.minorticks_off()
            ax.set_xlim(steps[0] / 1.5, steps[-1] * 1.5)
        ax.set_xlabel("pre-training optimiser steps per trainer")
        ax.set_ylabel("Dice minus random init")
        ax.set_title(f"Table 1 local, N={n}")
        ax.legend(fontsize=8)
    ax = axes[0][2]
    for key, c in sorted(result["cells"].items()):
        if "pretrain" in c:
            ax.plot(range(1, len(c["pretrain"]["loss_local"]) + 1), c["pretrain"]["loss_local"],
                    color=colours[c["arm"]], alpha=0.6, linewidth=1)
    ax.axhline(result["chance_loss_local"], color="grey", linestyle="--", label="ln(K+1)")
    ax.set_xscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel("local contrastive loss")
    ax.set_title("pre-training loss (blue central, orange once, grey re-sent)", fontsize=9)
    ax.legend(fontsize=8)
    fig.suptitle(f"FCL centralised control ({result['settings']['size']}, folds {result['settings']['folds']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
