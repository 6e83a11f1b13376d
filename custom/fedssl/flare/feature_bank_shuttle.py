"""Server task-data filter for FCL feature exchange (FCL (Wu et al., MedIA 2022) eq. (1)): each site gets the other sites' banks.

Runs once per site as it pulls the train task.  The banks that the aggregator collected (meta
``collected``, keyed by site) are replaced, in a DXO built new for this site, by one shuffled remote
bank made of every *other* site's features and partition ids: never the site's own, no site names.
The broadcast DXO shared by all sites is never edited in place.
"""

from __future__ import annotations

import zlib

import numpy as np
from nvflare.apis.dxo import DXO, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

from fedssl.core.checks import require
from fedssl.core.memory_bank import remote_bank_for
from fedssl.flare.constants import REMOTE_FEATURES, REMOTE_PARTITIONS
from fedssl.flare.fedavg_aggregator import COLLECTED


class FeatureBankShuttle(Filter):
    def __init__(self, seed: int = 0):
        super().__init__()
        require(isinstance(seed, int), type(self).__name__, "seed", seed, "use an integer")
        self.seed = seed

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        peer = fl_ctx.get_peer_context()
        site = peer.get_identity_name() if peer else None
        if not site:
            raise RuntimeError("FeatureBankShuttle must run as a server task-data filter (no receiving site known)")
        dxo = from_shareable(shareable)
        meta = {k: v for k, v in dxo.get_meta_props().items() if k != COLLECTED}  # new meta, never the shared one
        collected = dxo.get_meta_prop(COLLECTED) or {}
        banks = {s: (np.asarray(b["bank_features"]), np.asarray(b["bank_partitions"])) for s, b in collected.items()}
        if banks:
            round_idx = int(shareable.get_header("current_round", 0) or 0)
            rng = np.random.default_rng([self.seed, round_idx, zlib.crc32(site.encode())])
            feats, parts = remote_bank_for(banks, site, rng)
            meta[REMOTE_FEATURES], meta[REMOTE_PARTITIONS] = feats, parts
            self.log_info(fl_ctx, f"sending {site} a remote bank of {feats.shape[0]} features from {len(banks) - (site in banks)} other sites")
        out = DXO(data_kind=dxo.data_kind, data=dxo.data, meta=meta)
        return out.update_shareable(shareable)
