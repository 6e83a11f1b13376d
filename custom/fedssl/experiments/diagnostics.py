"""Diagnostics printed with every table, so a result can be understood rather than guessed (issue 14 item 4).

Per pre-trained method:

* :func:`pretraining_rounds`: what the run recorded per round in its ``summary.json`` (:mod:`fedssl.flare.run_summary`):
  the mean loss over the sites, its loss terms (FCL: ``loss_local``, ``loss_remote``) and the means of the sites'
  numeric summary records (FCL: ``bank_fill``, ``bank_filled``, ``steps_per_round``; every pre-training method:
  ``feature_std``, the spread of the batch's normalised features, :mod:`fedssl.core.spread`);
* the final encoder's feature spread on each site's data next to a random encoder's and the ``1 / sqrt(D)``
  reference (0 = collapse; :mod:`fedssl.eval.features`);
* (MoCo main / BYOL online networks) instance discrimination in the network's own space
  (:func:`fedssl.eval.features.unet_discrimination`): InfoNCE of two augmented views of each slice of a site against
  the other patients' slices, all features fresh from the one network, next to the same network at the
  pre-training's start and the chance level.  The logged MoCo loss compares queries with the bank's momentum keys,
  which lag the main network: it can rise while the network keeps learning (README, "Why the pre-training loss
  rises"); this measure does not lag;
* (U-Net encoders) slice position (:func:`fedssl.eval.features.unet_position_knn`): which of FCL's 4 partitions of a
  volume a slice comes from, voted by its 5 nearest slices of other patients in the pooled encoder features (what
  fine-tuning receives), next to the random encoder's; FCL's partition positives and structural matching train
  exactly this, the other methods do not;
* a frozen-encoder probe (:mod:`fedssl.train.probe`) of the pre-trained encoder and of a random one on the same split:
  does the encoder as it is beat a random one?
* (U-Net encoders) the encoder's kernels against the random encoder's (:mod:`fedssl.core.weight_scale`): their norm
  ratio (well above 1 makes Adam's fixed step slow in fine-tuning) and their cosine and relative change. The random
  encoder (``seed``, default 0) is also the pre-training's initial encoder when the job keeps its default model
  seed 0, so cosine ~1 says pre-training barely moved the encoder.

:func:`diagnose_acdc` (U-Net encoders: FCL, FedMoCo, FCLOpt, FedBYOL ...) and :func:`diagnose_vit` (Fed-MAE /
Fed-BEiT) return a JSON-able dict; :func:`format_diagnostics` turns a list of them into the text block printed under
a table.

Loss health (issue 44, H4): :func:`pretraining_health` reads a pre-training's rounds against the chance level of its
loss (:mod:`fedssl.core.chance`, from the method's own settings: :func:`health_settings`, :func:`job_health_settings`)
and the ``1 / sqrt(D)`` spread reference.  A pre-training whose loss never falls below chance, or ends within
``CHANCE_MARGIN`` of it, or whose feature spread collapses, failed.  A loss read against a memory bank (FCL, FedMoCo,
Local CL) can sit far below chance while the network has learnt nothing: the bank's rows are features of earlier
networks, easy negatives while the learning rate is high (without structural matching FCL's logged loss reached
4.70 against ln 1,025 = 6.93 while two fixed views of the network scored 5.98, their chance level).  For those the
final network's bank-free instance discrimination (:func:`diagnose_acdc`'s ``discrimination``) must end at least
``CHANCE_MARGIN`` below its own chance level too.  The table runners mark a failed pre-training's rows
(:data:`FAILED_MARK`, :func:`failure_record`, :func:`failure_footer`, :func:`failed_verdict`) instead of reporting its
numbers as the method's result.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from fedssl.core.chance import infonce_chance, nt_xent_chance, uniform_chance
from fedssl.core.fedclf import ROTATIONS
from fedssl.core.masking import random_masking
from fedssl.core.mim import inpainting_prediction, mae_loss
from fedssl.core.patches import patchify
from fedssl.core.seeds import derived_seed, site_seed
from fedssl.core.spread import uniform_reference
from fedssl.core.weight_scale import compare_kernels, summarise
from fedssl.data.images import ImageDataset, ImageRecord, batches
from fedssl.data.volume import Volume
from fedssl.eval.features import unet_discrimination, unet_position_knn, unet_spread, vit_spread
from fedssl.models.unet import (ENCODER_MODULES, NORMS, BYOLUNetEncoder, ContrastiveNet, MoCoUNetEncoder,
                                UNetEncoder, contrastive_net_like, encoder_state_from_global)
from fedssl.models.vit import ViTClassifier, load_pretrained_encoder
from fedssl.ops.jobs import component_specs, configured_job
from fedssl.train.mim import IMAGE_CHANNELS, mim_chance_loss
from fedssl.train.probe import frozen_encoder_probe, linear_probe
from fedssl.train.segmentation import init_unet

#: a spread below this fraction of the 1/sqrt(D) reference reads as a collapsed encoder
COLLAPSE_FRACTION = 0.1
#: a last-round loss less than this fraction below its chance level reads as at chance: FedCLF's bench pre-training
#: fell below chance only in round 0, while its queue was short, and ended 0.3 % below ln(257) (jobs/FedCLF.md);
#: every pre-training that learnt something ended 20-90 % below (FCL 24 %, MAE 90 %)
CHANCE_MARGIN = 0.05
#: the temperature of the instance-discrimination diagnostic (FCL's / MoCo's tau)
DISCRIMINATION_TAU = 0.1
#: the position probe: FCL's partitions of a volume, and the neighbours that vote
POSITION_PARTITIONS, POSITION_K = 4, 5
#: the global-model prefixes of the networks pre-training shapes (MoCo main, BYOL online)
PROJECTION_PREFIXES = ("main.", "online.")

Progress = Callable[[str], None]


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def pretraining_rounds(summary_path: str) -> list[dict]:
    """One dict per round of a run's ``summary.json``: ``round``, ``loss`` (mean over the sites),
    ``loss_std_over_sites``, every loss term and every numeric site-record mean (``bank_fill``, ``feature_std`` ...),
    each only where the run recorded it.  A missing or malformed file is a ValueError naming it."""
    if not os.path.isfile(summary_path):
        raise ValueError(f"run summary {summary_path} does not exist; pass the summary.json of a pre-training run "
                         "(the server's run folder)")
    try:
        with open(summary_path) as f:
            summary = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"run summary {summary_path} is not readable JSON ({type(e).__name__}: {e})") from None
    rounds = summary.get("rounds") if isinstance(summary, dict) else None
    if not isinstance(rounds, list) or not all(isinstance(r, dict) and _number(r.get("round")) for r in rounds):
        raise ValueError(f"run summary {summary_path} has no list of rounds with a 'round' number each; is it the "
                         "summary.json that RunSummary writes?")
    out = []
    for r in rounds:
        row: dict[str, Any] = {"round": int(r["round"])}
        for key, name in (("mean_loss", "loss"), ("loss_std_over_sites", "loss_std_over_sites")):
            if _number(r.get(key)):
                row[name] = float(r[key])
        for group in ("loss_terms", "site_record_means"):
            values = r.get(group)
            if isinstance(values, dict):
                row.update({k: float(v) for k, v in values.items() if _number(v)})
        out.append(row)
    return out


# ------------------------------------------------------------------------------------------------ loss health (H4)

#: the mark of a failed pre-training after its method's label in a table
FAILED_MARK = "[failed pre-training]"


def pretraining_health(rounds: Sequence[Mapping[str, Any]], *, chance: float | None = None,
                       chance_what: str = "chance", dim: int | None = None, loss_key: str = "loss",
                       bank: bool = False, discrimination: Mapping[str, Any] | None = None) -> dict:
    """Did a pre-training learn?  From its per-round records (:func:`pretraining_rounds`):

    * loss: ``failed`` when ``loss_key`` (FCL: ``loss_local``, the total adds the remote term) is at or above
      chance in every round that recorded it, or when the last such round ends less than ``CHANCE_MARGIN`` (5 %)
      below chance (a loss that went below chance once and came back has learnt nothing the loss sees at the
      end): ``chance`` (``chance_what`` names it, e.g. ``"ln(K+1), K = 1024"``), or the round's own
      ``chance_<loss_key>`` where the run recorded one (the trainer's exact count, e.g. FedCLF's negatives); no
      chance level (BYOL, ``chance`` None): not checked;
    * spread: ``failed`` when the last recorded ``feature_std`` is below ``COLLAPSE_FRACTION`` of the ``1 / sqrt(D)``
      reference, ``D = dim`` (None: not checked);
    * bank-free discrimination, for a loss read against a memory bank (``bank``): ``failed`` when the final
      network's ``discrimination`` (``loss`` and its ``chance``, :func:`_discrimination_summary`) ends less than
      ``CHANCE_MARGIN`` below chance; a ``note`` when none was measured.

    Returns ``failed``, ``reasons`` (one line per failed check; ``["no rounds recorded"]`` without rounds, not a
    failure), ``notes`` (checks that did not apply) and the numbers used: ``loss_key``, ``min_loss`` and its
    ``min_loss_round`` and ``chance`` (the round where the loss came closest below / least above chance),
    ``chance_what``, ``final_spread``, ``spread_round``, ``spread_reference``, ``collapse_below``."""
    if not rounds:
        return {"failed": False, "reasons": ["no rounds recorded"], "notes": [], "loss_key": loss_key,
                "chance": chance, "chance_what": chance_what}
    checks = [_loss_check(rounds, chance, chance_what, loss_key), _spread_check(rounds, dim)]
    if bank:
        checks.append(_discrimination_check(discrimination))
    reasons = [c.pop("reason") for c in checks if "reason" in c]
    notes = [c.pop("note") for c in checks if "note" in c]
    return {"failed": bool(reasons), "reasons": reasons, "notes": notes, **{k: v for c in checks for k, v in c.items()}}


def _loss_check(rounds: Sequence[Mapping[str, Any]], chance: float | None, what: str, key: str) -> dict:
    """The loss against chance; ``reason`` when it never fell below or ends
    within ``CHANCE_MARGIN`` of it, ``note`` when it could not be checked."""
    out: dict[str, Any] = {"loss_key": key, "chance": chance, "chance_what": what}
    seen = [(r["round"], float(r[key]), r.get(f"chance_{key}", chance)) for r in rounds if _number(r.get(key))]
    if not seen:
        return {**out, "note": f"no {key} recorded: the loss is not checked against chance"}
    scored = [s for s in seen if s[2] is not None]
    if not scored:
        rnd, low, _ = min(seen, key=lambda s: s[1])
        return {**out, "min_loss": low, "min_loss_round": rnd, "note": f"{what}: the loss is not checked"}
    rnd, low, level = min(scored, key=lambda s: s[1] - s[2])
    recorded = level != chance
    out.update(min_loss=low, min_loss_round=rnd, chance=float(level),
               chance_what="chance recorded by the run" if recorded else what)
    last_rnd, last, last_level = scored[-1]
    out.update(last_loss=last, last_loss_round=last_rnd, last_chance=float(last_level))
    if all(loss >= c for _, loss, c in scored):
        out["reason"] = (f"loss never below chance: min {key} {low:.3f} (round {rnd}) vs {out['chance_what']} = "
                         f"{level:.3f}")
    elif last > (1.0 - CHANCE_MARGIN) * last_level:
        what = "chance recorded by the run" if last_level != chance else what
        out["reason"] = (f"loss ends at chance: {key} {last:.3f} (round {last_rnd}) is less than "
                         f"{CHANCE_MARGIN:.0%} below {what} = {last_level:.3f}")
    return out


def _discrimination_check(disc: Mapping[str, Any] | None) -> dict:
    """The final network's bank-free instance-discrimination loss against its chance level; ``reason`` when it ends
    less than ``CHANCE_MARGIN`` below, ``note`` when it was not measured."""
    if not disc or not _number(disc.get("loss")) or not _number(disc.get("chance")):
        return {"note": "the loss reads a memory bank, and no bank-free discrimination was measured: a stale bank can "
                        "hold it below chance while the network learns nothing"}
    loss, level = float(disc["loss"]), float(disc["chance"])
    out = {"discrimination_loss": loss, "discrimination_chance": level,
           "discrimination_start": float(disc["start_loss"]) if _number(disc.get("start_loss")) else None}
    if loss > (1.0 - CHANCE_MARGIN) * level:
        start = "" if out["discrimination_start"] is None else f", its start {out['discrimination_start']:.3f}"
        out["reason"] = (f"the network discriminates at chance without its bank: instance discrimination "
                         f"{loss:.3f} is less than {CHANCE_MARGIN:.0%} below its chance level {level:.3f}{start}")
    return out


def _spread_check(rounds: Sequence[Mapping[str, Any]], dim: int | None) -> dict:
    """The last recorded feature spread against ``COLLAPSE_FRACTION / sqrt(dim)``; ``reason`` when below."""
    last = next((r for r in reversed(rounds) if _number(r.get("feature_std"))), None)
    if dim is None or last is None:
        why = "no feature dimension given" if dim is None else "no feature spread recorded"
        return {"final_spread": None if last is None else float(last["feature_std"]),
                "note": f"{why}: the spread is not checked for collapse"}
    reference = uniform_reference(int(dim))
    out = {"final_spread": float(last["feature_std"]), "spread_round": last["round"], "spread_reference": reference,
           "collapse_below": COLLAPSE_FRACTION * reference}
    if out["final_spread"] < out["collapse_below"]:
        out["reason"] = (f"feature spread collapsed: {out['final_spread']:.4f} (round {last['round']}) < "
                         f"{COLLAPSE_FRACTION:g} x 1/sqrt({dim}) = {out['collapse_below']:.4f}")
    return out


def _fcl_health(a: Mapping[str, Any]) -> dict:
    """FCL, FedMoCo, Local CL (:class:`fedssl.train.fcl.FCLSettings`): the local term of eq. 3 against Q', the K =
    ``bank_size`` negatives negative sampling draws (:func:`fedssl.core.memory_bank.sample_negatives`; the local bank
    alone holds K, so Q' has K rows; without negative sampling and with feature exchange Q holds more and the run's
    recorded chance is the exact one); D = ``proj_dim``, the query features' spread.  The baselines of the same job
    (``objective``, :mod:`fedssl.train.fcl_baselines`): FedSimCLR ln(2B-1), B = ``batch_size`` slices, D =
    ``proj_dim``; FedRotation ln 4 (no feature spread recorded: D None)."""
    objective = a.get("objective", "fcl")
    if objective == "simclr":
        b = int(a["batch_size"])
        return {"chance": nt_xent_chance(b), "chance_what": f"ln(2B-1), B = {b}", "loss_key": "loss",
                "dim": int(a["proj_dim"])}
    if objective == "rotation":
        return {"chance": uniform_chance(ROTATIONS), "chance_what": f"ln({ROTATIONS}) rotations", "loss_key": "loss",
                "dim": None}
    k = int(a["bank_size"])
    return {"chance": infonce_chance(k), "chance_what": f"ln(K+1), K = {k}", "loss_key": "loss_local",
            "dim": int(a["proj_dim"]), "bank": True}


def _byol_health(a: Mapping[str, Any]) -> dict:
    """FedBYOL, FCLOpt and its PTNU / DP variants (:class:`fedssl.train.byol.BYOLSettings`): no negatives, no chance
    level (a collapsed BYOL reaches loss 0); D = ``proj_dim``, the online projections' spread."""
    return {"chance": None, "chance_what": "BYOL has no negatives, no chance level", "loss_key": "loss",
            "dim": int(a["proj_dim"])}


def _mim_health(a: Mapping[str, Any]) -> dict:
    """Fed-MAE / Fed-BEiT (:class:`fedssl.train.mim.MIMSettings`, :func:`fedssl.train.mim.mim_chance_loss`): MAE
    with ``norm_pix_loss`` (d - 1) / d, d = ``patch_size``^2 x 3 (without it the chance is the data's patch
    variance: none); BEiT ln(V), V = ``vocab_size``; D = ``embed_dim``, the spread of the encoder's mean-pooled
    tokens."""
    chance = mim_chance_loss(a["method"], a["patch_size"], a["norm_pix_loss"], a["vocab_size"])
    if a["method"] == "beit":
        what = f"ln(V), V = {int(a['vocab_size'])}"
    elif chance is None:
        what = "MAE without norm_pix_loss has no chance level from its settings"
    else:
        what = f"(d-1)/d, d = {int(a['patch_size']) ** 2 * IMAGE_CHANNELS}"
    return {"chance": chance, "chance_what": what, "loss_key": "loss", "dim": int(a["embed_dim"])}


def _fedclf_health(a: Mapping[str, Any]) -> dict:
    """FedCLF and its baselines (:class:`fedssl.train.fedclf.FedCLFSettings`): MoCo ln(K+1), K = ``bank_size``
    (Q_CL holds the K local features with queue "none" / "fe"; with "fe_neg" the remote bank, at most K: the run's
    recorded chance is the exact one); SimCLR ln(2B-1), B = ``batch_size``; rotation ln 4; D = ``proj_dim``."""
    method, dim = a["method"], int(a["proj_dim"])
    if method == "simclr":
        b = int(a["batch_size"])
        return {"chance": nt_xent_chance(b), "chance_what": f"ln(2B-1), B = {b}", "loss_key": "loss", "dim": dim}
    if method == "rotation":
        return {"chance": uniform_chance(ROTATIONS), "chance_what": f"ln({ROTATIONS}) rotations", "loss_key": "loss",
                "dim": dim}
    k = int(a["bank_size"])
    return {"chance": infonce_chance(k), "chance_what": f"ln(K+1), K = {k}", "loss_key": "loss", "dim": dim,
            "bank": True}


#: pre-training trainer component id (as the jobs name it) -> its loss-health settings from its arguments
HEALTH_SETTINGS: dict[str, Callable[[Mapping[str, Any]], dict]] = {
    "fcl_trainer": _fcl_health, "byol_trainer": _byol_health, "mim_trainer": _mim_health,
    "fedclf_trainer": _fedclf_health}


def health_settings(trainer: str, args: Mapping[str, Any]) -> dict:
    """The keyword arguments of :func:`pretraining_health` (``chance``, ``chance_what``, ``loss_key``, ``dim``, and
    ``bank`` where the loss reads a memory bank) for the pre-training trainer component ``trainer``
    (:data:`HEALTH_SETTINGS`) with its job arguments ``args``."""
    if trainer not in HEALTH_SETTINGS:
        raise ValueError(f"trainer={trainer!r} has no loss-health settings; use one of {sorted(HEALTH_SETTINGS)}")
    return HEALTH_SETTINGS[trainer](args)


def job_health_settings(job_dir: str, profile: str | None, sets: Sequence[str], trainer: str) -> dict:
    """:func:`health_settings` of the ``trainer`` component of the pre-training job ``job_dir`` as ``profile`` and
    ``sets`` configure it (:func:`fedssl.ops.jobs.configured_job`: what the simulator runs)."""
    files = configured_job(job_dir, profile, list(sets))
    specs = component_specs(files["app/config/config_fed_client.json"])
    found = [c for c in specs if c.get("id") == trainer]
    if not found:
        raise ValueError(f"{job_dir}: no client component {trainer!r}; the loss health needs the pre-training trainer")
    return health_settings(trainer, found[0]["args"])


def health_text(h: Mapping[str, Any]) -> str:
    """One line: the failed checks' reasons, or ok with the loss against chance and the final spread."""
    if h["reasons"]:
        head = ("FAILED pre-training: " if h["failed"] else "") + "; ".join(h["reasons"])
    else:
        parts = []
        if h.get("min_loss") is not None and h.get("chance") is not None:
            parts.append(f"min {h['loss_key']} {h['min_loss']:.3f} vs {h['chance_what']} = {h['chance']:.3f}")
        if h.get("collapse_below") is not None:
            parts.append(f"final spread {h['final_spread']:.4f} >= {h['collapse_below']:.4f}")
        if h.get("discrimination_loss") is not None:
            parts.append(f"bank-free discrimination {h['discrimination_loss']:.3f} vs chance "
                         f"{h['discrimination_chance']:.3f}")
        head = "ok" + (f" ({'; '.join(parts)})" if parts else "")
    return head + "".join(f"; {n}" for n in h.get("notes", ()))


def failure_record(per_unit: Mapping[str, Mapping[str, Any]]) -> dict:
    """``{unit: health}`` of a table row (unit: ``"seed 1"``, ``"Split-3 seed 0"``) -> the fields the row carries:
    ``pretraining_failed``, ``pretraining_failed_at`` (the units that failed) and ``pretraining_reasons``."""
    failed = [u for u, h in per_unit.items() if h["failed"]]
    return {"pretraining_failed": bool(failed), "pretraining_failed_at": failed,
            "pretraining_reasons": {u: list(per_unit[u]["reasons"]) for u in failed}}


def failed_mark(failed_at: Sequence[str], units: Sequence[str]) -> str:
    """What follows a method's label: "" (no failed pre-training), ``" [failed pre-training]"`` (every one of its
    ``units`` failed) or ``" [failed pre-training: seed 1]"`` (those that did)."""
    if not failed_at:
        return ""
    if set(failed_at) >= set(units):
        return f" {FAILED_MARK}"
    return f" {FAILED_MARK[:-1]}: {', '.join(failed_at)}]"


def failure_footer(per_label: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[str]:
    """``{label: {unit: health}}`` -> one line under the table per failed pre-training, naming its reasons."""
    return [f"{FAILED_MARK} {label} {unit}: {'; '.join(h['reasons'])}" for label, per_unit in per_label.items()
            for unit, h in per_unit.items() if h["failed"]]


def failed_verdict(line: str, label: str, failed_at: Sequence[str], units: Sequence[str]) -> str:
    """A verdict line comparing ``label`` with random init: unchanged when no pre-training of it failed, else its
    conclusion (after ``" -> "``) says the pre-training failed and the difference is not the method's result."""
    if not failed_at:
        return line
    where = "" if set(failed_at) >= set(units) else f" at {', '.join(failed_at)} of {len(units)}"
    head = line.split(" -> ")[0]
    return f"{head} -> not {label}'s result: its pre-training failed{where} ({FAILED_MARK} below)"


def mark_lines(lines: Sequence[str], marks: Mapping[str, str]) -> list[str]:
    """Lines that start with a marked label and ``" minus "`` (paired differences) get the label's mark."""
    out = []
    for line in lines:
        label = next((m for m in marks if marks[m] and line.startswith(f"{m} minus ")), None)
        out.append(line if label is None else label + marks[label] + line[len(label):])
    return out


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def _spread_summary(pretrained: Mapping[str, Any], random: Mapping[str, Any], what: str) -> dict:
    """Per-site spreads (:class:`fedssl.eval.features.Spread`) of the two encoders -> their means and the reference."""
    sites = sorted(pretrained)
    return {"what": what, "value": _mean_std([pretrained[s].value for s in sites])[0],
            "random": _mean_std([random[s].value for s in sites])[0], "reference": pretrained[sites[0]].reference,
            "per_site": {s: pretrained[s].value for s in sites}}


def _probe_summary(rows: Sequence[dict], random_rows: Sequence[dict], metric: str, setting: str) -> dict:
    (m, sd), (rm, rsd) = _mean_std([r[metric] for r in rows]), _mean_std([r[metric] for r in random_rows])
    return {"metric": metric, "setting": setting, "pretrained": m, "pretrained_std": sd, "random": rm,
            "random_std": rsd, "n_sites": len(rows), "rows": list(rows) + list(random_rows)}


def _unet_encoder(init: object, features: Sequence[int], seed: int, norm: str = NORMS[0]) -> UNetEncoder:
    """The encoder of ``init_unet(init)`` (the one fine-tuning and the probe start from) as a ``UNetEncoder``."""
    state = init_unet(init, features=features, seed=seed, norm=norm).state_dict()
    encoder = UNetEncoder(features, norm=norm)
    encoder.load_state_dict({k: v for k, v in state.items() if k.split(".", 1)[0] in ENCODER_MODULES})
    return encoder


def _projection_net(global_state: Mapping[str, torch.Tensor], features: Sequence[int],
                    seed: int = 0) -> tuple[ContrastiveNet | None, ContrastiveNet | None]:
    """The MoCo main / BYOL online network (encoder + projection head) of a pre-training global state and the same
    network as the pre-training started it (the global model built with ``seed``); ``(None, None)`` without a head.
    The norm and head (and the image size of a flatten head) are read from the state."""
    prefix = next((p for p in PROJECTION_PREFIXES if f"{p}head.2.weight" in global_state), None)
    if prefix is None:
        return None, None
    net = contrastive_net_like({k[len(prefix):]: v for k, v in global_state.items() if k.startswith(prefix)},
                               normalize=prefix == "main.")
    dim, shape = net.head[2].out_features, dict(norm=net.norm, head=net.head_kind, image_size=net.image_size)
    start = MoCoUNetEncoder(features, dim, seed=seed, **shape).main if prefix == "main." else \
        BYOLUNetEncoder(features, dim, seed=seed, **shape).online
    return net, start


def diagnose_acdc(method: str, summary_path: str | None, encoder_state: object,
                  site_volumes: Mapping[str, Sequence[Volume]], settings: Mapping[str, Any], *, probe_n: int = 1,
                  fold: int = 0, seed: int = 0, split_seed: int = 0, progress: Progress | None = None) -> dict:
    """Diagnostics of a U-Net encoder pre-training (FCL, FedMoCo, Local CL, FCLOpt, FedBYOL).

    ``encoder_state``: an encoder state dict (``conv_0.*`` ... as ``fedssl.experiments.fcl_finetune.encoder_init``
    gives), a pre-training global state (``main.*`` / ``online.*``: the projection's spread is reported too) or
    ``"random"``; ``summary_path``: the run's ``summary.json`` (None: no rounds); ``site_volumes``: the labelled
    volumes per site; ``settings``: the fine-tuning settings (``features``, ``epochs``, ``lr``, ``device``, optional
    ``norm``, ``batch_size`` and ``max_steps_per_epoch``) of :func:`fedssl.experiments.fcl_finetune.protocol_settings`.
    The probe trains the decoder on ``probe_n`` patients of every site in ``fold``, once on this encoder and once on
    a random one (same split, same decoder start, same batches)."""
    features, device = list(settings["features"]), settings.get("device", "cpu")
    norm = settings.get("norm", NORMS[0])
    is_global = isinstance(encoder_state, Mapping) and any(k.startswith(PROJECTION_PREFIXES) for k in encoder_state)
    init = encoder_state_from_global(encoder_state) if is_global else encoder_state
    encoder, random_encoder = _unet_encoder(init, features, seed, norm), _unet_encoder("random", features, seed, norm)
    projection, start = _projection_net(encoder_state, features, seed) if is_global else (None, None)
    probe_kw = dict(n_labelled=probe_n, fold=fold, features=features, epochs=int(settings["epochs"]),
                    lr=float(settings["lr"]), batch_size=int(settings.get("batch_size", 10)), seed=seed,
                    device=device, max_steps_per_epoch=settings.get("max_steps_per_epoch"), split_seed=split_seed,
                    min_steps=int(settings.get("min_steps", 0)), norm=norm)
    spread, random_spread, proj, disc, position, rows, random_rows = {}, {}, {}, {}, {}, [], []
    for site in sorted(site_volumes):
        spread[site] = unet_spread(encoder, site_volumes[site], device=device)
        random_spread[site] = unet_spread(random_encoder, site_volumes[site], device=device)
        position[site] = {name: unet_position_knn(net, site_volumes[site], n_partitions=POSITION_PARTITIONS,
                                                  k=POSITION_K, device=device)
                          for name, net in (("encoder", encoder), ("random", random_encoder))}
        if projection is not None:
            proj[site] = unet_spread(projection, site_volumes[site], device=device)
            disc[site] = {name: unet_discrimination(net, site_volumes[site], tau=DISCRIMINATION_TAU, seed=seed,
                                                    device=device) for name, net in (("net", projection),
                                                                                     ("start", start))}
        rows.append(frozen_encoder_probe(site_volumes, init, site=site, method=method, **probe_kw))
        random_rows.append(frozen_encoder_probe(site_volumes, "random", site=site, method="random init", **probe_kw))
        if progress is not None:
            progress(f"diagnostics {method} {site}: spread {spread[site].value:.3f} (random "
                     f"{random_spread[site].value:.3f}), probe Dice {rows[-1]['dice']:.3f} (random "
                     f"{random_rows[-1]['dice']:.3f})")
    out = {"method": method, "rounds": pretraining_rounds(summary_path) if summary_path else [],
           "spread": _spread_summary(spread, random_spread, "pooled encoder bottleneck"),
           "probe": _probe_summary(rows, random_rows, "dice", f"N={probe_n}, fold {fold}"),
           "position": _position_summary(position),
           "weight_scale": {**summarise(compare_kernels(encoder.state_dict(), random_encoder.state_dict())),
                            "seed": seed}}
    if proj:
        out["projection_spread"] = {"value": _mean_std([p.value for p in proj.values()])[0],
                                    "reference": next(iter(proj.values())).reference}
    if disc:
        out["discrimination"] = _discrimination_summary(disc)
    return out


def _position_summary(position: Mapping[str, Mapping[str, float]]) -> dict:
    """Per-site position accuracies of the encoder and the random encoder -> their means."""
    sites = sorted(position)
    return {"n_partitions": POSITION_PARTITIONS, "k": POSITION_K,
            "encoder": _mean_std([position[s]["encoder"] for s in sites])[0],
            "random": _mean_std([position[s]["random"] for s in sites])[0],
            "per_site": {s: position[s]["encoder"] for s in sites}}


def _discrimination_summary(disc: Mapping[str, Mapping[str, Any]]) -> dict:
    """Per-site :class:`~fedssl.core.discrimination.Discrimination` of the pre-trained and the start network ->
    their means over the sites (the chance level is the same for both: same slices, same groups)."""
    sites = sorted(disc)

    def mean(name: str, field: str) -> float:
        return _mean_std([getattr(disc[s][name], field) for s in sites])[0]

    return {"tau": DISCRIMINATION_TAU, "loss": mean("net", "loss"), "start_loss": mean("start", "loss"),
            "chance": mean("net", "chance"), "top1": mean("net", "top1"), "start_top1": mean("start", "top1"),
            "per_site": {s: disc[s]["net"].loss for s in sites}}


def _vit(settings: Mapping[str, Any], init: object) -> ViTClassifier:
    model = ViTClassifier(2, image_size=settings["image_size"], patch_size=settings["patch_size"],
                          embed_dim=settings["embed_dim"], depth=settings["depth"], num_heads=settings["num_heads"],
                          drop_path_rate=0.0, seed=settings.get("seed", 0), layer_scale=settings.get("layer_scale"),
                          rel_pos_bias=settings.get("rel_pos_bias", "none"))
    if not (isinstance(init, str) and init == "random"):
        load_pretrained_encoder(model, init)
    return model


def diagnose_vit(method: str, summary_path: str | None, encoder_state: object,
                 site_records: Mapping[str, Sequence[ImageRecord]], settings: Mapping[str, Any], *,
                 label_fraction: float = 1.0, max_images: int = 256, progress: Progress | None = None) -> dict:
    """Diagnostics of a ViT pre-training (Fed-MAE, Fed-BEiT): rounds, the spread of the encoder's mean-pooled patch
    tokens on (at most ``max_images`` of) each site's images against a random ViT's, and a linear probe of both on
    the site's labelled images (``label_fraction``), accuracy on its validation split.  ``encoder_state``: a
    pre-training global model (path or state dict, ``encoder.*`` keys) or ``"random"``; ``settings``: ``dataset``,
    ``image_size``, ``patch_size``, ``embed_dim``, ``depth``, ``num_heads``, optional ``layer_scale``,
    ``val_fraction``, ``seed``, ``device`` (the local fine-tuning settings of :mod:`fedssl.experiments.sslfl_local`)."""
    s, device = settings, settings.get("device", "cpu")
    model, random_model = _vit(s, encoder_state), _vit(s, "random")
    probe_kw = dict(dataset=s["dataset"], image_size=s["image_size"], patch_size=s["patch_size"],
                    embed_dim=s["embed_dim"], depth=s["depth"], num_heads=s["num_heads"],
                    layer_scale=s.get("layer_scale"), rel_pos_bias=s.get("rel_pos_bias", "none"),
                    label_fraction=label_fraction,
                    val_fraction=s.get("val_fraction", 0.1), seed=s.get("seed", 0), device=device)
    spread, random_spread, rows, random_rows = {}, {}, [], []
    for site in sorted(site_records):
        records = list(site_records[site])[:max_images]
        ds = ImageDataset(records, s["image_size"], "eval", s["dataset"], site=site)
        images = torch.stack([ds[i][0] for i in range(len(ds))])
        spread[site] = vit_spread(model, images, device=device)
        random_spread[site] = vit_spread(random_model, images, device=device)
        rows.append(linear_probe(site_records[site], encoder_state, site=site, method=method, **probe_kw))
        random_rows.append(linear_probe(site_records[site], "random", site=site, method="scratch", **probe_kw))
        if progress is not None:
            progress(f"diagnostics {method} {site}: spread {spread[site].value:.3f} (random "
                     f"{random_spread[site].value:.3f}), linear probe accuracy {rows[-1]['accuracy']:.3f} (random "
                     f"{random_rows[-1]['accuracy']:.3f})")
    return {"method": method, "rounds": pretraining_rounds(summary_path) if summary_path else [],
            "spread": _spread_summary(spread, random_spread, "mean-pooled patch tokens"),
            "probe": _probe_summary(rows, random_rows, "accuracy", f"label fraction {label_fraction:g}")}


def reconstruction_reference(site_records: Mapping[str, Sequence[ImageRecord]], *, dataset: str, image_size: int,
                             patch_size: int, mask_ratio: float, norm_pix: bool, seed: int = 0,
                             max_images: int = 256, batch_size: int = 64) -> dict:
    """The MAE loss of two predictors that learn nothing, on the pre-training's own views: each site's first
    ``max_images`` images in ``"pretrain"`` mode (its augmentation at the site's data seed, one pass) with MAE
    random masks at ``mask_ratio`` drawn from a generator of ``seed``.  ``predict_mean``: every masked patch
    predicted by the target's mean (with ``norm_pix`` zero: the chance level, (d - 1) / d unless patches are flat);
    ``inpainting``: :func:`fedssl.core.mim.inpainting_prediction` (harmonic fill from the visible pixels).  A MAE
    whose loss ends near ``inpainting`` has learnt what interpolation gives; what it gains below it is the part
    that can carry content.  Returns the two losses (averaged over every masked patch), ``masked_patches``,
    ``images`` and the settings."""
    g = torch.Generator().manual_seed(derived_seed(seed, "reconstruction_reference"))
    total = {"predict_mean": 0.0, "inpainting": 0.0}
    masked, images = 0, 0
    for site in sorted(site_records):
        records = list(site_records[site])[:max_images]
        if not records:
            continue
        ds = ImageDataset(records, image_size, "pretrain", dataset, site=site, seed=site_seed(seed, site))
        for x, _ in batches(ds, batch_size, seed=site_seed(seed, site), epoch=0):
            b, _, h, w = x.shape
            _, mask, _ = random_masking(b, (h // patch_size) * (w // patch_size), mask_ratio, g)
            target = patchify(x, patch_size)
            n = int(mask.sum())
            # a normalised target's mean is zero; a raw one's is the patch's own mean
            mean = torch.zeros_like(target) if norm_pix else target.mean(dim=-1, keepdim=True).expand_as(target)
            total["predict_mean"] += float(mae_loss(mean, target, mask, norm_pix=norm_pix)) * n
            total["inpainting"] += float(mae_loss(inpainting_prediction(x, mask, patch_size, norm_pix), target, mask,
                                                  norm_pix=norm_pix)) * n
            masked, images = masked + n, images + b
    if not masked:
        raise ValueError("reconstruction_reference: no image to measure; give at least one site with images")
    return {**{k: v / masked for k, v in total.items()}, "masked_patches": masked, "images": images,
            "patch_size": int(patch_size), "mask_ratio": float(mask_ratio), "norm_pix": bool(norm_pix),
            "image_size": int(image_size)}


# ------------------------------------------------------------------------------------------------ formatting


def _loss_line(rounds: Sequence[dict]) -> str | None:
    """Loss and loss terms at the first, middle and last round."""
    if not rounds:
        return None
    picks = sorted({0, len(rounds) // 2, len(rounds) - 1})
    chosen = [rounds[i] for i in picks]
    found = {k for r in rounds for k in r if k.startswith("loss_") and k != "loss_std_over_sites"}
    terms = [k for k in ("loss", *sorted(found)) if any(k in r for r in chosen)]
    if not terms:
        return None
    cells = ["{} {}".format(k, " / ".join(f"{r[k]:.4f}" if k in r else "-" for r in chosen)) for k in terms]
    return f"pre-training (round {' / '.join(str(r['round']) for r in chosen)}): " + "; ".join(cells)


def _bank_line(rounds: Sequence[dict]) -> str | None:
    last = next((r for r in reversed(rounds) if "bank_fill" in r), None)
    if last is None:
        return None
    filled = ""
    if "bank_filled" in last and "bank_size" in last:
        filled = f" ({last['bank_filled']:.0f} of {last['bank_size']:.0f} slots)"
    return f"bank fill at round {last['round']}: {last['bank_fill']:.2f}{filled}"


def _spread_line(d: Mapping[str, Any]) -> str | None:
    s = d.get("spread")
    if not s:
        return None
    line = (f"feature spread ({s['what']}): {s['value']:.3f} vs random encoder {s['random']:.3f}; "
            f"uniform 1/sqrt(D) {s['reference']:.3f}")
    proj = d.get("projection_spread")
    if proj:
        line += f"; projection {proj['value']:.3f} (1/sqrt(D) {proj['reference']:.3f})"
    per_round = [r["feature_std"] for r in d.get("rounds", ()) if "feature_std" in r]
    if per_round:
        line += f"; in training {per_round[0]:.3f} -> {per_round[-1]:.3f}"
    return line


def _when(d: Mapping[str, Any], key: str, render: Callable[[Mapping[str, Any]], str]) -> str | None:
    """``render(d[key])``, or None when the diagnostics have no ``key`` (a measure that did not apply)."""
    x = d.get(key)
    return render(x) if x else None


def _discrimination_text(x: Mapping[str, Any]) -> str:
    return (f"instance discrimination, the projection's own space (fresh features, other patients' slices as "
            f"negatives, tau {x['tau']:g}): InfoNCE {x['loss']:.3f} vs the start's {x['start_loss']:.3f} (chance "
            f"{x['chance']:.3f}); top-1 {x['top1']:.3f} vs {x['start_top1']:.3f}")


def _position_text(x: Mapping[str, Any]) -> str:
    return (f"slice position from the pooled encoder features (which of {x['n_partitions']} partitions, {x['k']} "
            f"nearest slices of other patients vote): {x['encoder']:.3f} vs random encoder {x['random']:.3f} (chance "
            f"about {1 / x['n_partitions']:.2f})")


def _scale_text(w: Mapping[str, Any]) -> str:
    seed = w.get("seed", 0)
    return (f"encoder kernels vs the random encoder (seed {seed}: a pre-training's start at model seed {seed}; "
            f"{w['n']} kernels): norm "
            f"x{w['geomean']:.2f} (x{w['min']:.2f} to x{w['max']:.2f}), cosine {w['cosine']:.2f}, relative change "
            f"{w['change']:.2f}")


def _reconstruction_text(x: Mapping[str, Any]) -> str:
    target = "normalised pixels" if x["norm_pix"] else "pixels"
    return (f"MAE loss references on the pre-training's views ({x['patch_size']} px patches, {x['mask_ratio']:g} "
            f"masked, {target}, {x['images']} images): predicting each patch's mean {x['predict_mean']:.4f}, "
            f"harmonic inpainting from the visible pixels {x['inpainting']:.4f}")


def _probe_line(p: Mapping[str, Any]) -> str:
    return (f"frozen-encoder probe {p['metric']} ({p['setting']}, {p['n_sites']} sites): pre-trained "
            f"{p['pretrained']:.3f} +- {p['pretrained_std']:.3f} vs random {p['random']:.3f} +- {p['random_std']:.3f}")


def verdict(d: Mapping[str, Any]) -> str:
    """One line: a failed pre-training first (``d["health"]``, :func:`pretraining_health`), then collapse (spread
    below ``COLLAPSE_FRACTION`` of the reference; the random encoder's spread beside it, since a random encoder's
    pooled features can sit as low), then the probe comparison."""
    parts = ["pre-training failed (loss health above)"] if (d.get("health") or {}).get("failed") else []
    s, proj = d.get("spread"), d.get("projection_spread")
    for what, sp in (("encoder", s), ("projection", proj)):
        if sp and sp["value"] < COLLAPSE_FRACTION * sp["reference"]:
            random = f", random encoder {sp['random']:.3f}" if "random" in sp else ""
            parts.append(f"{what} collapsed (spread {sp['value']:.3f}{random})")
    p = d.get("probe")
    if p:
        delta = p["pretrained"] - p["random"]
        unit = "Dice" if p["metric"] == "dice" else p["metric"]
        parts.append(f"frozen encoder beats random by {delta:+.3f} {unit}" if delta > 0
                     else f"frozen encoder does not beat random ({delta:+.3f} {unit})")
    return "; ".join(parts) or "no diagnostics recorded"


def format_diagnostics(diags: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> str:
    """The text block printed under a table: per method, the loss terms at the first / middle / last round, its loss
    health (``d["health"]`` where the runner attached one), the bank fill at the last round, the feature spread
    against a random encoder and 1/sqrt(D), the projection's instance discrimination against its start and chance,
    the slice-position kNN, the encoder's kernels against the random encoder's (norm ratio, cosine, relative
    change), the probe, and a verdict."""
    items = [diags] if isinstance(diags, Mapping) else list(diags)
    lines = ["Diagnostics (issue 14: loss terms, bank fill, feature spread (0 = collapse), instance discrimination, "
             "slice position, encoder kernels vs their start, frozen-encoder probe)"]
    for d in items:
        lines.append(f"  {d['method']}:")
        rounds = d.get("rounds") or []
        probe = _probe_line(d["probe"]) if d.get("probe") else None
        body = [_loss_line(rounds), _when(d, "health", lambda h: f"loss health: {health_text(h)}"),
                _when(d, "reconstruction", _reconstruction_text),
                _bank_line(rounds), _spread_line(d),
                _when(d, "discrimination", _discrimination_text),
                _when(d, "position", _position_text), _when(d, "weight_scale", _scale_text), probe]
        lines += [f"    {x}" for x in body if x]
        lines.append(f"    verdict: {verdict(d)}")
    return "\n".join(lines)
