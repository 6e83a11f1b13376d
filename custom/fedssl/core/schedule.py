"""Learning-rate schedules: SSL-FL pre-training's (SSL-FL (Yan et al., IEEE TMI 2023) section IV-A.3) linear warm-up,
then cosine decay (:func:`warmup_cosine`); FCL's, FCLOpt's and FedCLF's plain cosine decay (:func:`cosine_lr`).

Federated training counts in communication rounds (one round = E local epochs), so ``progress`` is in
rounds and fractional within a round: step ``s`` of ``S`` in round ``t`` has ``progress = t + s / S``
(MAE's ``adjust_learning_rate`` with epochs replaced by rounds).
"""

from __future__ import annotations

import math


def warmup_cosine(progress: float, base_lr: float, warmup: float, total: float, min_lr: float = 0.0) -> float:
    """lr at ``progress`` rounds: ``base_lr * progress / warmup`` while ``progress < warmup``, then
    ``min_lr + (base_lr - min_lr) * (1 + cos(pi * (progress - warmup) / (total - warmup))) / 2``;
    ``min_lr`` once ``progress >= total``."""
    if not (total > 0 and 0 <= warmup <= total):
        raise ValueError(f"warmup_cosine: need 0 <= warmup <= total and total > 0, got warmup={warmup}, total={total}")
    if not (base_lr > 0 and 0 <= min_lr <= base_lr):
        raise ValueError(f"warmup_cosine: need base_lr > 0 and 0 <= min_lr <= base_lr, got {base_lr}, {min_lr}")
    if not progress >= 0:
        raise ValueError(f"warmup_cosine: progress={progress} must be >= 0 (rounds done, fractional)")
    if progress < warmup:
        return base_lr * progress / warmup
    if progress >= total:
        return min_lr
    t = (progress - warmup) / (total - warmup)
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))


def cosine_lr(base_lr: float, progress: float) -> float:
    """Cosine decay without warm-up (FCL section 5 and FedCLF: over all rounds): ``lr * 0.5 * (1 + cos(pi *
    progress))``, ``progress`` in [0, 1] (clipped)."""
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
