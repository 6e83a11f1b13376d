"""Batch-norm exclusion that follows the run's backbone strategy (surgical aggregation (Kulkarni et al., ML4H 2024):
FedAvg / FedBN / FedBN+).

:class:`BackboneBNExclusion` is :class:`~fedssl.flare.partial_exclusion.PartialModelExclusion` over the
batch-norm tensors, switched by the backbone strategy of the run instead of by the job's filter list, so
``server.class_registration.backbone=fedavg|fedbn|fedbn_plus`` alone decides what is exchanged:

- "fedavg": every tensor passes (batch-norm is averaged with the rest of the backbone);
- "fedbn" / "fedbn_plus": the batch-norm tensors never leave a site, and reach a site once: the round-0
  broadcast carries the whole initial model, batch-norm included, so every site starts from the server's
  (pre-trained, e.g. ImageNet) statistics; later broadcasts hold batch-norm back (kept local for good).
  FedBN+ (Kulkarni et al. 2023; surgical aggregation sec. 2.5: "FedBN+, a modification of FedBN with pre-trained
  batch normalization statistics") then freezes batch-norm at exactly those received statistics.  Without the
  round-0 delivery a site would freeze its own default statistics (mean 0, var 1) under the server's
  convolutions.  The round comes from the task header ``AppConstants.CURRENT_ROUND`` that ScatterAndGather sets;
  a task without it (the final test task) keeps batch-norm back.

Where the strategy comes from:

- ``direction="download"`` (server task-data filter): the run's
  :class:`~fedssl.flare.surgical_registration.ClassRegistry` (ClassRegistration's ``backbone``).  The filter
  announces it in the task header :data:`BACKBONE_HEADER`.
- ``direction="upload"`` (client task-result filter): the result header :data:`BACKBONE_HEADER`, which
  :class:`~fedssl.flare.multilabel_executor.MultiLabelExecutor` sets from the strategy the server sent it.

A missing or unknown strategy raises (the filter never lets tensors through on a guess).  An error reply
(return code not OK) passes untouched: it carries no model.
"""

from __future__ import annotations

from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.app_constant import AppConstants

from fedssl.flare.constants import BACKBONE_HEADER, BACKBONES
from fedssl.flare.partial_exclusion import PartialModelExclusion
from fedssl.flare.surgical_registration import get_registry

# the bundle's DenseNets: norm0, denseblock*.denselayer*.norm1/norm2, transition*.norm
# (fedssl.models.densenet.is_bn_key)
BN_PATTERNS = ("*.norm*.weight", "*.norm*.bias", "*.norm*.running_mean", "*.norm*.running_var",
               "*.norm*.num_batches_tracked")


class BackboneBNExclusion(PartialModelExclusion):
    def __init__(self, direction: str = "upload", patterns: list = BN_PATTERNS):
        """
        Args:
            direction: "upload" (client task-result filter) or "download" (server task-data filter).
            patterns: the batch-norm parameter-name patterns (fnmatch); the default fits the bundle's DenseNets.
        """
        super().__init__(patterns=list(patterns), direction=direction, average_at_end=False)

    def strategy(self, shareable: Shareable, fl_ctx: FLContext) -> str:
        name = type(self).__name__
        if self.direction == "download":
            value = get_registry(fl_ctx, name).backbone
            where = "the server's class registry (ClassRegistration.backbone)"
        else:
            value = shareable.get_header(BACKBONE_HEADER)
            where = f"the result header {BACKBONE_HEADER!r} (set by MultiLabelExecutor from the server's task)"
        if value not in BACKBONES:
            raise ValueError(f"{name} ({self.direction}): backbone strategy {value!r} from {where} is not one of "
                             f"{list(BACKBONES)}; refusing to guess which tensors may leave")
        return value

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        rc = shareable.get_return_code()
        if rc and rc != ReturnCode.OK:
            return shareable  # an error reply carries no model
        strategy = self.strategy(shareable, fl_ctx)
        if self.direction == "download":
            shareable.set_header(BACKBONE_HEADER, strategy)  # announce it to the site
        if strategy == "fedavg":
            return shareable  # batch-norm is averaged with the rest of the backbone
        if self.direction == "download" and is_first_round(shareable):
            self.log_info(fl_ctx, f"round 0 ({strategy}): sending the initial batch-norm tensors once, so that every "
                                  "site starts from the server's (pre-trained) statistics")
            return shareable
        return super().process(shareable, fl_ctx)


def is_first_round(shareable: Shareable) -> bool:
    """Whether the task is round 0 of training (header ``CURRENT_ROUND`` == 0); a task without the header is not."""
    current = shareable.get_header(AppConstants.CURRENT_ROUND)
    return current is not None and int(current) == 0
