"""One client's masked-image-modelling pre-training loop (SSL-FL (Yan et al., IEEE TMI 2023) section III-C, Alg. 1),
free of any FLARE type; the losses are :func:`fedssl.core.mim.mae_loss` (computed by :class:`fedssl.models.vit.MAEViT`)
and :func:`fedssl.core.mim.beit_loss`.

:class:`MIMTrainer` keeps the model, AdamW state and mask generator of one client across rounds;
the learning rate follows :func:`fedssl.core.schedule.warmup_cosine` indexed by round (fractional within
the round), so a client that restarts from ``state_dict()`` continues the same schedule.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterable

import torch
from torch import nn

from fedssl.core.masking import block_masking, block_masks, num_masked
from fedssl.core.mim import beit_loss
from fedssl.core.rng import owned_global_rng
from fedssl.core.schedule import warmup_cosine
from fedssl.core.seeds import derived_seed
from fedssl.core.spread import SpreadMeter
from fedssl.core.trainer import MixedPrecision

METHODS = ("mae", "beit")
NO_DECAY_SUFFIXES = ("pos_embed", "cls_token", "mask_token")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on weight matrices; none on norms, biases, layer scales (1-D), position
    embeddings, class and mask tokens (MAE / BEiT ``param_groups_weight_decay``).  Frozen tensors (fixed
    sin-cos position embeddings) are left out."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name.endswith(NO_DECAY_SUFFIXES) else decay).append(p)
    return [{"params": decay, "weight_decay": float(weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]


class MIMTrainer:
    """Local Fed-MAE / Fed-BEiT training of one client.

    ``method="mae"``: ``model(imgs, mask_ratio, generator)`` -> ``(loss, pred, mask)`` (:class:`MAEViT`).
    ``method="beit"``: ``mask_ratio`` is the block-masking budget (0.4); per sample a block mask, targets
    ``tokenizer.encode(imgs)`` at the masked positions, ``model(imgs, mask)`` -> logits (:class:`BEiTViT`).

    The executor loads the global model into ``trainer.model`` in place (``load_state_dict``) so the
    optimiser keeps its state across rounds.
    """

    def __init__(
        self,
        model: nn.Module,
        method: str,
        lr: float,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_rounds: float = 5,
        total_rounds: float = 1600,
        mask_ratio: float = 0.6,
        tokenizer: object | None = None,
        device: str | torch.device = "cpu",
        seed: int = 0,
        *,
        min_lr: float = 0.0,
        clip_grad: float | None = None,
        min_block: int | None = None,
        amp: bool = False,
    ):
        if method not in METHODS:
            raise ValueError(f"MIMTrainer: method={method!r}; use one of {list(METHODS)}")
        if not (float(lr) > 0 and 0 <= float(min_lr) <= float(lr)):
            raise ValueError(f"MIMTrainer: lr={lr!r}, min_lr={min_lr!r}; need lr > 0 and 0 <= min_lr <= lr")
        if not (float(total_rounds) > 0 and 0 <= float(warmup_rounds) <= float(total_rounds)):
            raise ValueError(
                f"MIMTrainer: warmup_rounds={warmup_rounds!r}, total_rounds={total_rounds!r}; need "
                "0 <= warmup_rounds <= total_rounds (paper: MAE 5 / 1600, BEiT 10 / 1000)"
            )
        if float(weight_decay) < 0 or len(tuple(betas)) != 2:
            raise ValueError(f"MIMTrainer: weight_decay={weight_decay!r}, betas={betas!r} (paper: 0.05, (0.9, 0.999))")
        if clip_grad is not None and not float(clip_grad) > 0:
            raise ValueError(f"MIMTrainer: clip_grad={clip_grad!r} must be > 0 or None (SSL-FL BEiT: 3.0)")
        self.model = model.to(device)
        self.method = method
        self.lr, self.min_lr = float(lr), float(min_lr)
        self.weight_decay, self.betas = float(weight_decay), tuple(float(b) for b in betas)
        self.warmup_rounds, self.total_rounds = float(warmup_rounds), float(total_rounds)
        self.mask_ratio = float(mask_ratio)
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.seed = int(seed)
        self.clip_grad = None if clip_grad is None else float(clip_grad)
        self.min_block = min_block
        self.amp = bool(amp)
        self.precision = MixedPrecision(self.device, self.amp)  # bfloat16 where the GPU has it, float16 + scaler before
        self.num_patches = int(getattr(model, "num_patches"))
        self.grid_size = tuple(getattr(model, "grid_size"))
        self._check_method_setup()
        self.generator = torch.Generator().manual_seed(self.seed)
        self.optimizer = torch.optim.AdamW(param_groups(self.model, self.weight_decay), lr=self.lr, betas=self.betas)
        self.step = 0  # optimiser steps taken, all rounds
        self.rounds_done = 0
        self.last_stats: dict = {}

    def _check_method_setup(self) -> None:
        if self.method == "mae":
            num_masked(self.num_patches, self.mask_ratio)  # raises on a bad ratio
            return
        block_masking(*self.grid_size, self.mask_ratio, self.min_block, torch.Generator().manual_seed(0))
        tok = self.tokenizer
        if tok is None or not callable(getattr(tok, "encode", None)):
            raise ValueError("MIMTrainer: method 'beit' needs a tokenizer with encode(imgs) -> ids [B, L]")
        vocab = int(getattr(self.model, "vocab_size"))
        if getattr(tok, "vocab_size", None) is not None and int(tok.vocab_size) != vocab:
            raise ValueError(
                f"MIMTrainer: tokenizer has {tok.vocab_size} tokens but the model predicts {vocab}; "
                "set the model's vocab_size to the codebook size"
            )
        if getattr(tok, "patch_size", None) is not None and int(tok.patch_size) != int(self.model.patch_size):
            raise ValueError(
                f"MIMTrainer: tokenizer patch size {tok.patch_size} differs from the model's {self.model.patch_size}"
            )

    def lr_at(self, progress: float) -> float:
        return warmup_cosine(progress, self.lr, self.warmup_rounds, self.total_rounds, self.min_lr)

    def compute_loss(self, imgs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """The MIM loss of one batch of normalised images ``[B, 3, H, W]`` (masks drawn from ``generator``)."""
        return self._loss(imgs, generator)[0]

    def _loss(self, imgs: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The loss and the visible-patch mask ``[B, L]`` (BEiT; None for MAE, whose encoder sees only visible
        patches)."""
        g = self.generator if generator is None else generator
        imgs = imgs.to(self.device, non_blocking=True).float()
        if self.method == "mae":
            with self.precision.autocast():
                loss, _, _ = self.model(imgs, self.mask_ratio, generator=g)
            return loss, None
        mask = block_masks(imgs.shape[0], *self.grid_size, self.mask_ratio, self.min_block, g).to(self.device)
        ids = self.tokenizer.encode(imgs)  # full precision: token targets must not depend on autocast
        vocab = int(self.model.vocab_size)
        if tuple(ids.shape) != tuple(mask.shape) or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(
                f"tokenizer returned ids {tuple(ids.shape)} in [{int(ids.min())}, {int(ids.max())}]; expected "
                f"{tuple(mask.shape)} in [0, {vocab}) (one id per patch of the model's grid)"
            )
        with self.precision.autocast():
            logits = self.model(imgs, mask)
        return beit_loss(logits, ids, mask), ~mask.to(torch.bool)

    def _loss_and_pooled(self, imgs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The loss of one training batch and the encoder's mean-pooled visible tokens ``[B, D]``, read from the
        output of the encoder's final norm (``model.encoder.norm``: class token first, then the patch tokens;
        MAE: the visible ones only).  None when the model has no such module."""
        seen: list[torch.Tensor] = []
        norm = getattr(getattr(self.model, "encoder", None), "norm", None)
        hook = (norm.register_forward_hook(lambda m, i, out: seen.append(out.detach())) if isinstance(norm, nn.Module)
                else None)
        try:
            loss, visible = self._loss(imgs, None)
        finally:
            if hook is not None:
                hook.remove()
        if not seen:
            return loss, None
        tokens = seen[-1][:, 1:].float()  # [B, V or L, D] without the class token
        if visible is None:
            return loss, tokens.mean(dim=1)
        w = visible.to(tokens.device, tokens.dtype).unsqueeze(-1)
        return loss, (tokens * w).sum(dim=1) / w.sum(dim=1).clamp(min=1.0)

    def train_round(
        self,
        batches: Iterable,
        round_idx: int,
        steps_per_round: int | None = None,
        progress: Callable[[int, float], None] | None = None,
    ) -> float:
        """One local pass over ``batches`` (tensors ``[B, 3, H, W]`` or ``(imgs, labels)`` tuples) in round
        ``round_idx`` (0-based); the lr of step ``s`` is ``warmup_cosine(round_idx + s / steps_per_round)``.
        Returns the mean loss; ``last_stats`` holds steps, images, lr range and ``feature_std``, the spread of
        the encoder's mean-pooled visible tokens averaged over the steps (0 = collapse, :mod:`fedssl.core.spread`;
        None for a model without ``encoder.norm``).  Runs in the owned global RNG of (seed, ``round_idx``): drop path
        and any other draw outside the mask generator (:func:`fedssl.core.rng.owned_global_rng`)."""
        with owned_global_rng(derived_seed(self.seed, "mim_round", round_idx), self.device):
            return self._train_round(batches, round_idx, steps_per_round, progress)

    def _train_round(self, batches: Iterable, round_idx: int, steps_per_round: int | None,
                     progress: Callable[[int, float], None] | None) -> float:
        if steps_per_round is None:
            try:
                steps_per_round = len(batches)  # type: ignore[arg-type]
            except TypeError:
                raise ValueError("train_round: pass steps_per_round when batches is an iterator") from None
        steps_per_round = max(int(steps_per_round), 1)
        self.model.train()
        losses: list[float] = []
        n_images = 0
        lrs: list[float] = []
        spread = SpreadMeter()
        for step, batch in enumerate(batches):
            imgs = batch[0] if isinstance(batch, (tuple, list)) else batch
            lr = self.lr_at(round_idx + min(step / steps_per_round, 1.0))
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            loss, pooled = self._loss_and_pooled(imgs)
            if pooled is not None:
                spread.add(pooled)
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"{self.method.upper()} loss became {loss.item()} at round {round_idx} step {step} (lr {lr:.3g}); "
                    "lower the learning rate or enable clip_grad"
                )
            self.precision.step(loss, self.optimizer, self.clip_grad, self.model.parameters())
            self.step += 1
            losses.append(float(loss.item()))
            lrs.append(lr)
            n_images += int(imgs.shape[0])
            if progress is not None:
                progress(step, losses[-1])
        if not losses:
            raise ValueError(f"no training batch in round {round_idx}: the site has fewer images than one batch")
        self.rounds_done = int(round_idx) + 1
        mean = sum(losses) / len(losses)
        self.last_stats = {"loss": mean, "steps": len(losses), "images": n_images, "lr_start": lrs[0],
                           "lr_end": lrs[-1], "round": int(round_idx), "losses": losses, "lrs": lrs,
                           "feature_std": spread.mean}
        return mean

    @torch.no_grad()
    def eval_loss(self, imgs: torch.Tensor, seed: int = 0) -> float:
        """Loss of a fixed batch with masks drawn from a fresh generator seeded ``seed`` (model in eval mode, in the
        owned global RNG of (trainer seed, ``seed``))."""
        was_training = self.model.training
        self.model.eval()
        try:
            with owned_global_rng(derived_seed(self.seed, "mim_eval_loss", int(seed)), self.device):
                return float(self.compute_loss(imgs, torch.Generator().manual_seed(int(seed))).item())
        finally:
            self.model.train(was_training)

    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "step": self.step,
            "rounds_done": self.rounds_done,
            "method": self.method,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("method", self.method) != self.method:
            raise ValueError(f"checkpoint was written by a {state['method']!r} trainer, this one is {self.method!r}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))  # never alias the source's buffers
        self.generator.set_state(state["generator"])
        self.step = int(state["step"])
        self.rounds_done = int(state["rounds_done"])
