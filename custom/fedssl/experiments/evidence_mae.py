"""The Fed-MAE part of ``fedssl bench evidence``: on SSL-FL's Split-3, does federated MAE pre-training followed by
federated fine-tuning beat the same federated fine-tuning from a random init ("ViT scratch"), over seeds?

SSL-FL: R. Yan, L. Qu, Q. Wei, S.-C. Huang, L. Shen, D. L. Rubin, L. Xing, Y. Zhou, "Label-Efficient
Self-Supervised Federated Learning for Tackling Data Heterogeneity in Medical Imaging", IEEE Transactions on
Medical Imaging 42(7), 2023.  Fed-MAE = its MAE pre-training (sec. III-C, Alg. 1, Table I) followed by federated
fine-tuning (sec. III-D); "ViT scratch" is its Table II row "None".

:func:`fedmae_evidence` runs in one process, without FLARE (no nvflare, no ``fedssl.flare`` / ``fedssl.ops``):

1. **Data** (the SSL-FL demo's recipe, :func:`fedssl.experiments.sslfl_demo.write_demo_images`): the bundle's
   synthetic retina (:func:`fedssl.data.image_synthetic.write_synthetic_images`), a class-balanced subset as SSL-FL
   keeps of Kaggle DR (:func:`fedssl.data.image_sites.balance_retina`), split by
   :func:`fedssl.data.image_sites.write_site_folders` into a stratified held-out ``test`` folder (20 %) and 5
   Dirichlet sites, alpha 0.5 = Split-3.  One split seed (0) for
   every training seed, so the seeds differ only in training.  The writer is run in ``data_workers`` processes
   (:func:`write_retina_images`; the files are those of one serial call).
2. **Federated MAE pre-training** per seed: every round each of the 5 sites trains one local epoch from the global
   model with :class:`fedssl.train.mim_loop.MIMTrainer` (the loop :class:`fedssl.train.mim.MIMLocalTrainer` runs in
   the FLARE executor, with the same per-site seeds and settings), and the server averages the whole MAE (encoder
   + decoder) weighted by the sites' numbers of images (SSL-FL's FedAvg).
3. **Federated fine-tuning** per seed, from the global MAE encoder ("fedmae") and from the same ViT randomly
   initialised with the same seed ("scratch"), with :class:`fedssl.train.classifier_loop.ClassifierTrainer` as
   :class:`fedssl.train.classifier.ClassifierLocalTrainer` runs it (validation split held out, labelled subset,
   layer-wise lr decay), FedAvg weighted by labelled images.  The two inits train round by round in turn, so a
   deadline stops both after the same round.  Each is tested once, on the held-out ``test`` folder, with the final
   global model (no model selection: the learning rate has decayed to its floor at the last round).
4. **Result**: test accuracy and balanced accuracy per seed and init, the paired differences (fedmae - scratch)
   per seed, their mean and standard error over seeds (:func:`fedssl.eval.report.paired_against`) and one verdict
   line; ``out/fedmae_evidence.json`` is rewritten after every stage of every seed.

Speed: the trainers' own batch functions decode and augment every image on the CPU (4.5 ms per 224 px
pre-training image on one core), far below a GPU's 2,000 images/s, and a per-round DataLoader would fork its
workers 5 x rounds times.  So the images are decoded once into one uint8 tensor on the device
(:class:`DeviceImages`) and each batch is augmented there, drawing exactly what :class:`fedssl.data.images.ImageDataset`
draws for item ``i`` of epoch ``e`` (same crop box, rotation, flip and colour jitter from ``(seed, e, i)``; the
tests check the tensors and one round of each local trainer against the bundle's).  The site models are copies of
one model built per seed (a ViT-B costs seconds to initialise on a CPU), and the weighted average runs on the
device (:func:`fedavg`; on a CPU it is :func:`fedssl.core.state_dict.weighted_average` itself).

Rounds: ``budget_s`` covers everything, data included.  After the data, a timing probe (a throwaway trainer of
each stage, a few optimiser steps after warm-up, the average and the model copies) gives the seconds per round for
all seeds; the rounds are what fits (:func:`choose_rounds`), clamped to [1, the size's maximum], and each
learning-rate schedule is built for that count.  Each seed gets an equal slice of the time left after the probe,
split between its pre-training and fine-tuning by ``pretrain_share``.  A probe of a few steps misses what a real
round adds (the ViT-B run on an H200 planned 54 / 29 rounds and its deadlines cut them at 28-47 / 20-25, each
schedule mid-way), so each stage re-plans once from its own measured warm-up rounds, where the learning rate does
not yet depend on the count (:class:`RoundBudget`): the count becomes what the stage's time left holds at the
slowest of the last three rounds, never more than planned, and the schedule is set to it, so it reaches its floor.
A seed's re-planned count is the next seeds' plan.  ``rounds_by_seed`` records each seed's final counts; given
``pretrain_rounds`` / ``finetune_rounds`` are used as they are (a rerun of a seed with its recorded counts repeats
its numbers).  A stage still stops before a round that would end more than half a round after its deadline, and
records ``stopped_early`` and the rounds done.

Sizes (:data:`SIZES`): ``"tiny"`` is the bundle's tiny ViT (32 px, patch 4, width 48, depth 2) on 300 images
written at 40 px, with the demo's quick-profile overrides (batch 32, pre-training lr 1.5e-3 and 2 warm-up rounds,
fine-tuning validation fraction 0.2 and at most 4 local steps per round): the CPU test size.  ``"gpu"`` is SSL-FL's
model at its settings: ViT-B/16 at 224 px (embed 768, depth 12, 12 heads), the MAE decoder 512 / 8 / 16, mask ratio
0.6, norm-pix loss, AdamW lr 1e-3 at batch 128, weight decay 0.05, 5 warm-up rounds then cosine to 0 (Table I);
fine-tuning lr 3e-3 at batch 256, layer decay 0.65, drop path 0.1, 5 warm-up rounds, cosine to 1e-6, 1 local
epoch, 10 % of each site held out for validation, 100 % labels (the fine-tuning job's paper defaults), bf16 autocast
on the GPU.  Why ViT-B fits: at the assumed 2,000 images/s (MAE) and 800 images/s (fine-tuning) on one H200, a
round over ~2,000 training images costs ~1 s of pre-training and ~5 s of fine-tuning (both inits), so ~130 s per
stage over 3 seeds holds ~40 pre-training and ~8 fine-tuning rounds per seed; a smaller ViT would not be the
paper's model.  Deviations, all forced by the budget: 4,800 images are written (a balanced ~2,540: ~2,030 training
images over the sites, ~510 test; SSL-FL: 9,000 / 3,000) and rendered 112 px high, not 224 (rendering costs 0.38 s
per 224 px image on one core, 0.08 s at 112 px: 4,800 images at 224 px would take ~4 minutes on 8 cores), so the
loader upsamples them to the 224 px input as it resizes every image (the lesions keep their size relative to a
ViT patch); rounds are what the budget holds (SSL-FL: 1,600 pre-training and 100 fine-tuning rounds), with the
schedules built for them; the test uses the final global model, not a validation-selected one.
"""

from __future__ import annotations

import copy
import csv
import itertools
import json
import math
import multiprocessing as mp
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
from torch.nn import functional as F

from fedssl.core.classification import classification_metrics, predict
from fedssl.core.mim import mae_loss
from fedssl.core.patches import patchify
from fedssl.core.rng import owned_global_rng
from fedssl.core.seeds import derived_seed, site_seed
from fedssl.core.state_dict import weighted_average
from fedssl.core.trainer import load_checked
from fedssl.data.image_sites import balance_retina, write_site_folders
from fedssl.data.image_synthetic import write_synthetic_images
from fedssl.data.images import (
    COLOR_JITTER,
    FINETUNE_ROTATION_DEG,
    FINETUNE_SCALE,
    IMAGENET_MEAN,
    IMAGENET_STD,
    PRETRAIN_SCALE,
    RETINA_CSV,
    RETINA_DIR,
    ImageDataset,
    ImageRecord,
    batch_bounds,
    class_names,
    load_image_records,
    select_labelled,
    train_val_split,
)
from fedssl.eval.report import paired_against
from fedssl.models.vit import TINY_DECODER, TINY_VIT, encoder_state, load_encoder_state
from fedssl.models.vit_classifier import FineTuneViT
from fedssl.train.classifier import ClassifierSettings
from fedssl.train.classifier_loop import ClassifierTrainer
from fedssl.train.mim import MIMSettings, build_mim_model
from fedssl.train.mim_loop import MIMTrainer

__all__ = ["SIZES", "fedmae_evidence", "choose_rounds", "RoundBudget", "replan_rounds", "verdict_line",
           "write_retina_images", "write_split3", "DeviceImages", "fedavg", "device_average", "MAESite", "FineTuneSite"]

DATASET = "retina"
SPLIT = "Split-3"
#: SSL-FL's Split-3: Dirichlet alpha 0.5 over 5 sites
ALPHA, N_SITES = 0.5, 5
#: one data split for every training seed: the seeds differ only in training
SPLIT_SEED = 0
RESULT_FILE = "fedmae_evidence.json"

#: every setting of the run, declared once, per size (see the module docstring for the reasons)
SIZES: dict[str, dict] = {
    "tiny": {
        "n_images": 300, "image_px": 40, "data_workers": 1,
        "model": {**TINY_VIT, **TINY_DECODER},
        "pretrain": {"mask_ratio": 0.6, "norm_pix_loss": True, "lr": 1.5e-3, "min_lr": 0.0, "weight_decay": 0.05,
                     "batch_size": 32, "local_epochs": 1, "warmup_rounds": 2, "max_steps_per_round": 0,
                     "max_rounds": 20},
        "finetune": {"lr": 3e-3, "min_lr": 1e-6, "weight_decay": 0.05, "batch_size": 32, "local_epochs": 1,
                     "warmup_rounds": 5, "layer_decay": 0.65, "drop_path_rate": 0.1, "val_fraction": 0.2,
                     "label_fraction": 1.0, "max_steps_per_epoch": 4, "eval_batch_size": 128, "max_rounds": 60},
        "pretrain_share": 0.5,
    },
    "gpu": {
        "n_images": 4800, "image_px": 112, "data_workers": 0,  # 0 = half the CPUs, at most 8
        "model": {"image_size": 224, "patch_size": 16, "embed_dim": 768, "depth": 12, "num_heads": 12,
                  "decoder_embed_dim": 512, "decoder_depth": 8, "decoder_num_heads": 16},
        "pretrain": {"mask_ratio": 0.6, "norm_pix_loss": True, "lr": 1e-3, "min_lr": 0.0, "weight_decay": 0.05,
                     "batch_size": 128, "local_epochs": 1, "warmup_rounds": 5, "max_steps_per_round": 0,
                     "max_rounds": 200},
        "finetune": {"lr": 3e-3, "min_lr": 1e-6, "weight_decay": 0.05, "batch_size": 256, "local_epochs": 1,
                     "warmup_rounds": 5, "layer_decay": 0.65, "drop_path_rate": 0.1, "val_fraction": 0.1,
                     "label_fraction": 1.0, "max_steps_per_epoch": 0, "eval_batch_size": 256, "max_rounds": 100},
        "pretrain_share": 0.5,
    },
}

#: timing probe: optimiser steps run before timing (kernel selection, allocator) and timed
PROBE_WARMUP_STEPS, PROBE_STEPS = 2, 3
#: share of ``budget_s`` kept for the result file and the margin of the last round
RESERVE_SHARE = 0.02


# ---------------------------------------------------------------------------------------------- small helpers


def choose_rounds(budget_s: float, seconds_per_round: float, most: int, least: int = 1) -> int:
    """The number of rounds of ``seconds_per_round`` (all seeds together) that fit in ``budget_s``, clamped to
    ``[least, most]``: e.g. 100 s at 2.5 s per round -> 40 rounds (``most`` 30 -> 30)."""
    if not (seconds_per_round > 0 and math.isfinite(seconds_per_round)):
        raise ValueError(f"seconds_per_round={seconds_per_round!r} must be a positive number")
    if not 1 <= least <= most:
        raise ValueError(f"need 1 <= least <= most, got least={least}, most={most}")
    fit = math.floor(max(budget_s, 0.0) / seconds_per_round)
    return int(max(least, min(most, fit)))


def verdict_line(per_seed: Sequence[float], se: float | None, stopped_early: bool = False) -> str:
    """One line on fedmae - scratch test accuracy over seeds, in percentage points: "ahead by x SE" / "behind by
    x SE" when the mean difference is at least twice its standard error over seeds, otherwise "not separated
    (|diff| < 2 SE)"; one seed is "one seed: not a finding"."""
    n = len(per_seed)
    head = f"Fed-MAE vs scratch, {SPLIT}"
    if n == 0:
        return f"{head}: no seed finished both fine-tunings -> no result"
    mean = 100.0 * float(np.mean(per_seed))
    tail = " (a stage stopped early at the deadline)" if stopped_early else ""
    if n == 1 or se is None:
        return f"{head}, one seed: {mean:+.1f} points -> one seed: not a finding{tail}"
    se_pts = 100.0 * float(se)
    if se_pts > 0:
        ratio = mean / se_pts
        word = (f"ahead by {ratio:.1f} SE" if ratio >= 2 else f"behind by {-ratio:.1f} SE" if ratio <= -2
                else "not separated (|diff| < 2 SE)")
    else:
        word = "ahead (SE 0)" if mean > 0 else "behind (SE 0)" if mean < 0 else "not separated (no difference)"
    return f"{head}, {n} seeds: {mean:+.1f} points (SE {se_pts:.1f}) -> {word}{tail}"


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"device={device!r}: use 'auto', 'cpu' or 'cuda[:N]'")
    return device


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def _write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------- data


def _render_shard(root: str, n_images: int, seed: int, image_px: int, shard: int, n_shards: int) -> dict:
    """One worker of :func:`write_retina_images`: the bundle's writer into ``root``, rendering and saving only the
    images ``i`` with ``i % n_shards == shard`` (the writer draws every image from ``(seed, i)`` alone, and its
    label file does not depend on the pixels).  Runs in its own process: the module patch stays there."""
    import fedssl.data.image_synthetic as synthetic

    real_render, real_save = synthetic.render, synthetic.save_image
    counter, owned = itertools.count(), [False]

    def render(*args, **kwargs):
        owned[0] = next(counter) % n_shards == shard
        return real_render(*args, **kwargs) if owned[0] else np.zeros((1, 1, 3), np.float32)

    def save_image(img, path, grey=False):
        if owned[0]:
            real_save(img, path, grey)

    synthetic.render, synthetic.save_image = render, save_image
    return synthetic.write_synthetic_images(root, DATASET, n_images=n_images, seed=seed, image_size=image_px)


def write_retina_images(src: str, n_images: int, seed: int, image_px: int, workers: int = 1) -> dict:
    """The bundle's synthetic retina (:func:`fedssl.data.image_synthetic.write_synthetic_images`) in ``src``,
    written by ``workers`` processes: the same files as one serial call (each worker renders every
    ``workers``-th image; the label file is the writer's).  Returns the writer's info without its ``images``."""
    if workers <= 1:
        info = write_synthetic_images(src, DATASET, n_images=n_images, seed=seed, image_size=image_px)
        return {k: v for k, v in info.items() if k != "images"}
    roots = [f"{src}.part{k}" for k in range(workers)]
    for r in roots:
        shutil.rmtree(r, ignore_errors=True)
    ctx = mp.get_context("spawn")  # the workers touch numpy and PIL only; spawn is safe beside CUDA and threads
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        infos = list(pool.map(_render_shard, roots, [n_images] * workers, [seed] * workers, [image_px] * workers,
                              range(workers), [workers] * workers))
    os.makedirs(os.path.join(src, RETINA_DIR), exist_ok=True)
    shutil.copyfile(os.path.join(roots[0], RETINA_CSV), os.path.join(src, RETINA_CSV))
    for r in roots:
        for name in os.listdir(os.path.join(r, RETINA_DIR)):
            os.replace(os.path.join(r, RETINA_DIR, name), os.path.join(src, RETINA_DIR, name))
        shutil.rmtree(r)
    with open(os.path.join(src, RETINA_CSV), newline="") as f:
        listed = {row[0] + ".jpeg" for row in list(csv.reader(f))[1:]}
    written = set(os.listdir(os.path.join(src, RETINA_DIR)))
    if written != listed or len(listed) != n_images:
        raise RuntimeError(f"parallel retina writer: {len(written)} files for {len(listed)} listed images of "
                           f"{n_images}; the writer no longer renders one image per call in index order -- use "
                           "workers=1")
    info = dict(infos[0])
    info["root"] = os.path.abspath(src)
    return {k: v for k, v in info.items() if k != "images"}


def write_split3(data_dir: str, n_images: int, image_px: int, workers: int = 1,
                 say: Callable[[str], None] = print) -> tuple[str, dict]:
    """The demo's data recipe: ``n_images`` synthetic retina images ``image_px`` high, a balanced subset, a
    stratified 20 % test folder and 5 Dirichlet sites with alpha 0.5 (Split-3), all seeded by :data:`SPLIT_SEED`.
    Returns the partition folder and its ``partition.json``; a finished partition is reused as it is."""
    tag = f"{DATASET}_{n_images}x{image_px}px_seed{SPLIT_SEED}"
    src, parts = os.path.join(data_dir, f"{tag}_full"), os.path.join(data_dir, f"{tag}_split3")
    done = os.path.join(parts, "partition.json")
    if not os.path.isfile(done):
        for d in (src, parts):  # a run killed while writing leaves a partial folder
            shutil.rmtree(d, ignore_errors=True)
        say(f"writing {n_images} synthetic retina images ({image_px} px high, {workers} process(es)) -> {src}")
        write_retina_images(src, n_images, SPLIT_SEED, image_px, workers)
        kept = balance_retina(src, SPLIT_SEED)
        say(f"kept a balanced subset (SSL-FL): {kept['no_dr']} no_dr + {kept['dr']} dr images")
        write_site_folders(src, DATASET, parts, n_sites=N_SITES, alpha=ALPHA, seed=SPLIT_SEED)
    with open(done, encoding="utf-8") as f:
        return parts, json.load(f)


# ---------------------------------------------------------------------------------------------- batches on the device


class DeviceImages:
    """Every image of the run decoded once (as :class:`ImageDataset` decodes it: shorter side
    ``ceil(image_size / 0.875)``) into one uint8 tensor on ``device``, and batches of an :class:`ImageDataset`'s
    items augmented there: item ``i`` of epoch ``e`` draws its crop box, rotation, flip and colour jitter from
    ``(dataset.seed, e, i)`` exactly as ``ImageDataset.__getitem__`` does, so a batch holds the tensors the
    bundle's :func:`fedssl.data.images.batches` would (up to float rounding), at the device's speed."""

    def __init__(self, records: Sequence[ImageRecord], image_size: int, device: str, threads: int = 4):
        reader = ImageDataset(records, image_size, "eval", DATASET, site="evidence", cache=False)
        with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:  # PIL decodes and resizes without the GIL
            arrays = list(pool.map(reader.raw, range(len(records))))
        shapes = sorted({a.shape for a in arrays})
        if len(shapes) != 1:
            raise ValueError(f"DeviceImages needs images of one decoded shape, got {shapes[:3]}; the synthetic "
                             "retina writes one aspect ratio")
        self.device, self.image_size, self.base_size = torch.device(device), image_size, reader.base_size
        self.height, self.width = shapes[0][:2]
        self.pixels = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous().to(self.device)
        self.row = {r.path: i for i, r in enumerate(records)}
        self.mean = torch.tensor(IMAGENET_MEAN, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD, device=self.device).view(1, 3, 1, 1)

    def batch(self, ds: ImageDataset, indices: Sequence[int], epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x [B, 3, S, S] normalised, y [B])`` of items ``indices`` of ``ds`` in ``epoch``, on the device."""
        if ds.image_size != self.image_size or ds.base_size != self.base_size:
            raise ValueError(f"dataset image_size {ds.image_size} differs from the decoded images' {self.image_size}")
        idx = [int(i) for i in indices]
        rows = torch.tensor([self.row[ds.records[i].path] for i in idx], device=self.device)
        y = torch.tensor([int(ds.records[i].label) for i in idx], dtype=torch.long, device=self.device)
        img = self.pixels.index_select(0, rows).float().div_(255.0)
        s, h, w = self.image_size, self.height, self.width
        if ds.mode == "eval":
            top, left = (h - s) // 2, (w - s) // 2
            x = img[:, :, top:top + s, left:left + s]
        else:
            x = self._augment(ds, img, idx, epoch)
        return (x - self.mean) / self.std, y

    def _augment(self, ds: ImageDataset, img: torch.Tensor, idx: list[int], epoch: int) -> torch.Tensor:
        h, w = self.height, self.width
        thetas, factors, orders = [], [], []
        for i in idx:  # the draws of ImageDataset._augment, in its order
            g = np.random.default_rng([ds.seed, int(epoch), i])
            if ds.mode == "pretrain":
                top, left, ch, cw = ds._crop_box(h, w, PRETRAIN_SCALE[ds.dataset], g)
                angle = 0.0
            else:
                top, left, ch, cw = ds._crop_box(h, w, FINETUNE_SCALE[ds.dataset], g)
                angle = math.radians(g.uniform(-FINETUNE_ROTATION_DEG, FINETUNE_ROTATION_DEG))
            flip = -1.0 if g.random() < 0.5 else 1.0
            c, sn = math.cos(angle), math.sin(angle)
            thetas.append([[cw / w * c * flip, -cw / w * sn, (2 * left + cw) / w - 1],
                           [ch / h * sn * flip, ch / h * c, (2 * top + ch) / h - 1]])
            if ds.mode == "pretrain":
                factors.append(g.uniform(1 - COLOR_JITTER, 1 + COLOR_JITTER, size=3))
                orders.append(g.permutation(3))
        b, s = len(idx), self.image_size
        theta = torch.tensor(thetas, dtype=torch.float32).to(self.device)
        grid = F.affine_grid(theta, [b, 3, s, s], align_corners=False)
        x = F.grid_sample(img, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        if ds.mode == "pretrain":
            x = self._colour_jitter(x, np.array(factors), np.array(orders))
        return x.clamp_(0.0, 1.0)

    def _colour_jitter(self, x: torch.Tensor, factors: np.ndarray, orders: np.ndarray) -> torch.Tensor:
        """ImageDataset._colour_jitter per item: brightness, contrast, saturation in the item's order, clamped."""
        b = x.shape[0]
        for k in range(3):
            op = torch.tensor(orders[:, k], device=self.device).view(b, 1, 1, 1)
            f = torch.tensor(factors[np.arange(b), orders[:, k]], dtype=torch.float32,
                             device=self.device).view(b, 1, 1, 1)
            grey = (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)  # [B, 1, S, S]
            mean = grey.mean(dim=(2, 3), keepdim=True)
            x = torch.where(op == 0, x * f, torch.where(op == 1, (x - mean) * f + mean, (x - grey) * f + grey))
            x = x.clamp(0.0, 1.0)
        return x

    def epoch(self, ds: ImageDataset, batch_size: int, seed: int, epoch: int, fold_single: bool = False):
        """The batches of one epoch in :func:`fedssl.data.images.batches`' order (from ``(seed, epoch)``)."""
        n = len(ds)
        order = np.random.default_rng([int(seed), int(epoch)]).permutation(n)
        for start, stop in batch_bounds(n, batch_size, fold_single=fold_single):
            yield self.batch(ds, order[start:stop], epoch)


# ---------------------------------------------------------------------------------------------- FedAvg


def fedavg(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> dict:
    """``sum_i w_i x_i / sum_i w_i`` of every tensor (SSL-FL's FedAvg): for CPU tensors
    :func:`fedssl.core.state_dict.weighted_average` itself, for CUDA tensors :func:`device_average` (no copy of
    five models to the host and back every round)."""
    if len(states) == 0 or len(states) != len(weights):
        raise ValueError(f"need one weight per state, got {len(states)} states and {len(weights)} weights")
    if next(iter(states[0].values())).device.type == "cpu":
        return weighted_average(states, weights)
    return device_average(states, weights)


def device_average(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> dict:
    """:func:`fedssl.core.state_dict.weighted_average`'s arithmetic where the tensors are: the weighted sum in
    float64 in the states' order, divided by the total weight, cast back to each tensor's dtype (integer buffers
    rounded half to even); the same bits as ``weighted_average`` on a CPU (the tests check it)."""
    if len(states) == 0 or len(states) != len(weights):
        raise ValueError(f"need one weight per state, got {len(states)} states and {len(weights)} weights")
    total = float(sum(float(w) for w in weights))
    if not total > 0:
        raise ValueError(f"weights must not all be zero (got {list(weights)})")
    out = {}
    for key, ref in states[0].items():
        acc = torch.zeros(ref.shape, dtype=torch.float64, device=ref.device)
        for state, w in zip(states, weights):
            acc.add_(state[key].to(torch.float64) * float(w))
        mean = acc / total
        out[key] = mean.to(ref.dtype) if ref.is_floating_point() else torch.round(mean).to(ref.dtype)
    return out


# ---------------------------------------------------------------------------------------------- the two local trainers


class MAESite:
    """One site's Fed-MAE pre-training: what :class:`fedssl.train.mim.MIMLocalTrainer` builds from ``settings``
    (dataset seeded by ``site_seed(seed, site)``, :class:`MIMTrainer` with the settings' peak lr, warm-up and
    cosine over ``num_rounds``) around a given ``model``, and its ``train_round`` with batches from
    :class:`DeviceImages`."""

    def __init__(self, site: str, records: Sequence[ImageRecord], settings: MIMSettings, num_rounds: int,
                 model: torch.nn.Module, device: str):
        s = settings
        s.check(type(self).__name__)
        self.site, self.settings, self.data_seed = site, s, site_seed(s.seed, site)
        self.dataset = ImageDataset(records, s.image_size, "pretrain", s.dataset, site=site, seed=self.data_seed)
        self.trainer = MIMTrainer(model, s.method, lr=s.peak_lr, weight_decay=s.weight_decay,
                                  betas=(0.9, float(s.adam_beta2)),
                                  warmup_rounds=s.warmup_rounds, total_rounds=num_rounds, mask_ratio=s.mask_ratio,
                                  device=device, seed=self.data_seed, min_lr=s.min_lr,
                                  clip_grad=s.clip_grad or None, amp=s.amp)

    @property
    def model(self) -> torch.nn.Module:
        return self.trainer.model

    @property
    def samples(self) -> int:
        """|D_k|: SSL-FL weights the average by the site's number of images."""
        return len(self.dataset)

    def steps_per_round(self) -> int:
        s = self.settings
        steps = s.local_epochs * math.ceil(len(self.dataset) / s.batch_size)
        return min(steps, s.max_steps_per_round) if s.max_steps_per_round else steps

    def train_round(self, round_idx: int, images: DeviceImages) -> float:
        s, steps = self.settings, self.steps_per_round()

        def round_batches():
            done = 0
            for e in range(s.local_epochs):
                for x, _ in images.epoch(self.dataset, s.batch_size, self.data_seed, round_idx * s.local_epochs + e):
                    if done >= steps:
                        return
                    done += 1
                    yield x

        return self.trainer.train_round(round_batches(), round_idx, steps_per_round=steps)

    def load_global(self, state: Mapping[str, object]) -> None:
        load_checked(self.model, state, f"the global model sent to {self.site}")


class FineTuneSite:
    """One site's federated fine-tuning: what :class:`fedssl.train.classifier.ClassifierLocalTrainer` builds from
    ``settings`` (stratified validation split and labelled subset seeded by ``site_seed(seed, site)``,
    :class:`ClassifierTrainer` with layer decay, warm-up and cosine over ``num_rounds``) around a given ``model``,
    and its ``train_round`` with batches from :class:`DeviceImages`."""

    def __init__(self, site: str, records: Sequence[ImageRecord], settings: ClassifierSettings, num_rounds: int,
                 model: torch.nn.Module, device: str):
        s = settings
        s.check(type(self).__name__)
        self.site, self.settings, self.data_seed = site, s, site_seed(s.seed, site)
        train, val = train_val_split(records, s.val_fraction, seed=self.data_seed)
        if not val:
            raise ValueError(f"{site}: val_fraction={s.val_fraction} of {len(records)} images leaves no validation "
                             "image; raise val_fraction or add images")
        labelled = select_labelled(train, s.label_fraction, seed=self.data_seed)
        self.train_set = ImageDataset(labelled, s.image_size, "finetune", s.dataset, site=site, seed=self.data_seed)
        self.trainer = ClassifierTrainer(
            model, lr=s.lr, total_rounds=num_rounds, warmup_rounds=min(s.warmup_rounds, num_rounds), min_lr=s.min_lr,
            weight_decay=s.weight_decay, fedprox_mu=s.fedprox_mu, label_smoothing=s.label_smoothing,
            layer_decay=s.layer_decay, device=device, seed=self.data_seed, amp=s.amp)

    @property
    def model(self) -> torch.nn.Module:
        return self.trainer.model

    @property
    def samples(self) -> int:
        """|D_l^k|: SSL-FL weights fine-tuning by the site's labelled images."""
        return len(self.train_set)

    def steps_per_epoch(self) -> int:
        s = self.settings
        n = len(batch_bounds(len(self.train_set), s.batch_size, fold_single=True))
        return min(n, s.max_steps_per_epoch) if s.max_steps_per_epoch else n

    def train_round(self, round_idx: int, images: DeviceImages) -> float:
        s, trainer = self.settings, self.trainer
        trainer.set_global(dict(trainer.model.named_parameters()))
        n_steps, losses = self.steps_per_epoch(), []
        for epoch in range(s.local_epochs):
            data = images.epoch(self.train_set, s.batch_size, self.data_seed, round_idx * s.local_epochs + epoch,
                                fold_single=True)
            losses.append(trainer.train_round(data, round_idx + epoch / s.local_epochs,
                                              n_steps=n_steps * s.local_epochs,
                                              max_steps=s.max_steps_per_epoch or None))
        return sum(losses) / len(losses)

    def load_global(self, state: Mapping[str, object]) -> None:
        load_checked(self.model, state, f"the global model sent to {self.site}")


# ---------------------------------------------------------------------------------------------- settings


def mim_settings(cfg: dict, rounds: int, seed: int, device: str) -> MIMSettings:
    p, m = cfg["pretrain"], cfg["model"]
    s = MIMSettings(method="mae", dataset=DATASET, **m, norm_pix_loss=p["norm_pix_loss"], mask_ratio=p["mask_ratio"],
                    lr=p["lr"], min_lr=p["min_lr"], weight_decay=p["weight_decay"], batch_size=p["batch_size"],
                    local_epochs=p["local_epochs"], warmup_rounds=min(p["warmup_rounds"], rounds),
                    max_steps_per_round=p["max_steps_per_round"], amp=device.startswith("cuda"), seed=seed,
                    device=device)
    s.check("fedmae_evidence pre-training")
    return s


def classifier_settings(cfg: dict, seed: int, device: str) -> ClassifierSettings:
    f, m = cfg["finetune"], cfg["model"]
    s = ClassifierSettings(dataset=DATASET, image_size=m["image_size"], patch_size=m["patch_size"],
                           embed_dim=m["embed_dim"], depth=m["depth"], num_heads=m["num_heads"],
                           drop_path_rate=f["drop_path_rate"], lr=f["lr"], batch_size=f["batch_size"],
                           local_epochs=f["local_epochs"], warmup_rounds=f["warmup_rounds"], min_lr=f["min_lr"],
                           weight_decay=f["weight_decay"], label_fraction=f["label_fraction"],
                           val_fraction=f["val_fraction"], layer_decay=f["layer_decay"],
                           max_steps_per_epoch=f["max_steps_per_epoch"], eval_batch_size=f["eval_batch_size"],
                           seed=seed, device=device, amp=device.startswith("cuda"))
    s.check("fedmae_evidence fine-tuning")
    return s


def build_mae(cfg: dict, seed: int) -> torch.nn.Module:
    m = cfg["model"]
    return build_mim_model("mae", m["image_size"], m["patch_size"], m["embed_dim"], m["depth"], m["num_heads"],
                           m["decoder_embed_dim"], m["decoder_depth"], m["decoder_num_heads"],
                           cfg["pretrain"]["norm_pix_loss"], 2, seed)


def build_classifier(cfg: dict, seed: int) -> FineTuneViT:
    m = cfg["model"]
    return FineTuneViT(num_classes=len(class_names(DATASET)), image_size=m["image_size"], patch_size=m["patch_size"],
                       embed_dim=m["embed_dim"], depth=m["depth"], num_heads=m["num_heads"],
                       drop_path_rate=cfg["finetune"]["drop_path_rate"], seed=seed)


# ---------------------------------------------------------------------------------------------- timing probe


def _timed(fn: Callable[[], object], device: str) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def probe_pretrain(cfg: dict, sites: Mapping[str, Sequence[ImageRecord]], images: DeviceImages, seed: int,
                   device: str) -> dict:
    """Seconds of one pre-training round of all sites (steps x the timed step + average + loading) and the fixed
    seconds of a seed (building the model and the site copies), from a throwaway trainer on the largest site."""
    build = {}
    build["s"] = _timed(lambda: build.setdefault("model", build_mae(cfg, seed).to(device)), device)
    model = build["model"]
    copy_s = _timed(lambda: copy.deepcopy(model), device)
    big = max(sites, key=lambda k: len(sites[k]))
    site = MAESite(big, sites[big], mim_settings(cfg, 10, seed, device), 10, model, device)
    bs = cfg["pretrain"]["batch_size"]
    idx = [i % len(site.dataset) for i in range(bs)]

    def steps(k: int, r: int):
        site.trainer.train_round((images.batch(site.dataset, idx, r)[0] for _ in range(k)), r, steps_per_round=k)

    steps(PROBE_WARMUP_STEPS, 0)
    step_s = _timed(lambda: steps(PROBE_STEPS, 1), device) / PROBE_STEPS
    state = model.state_dict()

    def average_and_load():
        avg = fedavg([state] * len(sites), [1.0] * len(sites))
        for _ in sites:
            load_checked(model, avg, "probe")

    avg_s = _timed(average_and_load, device)
    p = cfg["pretrain"]
    n_steps = sum(min(p["local_epochs"] * math.ceil(len(r) / bs), p["max_steps_per_round"] or math.inf)
                  for r in sites.values())
    return {"step_s": step_s, "average_s": avg_s, "steps_per_round": n_steps, "build_s": build["s"],
            "copy_s": copy_s, "round_s": n_steps * step_s + avg_s, "seed_fixed_s": build["s"] + len(sites) * copy_s}


def probe_finetune(cfg: dict, sites: Mapping[str, Sequence[ImageRecord]], test: ImageDataset,
                   images: DeviceImages, seed: int, device: str) -> dict:
    """As :func:`probe_pretrain` for one fine-tuning round of both inits, plus the two test evaluations."""
    build = {}
    build["s"] = _timed(lambda: build.setdefault("model", build_classifier(cfg, seed).to(device)), device)
    model = build["model"]
    copy_s = _timed(lambda: copy.deepcopy(model), device)
    big = max(sites, key=lambda k: len(sites[k]))
    cs = classifier_settings(cfg, seed, device)
    site = FineTuneSite(big, sites[big], cs, 10, model, device)
    bs = cfg["finetune"]["batch_size"]
    idx = [i % len(site.train_set) for i in range(bs)]

    def steps(k: int, r: int):
        site.trainer.train_round((images.batch(site.train_set, idx, r) for _ in range(k)), r, n_steps=k)

    steps(PROBE_WARMUP_STEPS, 0)
    step_s = _timed(lambda: steps(PROBE_STEPS, 1), device) / PROBE_STEPS
    state = model.state_dict()

    def average_and_load():
        avg = fedavg([state] * len(sites), [1.0] * len(sites))
        for _ in sites:
            load_checked(model, avg, "probe")

    avg_s = _timed(average_and_load, device)
    n_eval = min(len(test), cfg["finetune"]["eval_batch_size"])
    eval_s = _timed(lambda: predict(model, [images.batch(test, range(n_eval), 0)], device), device) * len(test) / n_eval
    n_steps = sum(FineTuneSite(k, r, cs, 10, model, device).steps_per_epoch() * cs.local_epochs
                  for k, r in sites.items())
    return {"step_s": step_s, "average_s": avg_s, "steps_per_round": n_steps, "build_s": build["s"],
            "copy_s": copy_s, "eval_s": eval_s, "round_s": 2 * (n_steps * step_s + avg_s),
            "seed_fixed_s": build["s"] + 2 * len(sites) * copy_s + 2 * eval_s}


# ---------------------------------------------------------------------------------------------- the stages


class RoundBudget:
    """The rounds of one stage under a deadline, asked before every round (``while budget.next_round(r)``).

    It stops before a round expected to end more than half a round after ``deadline`` (``stopped_early``).  With
    ``replan_at`` (the stage's warm-up rounds, during which the learning rate does not depend on the round count)
    it re-plans once, before round ``replan_at``: the count becomes what the time left holds at the slowest of the
    last three measured rounds (:func:`replan_rounds`; never more than planned), and ``on_replan(count)`` sets the
    trainers' schedule to it.  The schedule then reaches its floor inside the budget, and a rerun given the final
    count repeats the numbers.  ``clock``: seconds (``time.time``; the tests give a fake one)."""

    def __init__(self, rounds: int, deadline: float, replan_at: int | None = None,
                 on_replan: Callable[[int], None] | None = None, clock: Callable[[], float] = time.time):
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds={rounds!r}: use a positive number of rounds")
        if replan_at is not None and (isinstance(replan_at, bool) or not isinstance(replan_at, int) or replan_at < 1):
            raise ValueError(f"replan_at={replan_at!r}: use a round index >= 1 (the warm-up rounds) or None")
        self.planned = self.rounds = rounds
        self.deadline, self.replan_at, self.on_replan, self.clock = float(deadline), replan_at, on_replan, clock
        self.seconds: list[float] = []
        self.stopped_early, self.replanned = False, False
        self._start: float | None = None

    def next_round(self, r: int) -> bool:
        """Whether round ``r`` runs; records the time of round ``r - 1``."""
        now = self.clock()
        if self._start is not None:
            self.seconds.append(now - self._start)
        self._start = now
        if r >= self.rounds:
            return False
        if r and now + 0.5 * self.seconds[-1] > self.deadline:
            self.stopped_early = True
            return False
        if r == self.replan_at and self.seconds:
            count = replan_rounds(self.rounds, r, self.seconds, self.deadline - now)
            if count < self.rounds:
                self.rounds, self.replanned = count, True
                if self.on_replan is not None:
                    self.on_replan(count)
            return r < self.rounds
        return True

    def record(self) -> dict:
        return {"planned": self.planned, "rounds": self.rounds, "replanned": self.replanned,
                "stopped_early": self.stopped_early}


def replan_rounds(rounds: int, done: int, round_seconds: Sequence[float], seconds_left: float) -> int:
    """The count a stage keeps after ``done`` measured rounds: ``done`` plus the rounds ``seconds_left`` holds at
    the slowest of the last three (``round_seconds``), at most ``rounds``: e.g. 40 planned, 5 done at 1.0, 1.2 and
    1.5 s, 30 s left -> 5 + 20 = 25."""
    slowest = max(round_seconds[-3:])
    if not (slowest > 0 and math.isfinite(slowest)):
        return rounds
    return int(max(done, min(rounds, done + math.floor(max(seconds_left, 0.0) / slowest))))


def chance_loss(cfg: dict, site: MAESite, images: DeviceImages) -> float:
    """MAE loss of the trivial predictor on one training batch (the site's first of round 0): the per-patch mean,
    i.e. 0 on norm-pix targets (per-patch normalised pixels), over every patch."""
    bs = cfg["pretrain"]["batch_size"]
    x, _ = next(images.epoch(site.dataset, bs, site.data_seed, 0))
    target = patchify(x.float(), cfg["model"]["patch_size"])
    norm_pix = cfg["pretrain"]["norm_pix_loss"]
    pred = torch.zeros_like(target) if norm_pix else target.mean(dim=-1, keepdim=True).expand_as(target)
    mask = torch.ones(target.shape[:2], dtype=torch.bool, device=target.device)
    return float(mae_loss(pred, target, mask, norm_pix=norm_pix))


def pretrain_seed(cfg: dict, sites: Mapping[str, Sequence[ImageRecord]], images: DeviceImages, seed: int,
                  budget: RoundBudget, device: str, say: Callable[[str], None]) -> dict:
    """Federated MAE pre-training of one seed: the rounds ``budget`` allows (its ``rounds`` planned; a re-plan sets
    every site's schedule to the new count) -> the global encoder (on the device), the per-round loss (site losses
    weighted by images), the chance loss and the budget's record."""
    rounds = budget.rounds
    settings = mim_settings(cfg, rounds, seed, device)
    model = build_mae(cfg, seed).to(device)
    global_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    local = [MAESite(site, recs, settings, rounds, model if i == 0 else copy.deepcopy(model), device)
             for i, (site, recs) in enumerate(sites.items())]

    def replan(count: int) -> None:
        say(f"seed {seed} pre-training: re-planned to {count} rounds from the measured warm-up rounds")
        for site in local:
            site.trainer.total_rounds = float(count)

    budget.on_replan = replan
    chance = chance_loss(cfg, local[0], images)
    losses, r = [], 0
    while budget.next_round(r):
        t = time.time()
        site_losses = []
        for site in local:
            site.load_global(global_state)
            site_losses.append(site.train_round(r, images))
        weights = [site.samples for site in local]
        global_state = fedavg([site.model.state_dict() for site in local], weights)
        losses.append(float(np.average(site_losses, weights=weights)))
        r += 1
        say(f"seed {seed} pre-training round {r}/{budget.rounds}: loss {losses[-1]:.4f} ({time.time() - t:.1f} s)")
    encoder = {k: torch.as_tensor(v).to(device) for k, v in encoder_state(global_state).items()}
    return {"encoder": encoder, "loss": losses, "chance_loss": chance, "rounds_done": len(losses),
            "stopped_early": budget.stopped_early, "budget": budget.record()}


def finetune_seed(cfg: dict, sites: Mapping[str, Sequence[ImageRecord]], test: ImageDataset, images: DeviceImages,
                  seed: int, encoder: Mapping[str, torch.Tensor], budget: RoundBudget, device: str,
                  say: Callable[[str], None]) -> dict:
    """Federated fine-tuning of one seed from the global MAE encoder ("fedmae") and from the same ViT at its random
    init ("scratch"), round by round in turn, for the rounds ``budget`` allows (as :func:`pretrain_seed`); each
    final global model tested on ``test``."""
    rounds = budget.rounds
    settings = classifier_settings(cfg, seed, device)
    scratch = build_classifier(cfg, seed).to(device)
    fedmae = copy.deepcopy(scratch)
    load_encoder_state(fedmae, encoder, source=f"the Fed-MAE global encoder of seed {seed}")
    runs = {}
    for init, model in (("fedmae", fedmae), ("scratch", scratch)):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        local = [FineTuneSite(site, recs, settings, rounds, model if i == 0 else copy.deepcopy(model), device)
                 for i, (site, recs) in enumerate(sites.items())]
        runs[init] = {"global": state, "sites": local, "loss": []}

    def replan(count: int) -> None:
        say(f"seed {seed} fine-tuning: re-planned to {count} rounds from the measured warm-up rounds")
        for run in runs.values():
            for site in run["sites"]:
                site.trainer.total_rounds = count

    budget.on_replan = replan
    done = 0
    while budget.next_round(done):
        t = time.time()
        for run in runs.values():
            site_losses = []
            for site in run["sites"]:
                site.load_global(run["global"])
                site_losses.append(site.train_round(done, images))
            weights = [site.samples for site in run["sites"]]
            run["global"] = fedavg([site.model.state_dict() for site in run["sites"]], weights)
            run["loss"].append(float(np.average(site_losses, weights=weights)))
        done += 1
        say(f"seed {seed} fine-tuning round {done}/{budget.rounds}: loss fedmae {runs['fedmae']['loss'][-1]:.4f}, "
            f"scratch {runs['scratch']['loss'][-1]:.4f} ({time.time() - t:.1f} s)")
    rows = []
    for init, run in runs.items():
        model = run["sites"][0].model
        load_checked(model, run["global"], f"the {init} global model")
        with owned_global_rng(derived_seed(seed, "evidence_test", init), device):
            probs, labels = predict(model, images.epoch(test, cfg["finetune"]["eval_batch_size"], 0, 0), device)
        metrics = classification_metrics(probs, labels, class_names(DATASET))
        rows.append({"seed": seed, "init": init, "accuracy": metrics["accuracy"],
                     "balanced_accuracy": metrics["balanced_accuracy"], "auc": metrics.get("auc"),
                     "n_test": int(metrics["n"]), "rounds_done": done})
    return {"rows": rows, "loss": {init: run["loss"] for init, run in runs.items()}, "rounds_done": done,
            "stopped_early": budget.stopped_early, "budget": budget.record()}


def paired_result(rows: Sequence[Mapping], seeds: Sequence[int]) -> dict:
    """fedmae - scratch test accuracy per seed (in ``seeds`` order, seeds with both rows), their mean and standard
    error over seeds (sample std / sqrt(n); None for one seed), through :func:`fedssl.eval.report.paired_against`."""
    table = [{"mode": "federated", "method": r["init"], "split": SPLIT, "seed": r["seed"], "accuracy": r["accuracy"]}
             for r in rows]
    paired = paired_against(table, baseline="scratch", mode="federated", units=(), column="split", score="accuracy")
    if not paired:
        return {"per_seed": [], "mean": None, "se": None, "n": 0}
    p = paired[0]
    by_seed = p.get("by_seed") or {str(r["seed"]): p["diff_mean"] for r in rows}
    per_seed = [float(by_seed[str(s)]) for s in seeds if str(s) in by_seed]
    return {"per_seed": per_seed, "mean": float(p["diff_mean"]), "se": p["diff_se"], "n": int(p["pairs"])}


# ---------------------------------------------------------------------------------------------- the command


def fedmae_evidence(out: str, *, size: str = "gpu", seeds: Sequence[int] = (0, 1, 2), device: str = "auto",
                    budget_s: float = 300.0, pretrain_rounds: int | None = None, finetune_rounds: int | None = None,
                    say: Callable[[str], None] = print) -> dict:
    """Fed-MAE vs ViT scratch on Split-3 over ``seeds`` within ``budget_s`` wall seconds (see the module
    docstring); writes ``out/data`` and ``out/fedmae_evidence.json`` (after every stage) and returns its content.

    ``pretrain_rounds`` / ``finetune_rounds``: fixed round counts (e.g. the ones a budgeted run recorded in
    ``settings``); None = chosen from the budget by a timing probe."""
    if size not in SIZES:
        raise ValueError(f"size={size!r}: use one of {sorted(SIZES)}")
    seeds = [int(s) for s in seeds]
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"seeds={seeds}: give distinct non-negative seeds (3 for a finding)")
    for name, value in (("pretrain_rounds", pretrain_rounds), ("finetune_rounds", finetune_rounds)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r}: use a positive number of rounds or None (chosen from the budget)")
    if not budget_s > 0:
        raise ValueError(f"budget_s={budget_s!r} must be positive")
    t0 = time.time()
    deadline = t0 + float(budget_s)
    cfg = copy.deepcopy(SIZES[size])
    device = resolve_device(device)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, RESULT_FILE)

    def note(msg: str) -> None:
        say(f"[{time.time() - t0:6.1f}s] {msg}")

    workers = cfg["data_workers"] or max(1, min(8, (os.cpu_count() or 2) // 2))
    result: dict = {"method": "Fed-MAE", "split": SPLIT, "metric": "test accuracy", "size": size,
                    "settings": {**cfg, "data_workers": workers, "dataset": DATASET, "alpha": ALPHA,
                                 "n_sites": N_SITES, "split_seed": SPLIT_SEED, "budget_s": float(budget_s),
                                 "amp": device.startswith("cuda"), "test_model": "final global model",
                                 "pretrain_rounds": pretrain_rounds, "finetune_rounds": finetune_rounds},
                    "device": device, "device_name": _device_name(device), "seeds": seeds,
                    "pretrain": {"rounds": pretrain_rounds, "seconds": 0.0, "loss_by_seed": {}, "chance_loss": None,
                                 "rounds_by_seed": {}, "rounds_done_by_seed": {}, "stopped_early": False},
                    "finetune": {"rounds": finetune_rounds, "seconds": 0.0, "loss_by_seed": {},
                                 "rounds_by_seed": {}, "rounds_done_by_seed": {}, "stopped_early": False},
                    "rows": [], "paired": {"per_seed": [], "mean": None, "se": None, "n": 0}, "verdict": ""}

    def save() -> None:
        result["seconds"] = round(time.time() - t0, 2)
        result["paired"] = paired_result(result["rows"], seeds)
        result["verdict"] = verdict_line(result["paired"]["per_seed"], result["paired"]["se"],
                                         result["pretrain"]["stopped_early"] or result["finetune"]["stopped_early"])
        _write_json(path, result)

    # 1. data
    t = time.time()
    parts, partition = write_split3(os.path.join(out, "data"), cfg["n_images"], cfg["image_px"], workers, note)
    sites = {s: load_image_records(os.path.join(parts, s), DATASET, site=s) for s in sorted(partition["sites"])}
    test_records = load_image_records(os.path.join(parts, "test"), DATASET, site="test")
    images = DeviceImages([r for recs in sites.values() for r in recs] + test_records, cfg["model"]["image_size"],
                          device, threads=workers)
    test = ImageDataset(test_records, cfg["model"]["image_size"], "eval", DATASET, site="test")
    result["data"] = {"seconds": round(time.time() - t, 2), "folder": parts, "n_written": cfg["n_images"],
                      "sites": {s: v["class_counts"] for s, v in partition["sites"].items()},
                      "test": partition["test"]["class_counts"]}
    note(f"data ready in {result['data']['seconds']} s: sites {result['data']['sites']}, test "
         f"{result['data']['test']}")
    save()

    # 2. rounds: given, or what the budget holds after a timing probe
    planned, planned_ft = pretrain_rounds is None, finetune_rounds is None
    if pretrain_rounds is None:
        result["pretrain"]["probe"] = probe_pretrain(cfg, sites, images, seeds[0], device)
    if finetune_rounds is None:
        result["finetune"]["probe"] = probe_finetune(cfg, sites, test, images, seeds[0], device)
    plan_start = time.time()
    avail = max(0.0, deadline - plan_start - RESERVE_SHARE * budget_s)
    share, n = cfg["pretrain_share"], len(seeds)
    if pretrain_rounds is None:
        pr = result["pretrain"]["probe"]
        pretrain_rounds = choose_rounds(share * avail - n * pr["seed_fixed_s"], n * pr["round_s"],
                                        cfg["pretrain"]["max_rounds"])
    if finetune_rounds is None:
        pr = result["finetune"]["probe"]
        finetune_rounds = choose_rounds((1 - share) * avail - n * pr["seed_fixed_s"], n * pr["round_s"],
                                        cfg["finetune"]["max_rounds"])
    result["settings"].update(pretrain_rounds=pretrain_rounds, finetune_rounds=finetune_rounds)
    result["pretrain"]["rounds"], result["finetune"]["rounds"] = pretrain_rounds, finetune_rounds
    note(f"{pretrain_rounds} pre-training and {finetune_rounds} fine-tuning rounds per seed on {device}")
    save()

    # 3. per seed: pre-training, then both fine-tunings; an equal slice of the time left for each seed.  Counts
    # chosen by the probe are re-planned from each stage's measured warm-up rounds; a count a seed re-planned down
    # to is the next seeds' plan (so seeds differ only where a later one runs slower).
    slice_s = avail / n
    plan = {"pretrain": (pretrain_rounds, cfg["pretrain"]["warmup_rounds"] if planned else 0),
            "finetune": (finetune_rounds, cfg["finetune"]["warmup_rounds"] if planned_ft else 0)}

    def budget(stage: str, ends: float) -> RoundBudget:
        count, warmup = plan[stage]  # no warm-up (or given counts): no re-plan
        return RoundBudget(count, ends, replan_at=warmup if 0 < warmup < count else None)

    def record(stage: str, key: str, out: dict, seconds: float) -> None:
        res = result[stage]
        res["seconds"] = round(res["seconds"] + seconds, 2)
        res["rounds_done_by_seed"][key] = out["rounds_done"]
        res["rounds_by_seed"][key] = out["budget"]["rounds"]
        res["stopped_early"] |= out["stopped_early"]
        plan[stage] = (out["budget"]["rounds"], plan[stage][1])

    for j, seed in enumerate(seeds):
        if time.time() > deadline:
            note(f"seed {seed}: skipped, the budget is spent")
            result["pretrain"]["stopped_early"] = result["finetune"]["stopped_early"] = True
            break
        t = time.time()
        pre = pretrain_seed(cfg, sites, images, seed, budget("pretrain", plan_start + (j + share) * slice_s), device,
                            note)
        key = str(seed)
        record("pretrain", key, pre, time.time() - t)
        result["pretrain"]["loss_by_seed"][key] = pre["loss"]
        if result["pretrain"]["chance_loss"] is None:
            result["pretrain"]["chance_loss"] = pre["chance_loss"]
        save()
        t = time.time()
        ft = finetune_seed(cfg, sites, test, images, seed, pre["encoder"],
                           budget("finetune", plan_start + (j + 1) * slice_s), device, note)
        record("finetune", key, ft, time.time() - t)
        result["finetune"]["loss_by_seed"][key] = ft["loss"]
        result["rows"] += ft["rows"]
        acc = {r["init"]: r["accuracy"] for r in ft["rows"]}
        note(f"seed {seed}: test accuracy fedmae {acc['fedmae']:.3f}, scratch {acc['scratch']:.3f}")
        save()
    note(result["verdict"])
    return json.loads(json.dumps(result))


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return platform.processor() or platform.machine() or "cpu"
