"""FedDRA's Table 4 evaluation: few-shot classification on mBRSET (appendix A.2.2: "We fine-tune the model with an
additional linear layer on 10%, 20% and 100% of the training data, and report classification accuracies"), for
diabetic retinopathy and edema, each binary (:mod:`fedssl.data.vlp_mbrset`).

Protocol: :func:`fedssl.train.vlp_finetune.few_shot_finetune` (a linear layer on the frozen image encoder with MGCA's
fine-tuner settings, the same as the paper's few-shot classification), fractions 10 %, 20 %, 100 %, one run per
(task, fraction) with its own generator (``dataset`` = ``"mbrset_dr"`` / ``"mbrset_edema"``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedssl.data.vlp import VLPDataset, VLPRecord
from fedssl.data.vlp_mbrset import MBRSET_TASKS, load_mbrset
from fedssl.train.vlp_finetune import few_shot_finetune

#: the paper's label fractions (Table 4)
MBRSET_FRACTIONS = (0.1, 0.2, 1.0)


class _Fundus(torch.utils.data.Dataset):
    """(image tensor, label) items of (path, label) pairs through VLPDataset's RGB pipeline."""

    def __init__(self, items: Sequence[tuple[str, int]], image_size: int):
        recs = [VLPRecord(image=p, text="", labels=(int(y),), patient=str(i), study=str(i), split="train")
                for i, (p, y) in enumerate(items)]
        self.images = VLPDataset(recs, image_size, channels=3, colour="rgb", cache=False)
        self.labels = [int(y) for _, y in items]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i][0], self.labels[i]


def mbrset_evaluation(model, root: str, seed: int = 0, fractions: Sequence[float] = MBRSET_FRACTIONS,
                      **overrides) -> dict[str, dict]:
    """``{"dr": {"10%": {"accuracy", "auroc", ...}, ...}, "edema": {...}}`` of ``model``'s frozen image encoder
    (``image_features``); ``overrides``: fine-tuner settings by name (e.g. ``epochs=5`` for tests)."""
    split = load_mbrset(root, site="mbrset", seed=seed)
    out = {}
    for t, task in enumerate(MBRSET_TASKS):
        tr = _Fundus([(p, labels[t]) for p, *labels in split["train"]], model.image_size)
        te = _Fundus([(p, labels[t]) for p, *labels in split["test"]], model.image_size)
        res = few_shot_finetune(model, tr, te, dataset=f"mbrset_{task}", seed=seed, fractions=tuple(fractions),
                                n_classes=2, train_labels=tr.labels, features="image_features", **overrides)
        out[task] = {k: {m: v[m] for m in ("accuracy", "auroc") if m in v} for k, v in res.items()}
    return out


__all__ = ["MBRSET_FRACTIONS", "mbrset_evaluation"]
