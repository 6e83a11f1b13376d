"""Server task-data filter: each site receives the global model with the head cut to its own classes.

Surgical aggregation (surgical aggregation (Kulkarni et al., ML4H 2024), sec. 2.1.2, last paragraph): the aggregated
global head covers every class of the network, but site ``k`` receives only the rows of its classes ``C_k``, in its own
declared order (``fedssl.core.surgical.slice_head``).  FLARE runs this filter once per site as the site pulls its task
(site name from the peer context); all sites of a round share one DXO underneath, so the filter builds a
new DXO (new data dict, new meta, fresh head arrays) for every site and never edits the shared one.

By method (``ClassRegistry.method``): surgical -> head sliced (``full_head``: whole head, for the final test); vanilla /
partial_loss -> the whole head over C, with the network's class order in meta ``global_classes``; personalised -> no
head (it stays on the site); individual -> the initial model in round 0 (a common start), no weights afterwards.  Every
site also receives the switches (meta ``method``, ``backbone``) and its registered classes (meta ``classes``), so it can
check that its configuration has not changed.  Put CommunicationMeter after this filter to count what each site really
downloads.
"""

from __future__ import annotations

from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.checks import require
from fedssl.core.surgical import classes_to_meta, is_head_key, slice_head
from fedssl.flare.constants import BACKBONE_KEY, CLASSES_KEY, GLOBAL_CLASSES_KEY, METHOD_KEY
from fedssl.flare.surgical_registration import get_registry


class HeadSlicer(Filter):
    def __init__(self, head: str = "classifier", full_head: bool = False):
        """
        Args:
            head: module name of the class layer (``<head>.weight [C, F]``, ``<head>.bias [C]``).
            full_head: send the whole global head with ``global_classes`` even under surgical (the "test"
                task: the final global model is the federation's product, evaluated on all classes of an
                external test set); false for "train".
        """
        super().__init__()
        name = type(self).__name__
        require(isinstance(head, str) and bool(head.strip()), name, "head", head,
                'use the module name of the class layer, e.g. "classifier"')
        require(isinstance(full_head, bool), name, "full_head", full_head, "use true (test task) or false (train task)")
        self.head = head
        self.full_head = full_head

    def tailor(self, data: dict, meta: dict, site: str, reg, round_idx=None) -> tuple[dict, dict]:
        """(new data, new meta) for ``site``; ``data``/``meta`` are the shared ones and are not modified."""
        classes = reg.classes_of(site)
        wk, bk = f"{self.head}.weight", f"{self.head}.bias"
        backbone = {k: v for k, v in data.items() if not is_head_key(k, self.head)}
        new_meta = dict(meta)
        new_meta.update({METHOD_KEY: reg.method, BACKBONE_KEY: reg.backbone, CLASSES_KEY: classes_to_meta(classes)})
        if reg.method == "individual":  # the common initial model once (round 0), nothing afterwards
            return (backbone if round_idx == 0 else {}), new_meta
        if reg.method == "personalised":
            return backbone, new_meta
        if wk not in data or bk not in data:
            raise ValueError(f"{type(self).__name__}: the global model has no head {wk!r}/{bk!r} "
                             f"(keys e.g. {sorted(data)[:4]}); set the filter's head argument")
        if reg.method == "surgical" and not self.full_head:
            backbone[wk], backbone[bk] = slice_head(data[wk], data[bk], list(reg.global_classes), classes, site)
        else:  # vanilla, partial_loss (and the final test model): one head over the network's classes
            backbone[wk], backbone[bk] = data[wk], data[bk]
            new_meta[GLOBAL_CLASSES_KEY] = classes_to_meta(reg.global_classes)
        return backbone, new_meta

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        dxo = from_shareable(shareable)
        if dxo.data_kind != DataKind.WEIGHTS:
            return shareable
        peer = fl_ctx.get_peer_context()
        site = peer.get_identity_name() if peer else None
        if not site:
            raise ValueError(f"{type(self).__name__}: no peer site in the FL context; use it as a server task-data "
                             "filter")
        reg = get_registry(fl_ctx, type(self).__name__)
        data, meta = self.tailor(dxo.data or {}, dxo.get_meta_props(), site, reg,
                                 shareable.get_header(AppConstants.CURRENT_ROUND))
        return DXO(data_kind=DataKind.WEIGHTS, data=data, meta=meta).update_shareable(shareable)
