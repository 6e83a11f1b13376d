"""Training throughput of the ViT models of SSL-FL / FedMAE-KS (images per second), on the site's device.

``fedssl sslfl bench`` times the exact local training step the FLARE executors run:

* ``mae``  - :class:`~fedssl.train.mim_loop.MIMTrainer` over :class:`~fedssl.models.vit.MAEViT` (random masking,
  ViT decoder, MSE on masked patches), AdamW, warm-up + cosine lr;
* ``beit`` - the same trainer over :class:`~fedssl.models.vit.BEiTViT` with a :class:`PatchTokenizer`
  (codebook K = ``vocab_size``; the targets are computed in the timed step, as on a site);
* ``finetune`` - :class:`~fedssl.models.vit.ViTClassifier` with cross-entropy and AdamW (the fine-tuning step).

``size="vit_b16"`` is the paper's ViT-B/16 at 224 px (MAE decoder 512 wide, 8 blocks); ``size="tiny"`` is the
CPU twin.  Images are random tensors already on the device, so the figure is the model's step time, not the
data loader's.  Each measurement runs ``warmup`` steps first, then times ``steps`` steps between device
synchronisations.  Pure torch: no FLARE.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time

import torch
import torch.nn.functional as F

from fedssl.core.trainer import MixedPrecision

METHODS = ("mae", "beit", "finetune")
SIZES = ("vit_b16", "tiny")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(method: str, size: str, mask_ratio: float, device: torch.device, amp: bool, vocab_size: int):
    from fedssl.core.tokenizer import PatchTokenizer, random_codebook
    from fedssl.models.vit import TINY_DECODER, TINY_VIT, TINY_VOCAB, BEiTViT, MAEViT, ViTClassifier
    from fedssl.train.mim_loop import MIMTrainer, param_groups

    vit = dict(TINY_VIT) if size == "tiny" else {}
    if method == "mae":
        model = MAEViT(**vit, **(TINY_DECODER if size == "tiny" else {}))
        trainer = MIMTrainer(model, "mae", lr=1e-3, mask_ratio=mask_ratio, device=device, amp=amp,
                             warmup_rounds=1, total_rounds=10)
        return trainer, None
    if method == "beit":
        vocab = TINY_VOCAB if size == "tiny" else int(vocab_size)
        model = BEiTViT(**vit, vocab_size=vocab, rel_pos_bias="shared")  # as jobs/sslfl_beit_retina
        tok = PatchTokenizer(random_codebook(vocab, model.patch_size, torch.Generator().manual_seed(0)),
                             model.patch_size)
        trainer = MIMTrainer(model, "beit", lr=1.5e-3, mask_ratio=mask_ratio, tokenizer=tok, device=device, amp=amp,
                             warmup_rounds=1, total_rounds=10, clip_grad=3.0)
        return trainer, None
    model = ViTClassifier(num_classes=2, **vit).to(device)
    opt = torch.optim.AdamW(param_groups(model, 0.05), lr=3e-3)
    return model, opt


def measure(method: str = "mae", size: str = "vit_b16", batch_size: int = 64, steps: int = 20, warmup: int = 5,
            mask_ratio: float | None = None, amp: bool = True, device: str = "auto", vocab_size: int = 8192,
            seed: int = 0) -> dict:
    """Images per second of ``steps`` local training steps (after ``warmup`` untimed ones).

    ``mask_ratio`` defaults to the paper's: 0.6 for Fed-MAE (SSL-FL), 0.4 block budget for Fed-BEiT.
    ``amp``: bfloat16 autocast (the executors' ``amp`` switch); ignored on CPU.
    """
    if method not in METHODS:
        raise ValueError(f"bench: method={method!r}; use one of {list(METHODS)}")
    if size not in SIZES:
        raise ValueError(f"bench: size={size!r}; use one of {list(SIZES)}")
    if int(batch_size) < 1 or int(steps) < 1 or int(warmup) < 0:
        raise ValueError(f"bench: batch_size={batch_size!r}, steps={steps!r}, warmup={warmup!r}; need batch_size >= 1, "
                         "steps >= 1, warmup >= 0")
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    amp = bool(amp) and dev.type == "cuda"
    if mask_ratio is None:
        mask_ratio = 0.6 if method == "mae" else 0.4
    torch.manual_seed(seed)
    model_or_trainer, opt = _build(method, size, float(mask_ratio), dev, amp, vocab_size)
    img = 32 if size == "tiny" else 224
    imgs = torch.randn(int(batch_size), 3, img, img, device=dev)
    labels = torch.randint(0, 2, (int(batch_size),), device=dev)

    precision = MixedPrecision(dev, amp)  # the trainers' own autocast and (float16) gradient scaling
    if method == "finetune":
        model = model_or_trainer
        model.train()

        def one_step() -> float:
            with precision.autocast():
                loss = F.cross_entropy(model(imgs).float(), labels)
            precision.step(loss, opt)
            return float(loss.detach())
        n_params = sum(p.numel() for p in model.parameters())
    else:
        trainer = model_or_trainer

        def one_step() -> float:
            return trainer.train_round([imgs], round_idx=0, steps_per_round=1)
        n_params = sum(p.numel() for p in trainer.model.parameters())

    dtype = precision.dtype
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for _ in range(int(warmup)):
        one_step()
    _sync(dev)
    t0 = time.perf_counter()
    losses = [one_step() for _ in range(int(steps))]
    _sync(dev)
    dt = time.perf_counter() - t0
    if not all(math.isfinite(v) for v in losses):
        raise FloatingPointError(f"bench: non-finite loss during the timed steps: {losses}")
    result = {
        "method": method, "size": size, "batch_size": int(batch_size), "steps": int(steps), "warmup": int(warmup),
        "mask_ratio": None if method == "finetune" else float(mask_ratio), "amp_bf16": dtype == torch.bfloat16,
        "amp_dtype": str(dtype).replace("torch.", "") if dtype is not None else "float32",
        "device": str(dev), "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda"
        else (platform.processor() or "cpu"),
        "torch": torch.__version__, "parameters": int(n_params), "seconds": round(dt, 4),
        "step_ms": round(1000 * dt / int(steps), 2), "images_per_s": round(int(steps) * int(batch_size) / dt, 1),
        "last_loss": losses[-1],
    }
    if dev.type == "cuda":
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
    return result


def run_bench(out: str | None, methods=METHODS, size: str = "vit_b16", batch_sizes=(64,), **kw) -> list[dict]:
    """Every (method, batch size) pair; prints one line each and writes the list to ``out`` (JSON) if given."""
    rows = []
    for method in methods:
        for bs in batch_sizes:
            r = measure(method, size, batch_size=bs, **kw)
            rows.append(r)
            mem = f", peak {r['peak_memory_gib']} GiB" if "peak_memory_gib" in r else ""
            print(f"{method:<9} {size:<8} batch {bs:>4}: {r['images_per_s']:>8.1f} images/s ({r['step_ms']} ms/step, "
                  f"{r['parameters'] / 1e6:.1f} M params, {r['device_name']}{mem})", flush=True)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows
