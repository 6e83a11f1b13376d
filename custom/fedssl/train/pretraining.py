"""What every unlabelled pre-training LocalTrainer shares (FCL, FedCLF): no evaluation split, the global state is
the whole model.

A subclass holds its network as ``self.model`` and names itself in ``method_name`` and where its encoder is
evaluated in ``finetune_hint``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fedssl.core.trainer import detached, load_checked


class Pretrainer:
    method_name = "pre-training"
    #: where the pre-trained encoder is evaluated (pre-training reads no label)
    finetune_hint = "fine-tune it"
    #: how a received global model is named in load errors
    global_name = "the global model"
    model: torch.nn.Module

    def evaluate(self, split: str = "val") -> dict[str, Any]:
        raise ValueError(f"split={split!r}: {self.method_name} pre-training reads unlabelled images only; evaluate the "
                         f"encoder by fine-tuning it ({self.finetune_hint})")

    def global_state(self) -> dict[str, torch.Tensor]:
        return detached(self.model.state_dict())

    def load_global(self, state: Mapping[str, Any], keep_local: Sequence[str] = ()) -> list[str]:
        return load_checked(self.model, state, self.global_name, keep_local)
