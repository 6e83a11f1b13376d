"""Partial model exclusion: parameters matching name patterns never leave the site / never reach it.

FedMAE's knowledge split (Wu et al., "Federated Self-Supervised Learning for Dermatological Disease Diagnosis", sec. IV)
keeps the encoder class token local during training and averages it once, at the end of the last round; FedBN keeps
every batch-norm tensor local for good. Both are this one filter, configured by fnmatch patterns, used on both sides:

- ``direction="upload"``: a client task-result filter.  Matching tensors are removed from the result
  before it leaves the site.  With ``average_at_end`` they are kept on the last round
  (current round == num_rounds - 1, read from the result headers the bundle's executors copy from the
  task), so the server averages them once.  A result whose round is unknown is treated as a training
  round: the tensors stay on the site (the filter never lets data through on a guess).
- ``direction="download"``: a server task-data filter.  Matching tensors are removed from the broadcast
  (every round), so a site keeps its own values; the server's global model still holds every key
  (MergingShareableGenerator) and FedAvgAggregator(exclude_patterns=...) accepts contributions without them.

The removed names are recorded in the DXO meta under ``excluded_keys``.
"""

from __future__ import annotations

from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.checks import require, require_choice
from fedssl.core.state_dict import match_keys
from fedssl.flare.constants import EXCLUDED_META


def is_last_round(shareable: Shareable) -> bool:
    current, total = shareable.get_header(AppConstants.CURRENT_ROUND), shareable.get_header(AppConstants.NUM_ROUNDS)
    return current is not None and total is not None and int(current) == int(total) - 1


class PartialModelExclusion(Filter):
    def __init__(self, patterns: list = (), direction: str = "upload", average_at_end: bool = True):
        """
        Args:
            patterns: parameter-name patterns (fnmatch), e.g. ``["encoder.cls_token"]`` (FedMAE-KS),
                ``["decoder.*"]`` (Table V: exclude the decoder), ``["*.running_mean", "*.running_var"]``.
            direction: "upload" (client task-result filter) or "download" (server task-data filter).
            average_at_end: upload only: send the excluded tensors on the last round so they are averaged
                once (FedMAE-KS); false keeps them local for good (FedBN).
        """
        super().__init__()
        name = type(self).__name__
        require(isinstance(patterns, (list, tuple)) and len(patterns) > 0
                and all(isinstance(p, str) and p.strip() for p in patterns), name, "patterns", patterns,
                'use a non-empty list of parameter-name patterns, e.g. ["encoder.cls_token"]; '
                "remove the filter to exchange every parameter")
        require_choice(name, "direction", direction, ("upload", "download"))
        require(isinstance(average_at_end, bool), name, "average_at_end", average_at_end, "use true or false")
        self.patterns = list(patterns)
        self.direction = direction
        self.average_at_end = average_at_end

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        dxo = from_shareable(shareable)
        if dxo.data_kind != DataKind.WEIGHTS or not dxo.data:
            return shareable  # metrics, tokenizer statistics ...: no model tensors to hold back
        if self.direction == "upload" and self.average_at_end and is_last_round(shareable):
            self.log_info(fl_ctx, f"last round: sending the locally kept tensors ({self.patterns}) for the final "
                                  "average")
            return shareable
        excluded = match_keys(dxo.data, self.patterns)
        if not excluded:
            raise ValueError(f"{type(self).__name__}: no parameter matches {self.patterns} in the {self.direction} "
                             f"payload (it has e.g. {sorted(dxo.data)[:5]}); fix the patterns so that the "
                             "excluded tensors are really held back")
        data = {k: v for k, v in dxo.data.items() if k not in set(excluded)}
        meta = dict(dxo.get_meta_props())
        meta[EXCLUDED_META] = excluded
        self.log_info(fl_ctx, f"{self.direction}: held back {len(excluded)} tensors matching {self.patterns}")
        return DXO(data_kind=dxo.data_kind, data=data, meta=meta).update_shareable(shareable)
