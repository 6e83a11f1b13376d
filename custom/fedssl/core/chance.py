"""Chance levels of the pre-training losses: the loss of a network whose output carries no information about its
input (issue 44, "loss health").  A pre-training whose loss never falls below its chance level has learnt nothing
the loss can see, whatever its fine-tuning numbers say.

* InfoNCE with one positive and K negatives (MoCo, FCL eq. 3 :func:`fedssl.core.fcl_loss.contrastive_term`, FedCLF
  eq. 6 :func:`fedssl.core.fedclf.info_nce`): ``-log(e^p / (e^p + sum_K e^n))`` with every logit equal (features
  that are all the same) is ``ln(K + 1)`` (:func:`infonce_chance`).  A query with several positives averages that
  same value.
* NT-Xent over the 2B views of a batch (SimCLR, :func:`fedssl.core.fedclf.nt_xent`): each view is classified among
  the 2B - 1 others, ``ln(2B - 1)`` (:func:`nt_xent_chance`).
* Cross-entropy over C classes with uniform logits: ``ln(C)`` (:func:`uniform_chance`): BEiT's masked-token
  prediction over a vocabulary of V visual tokens (:func:`fedssl.core.mim.beit_loss`), FedRotation's 4 rotations.
  A predictor of the tokens' marginal frequencies sits lower (their entropy): ``ln(V)`` is the uniform one's.
* MAE with per-patch normalised targets (``norm_pix_loss``, :func:`fedssl.core.mim.mae_loss` with
  :func:`fedssl.core.patches.normalize_patches`): predicting each patch's own mean, 0 after normalisation, costs
  the mean square of the normalised target, ``(d - 1) / d`` for ``d`` = pixels x channels of a patch (the
  normalisation divides by the unbiased variance; a flat patch scores 0, so a batch can sit a little lower)
  (:func:`norm_pix_mae_chance`).  Without ``norm_pix_loss`` the same predictor costs the patches' mean pixel
  variance, a property of the data, not of the settings: no chance level is derived.

BYOL (no negatives) has no chance level: a collapsed BYOL reaches loss 0, so only its feature spread
(:mod:`fedssl.core.spread`) tells collapse.
"""

from __future__ import annotations

import math


def _count(name: str, value: int, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name}={value!r}: use an integer >= {least}")
    return value


def infonce_chance(n_negatives: int) -> float:
    """``ln(K + 1)``: InfoNCE of one positive among ``K = n_negatives`` negatives when every logit is equal."""
    return math.log(_count("n_negatives", n_negatives, 1) + 1)


def nt_xent_chance(batch_size: int) -> float:
    """``ln(2B - 1)``: NT-Xent of a batch of ``B`` images (2B views, each against the 2B - 1 others)."""
    return math.log(2 * _count("batch_size", batch_size, 2) - 1)


def uniform_chance(n_classes: int) -> float:
    """``ln(C)``: cross-entropy of uniform logits over ``C`` classes (BEiT's V visual tokens, 4 rotations)."""
    return math.log(_count("n_classes", n_classes, 2))


def norm_pix_mae_chance(patch_dim: int) -> float:
    """``(d - 1) / d``: the MAE loss on per-patch normalised targets of ``d = patch_dim`` values (p x p x channels)
    when the prediction is the patch mean (0)."""
    d = _count("patch_dim", patch_dim, 2)
    return (d - 1) / d
