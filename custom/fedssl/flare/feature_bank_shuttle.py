"""Server task-data filter for FCL feature exchange (FCL (Wu et al., MedIA 2022) eq. (1)): each site gets the other
sites' banks.

Runs once per site as it pulls the train task.  The banks that the aggregator collected (meta
``collected``, keyed by site) are replaced, in a DXO built new for this site, by one shuffled remote
bank made of every *other* site's features and partition ids: never the site's own, no site names.
The broadcast DXO shared by all sites is never edited in place.

A receiving site must not be able to attribute a remote feature to its source: it receives rows that the others
shared this round and only those (the collector forwards each row once), as many as it shared itself, at most
``bank_size`` (``fedssl.core.memory_bank.remote_bank_for``), so sites that share alike learn neither the number of
sites nor how many rows the others shared, and nothing is padded.  Its order is a pure function of (the server's
secret, round, receiving site), so it cannot be undone by a site.  The secret is the server's own
(``fedssl.flare.party_folder``): drawn from the operating system on first use into the server's site config dir
(in the simulator ``$FEDSSL_SECRETS_DIR/<server name>/``) and read again on every later run, so a rerun in the same
workspace repeats the order exactly; never a seed of the job configuration, never sent anywhere.
"""

from __future__ import annotations

import zlib

import numpy as np
from nvflare.apis.dxo import DXO, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

from fedssl.core.checks import require_int
from fedssl.core.memory_bank import remote_bank_for
from fedssl.flare.constants import COLLECTED, REMOTE_FEATURES, REMOTE_PARTITIONS
from fedssl.flare.party_folder import flare_party_secret

#: the file name of the server's shuttle secret in its own folder
SECRET_NAME = "feature_bank_shuttle"


class FeatureBankShuttle(Filter):
    def __init__(self, bank_size: int = 4096):
        """bank_size: K, the sites' bank size (paper: 4096): no remote bank has more than K rows."""
        super().__init__()
        require_int(type(self).__name__, "bank_size", bank_size, 1, "use the sites' bank size K (paper: 4096)")
        self.bank_size = bank_size
        self._secret: int | None = None  # the server's alone, read at the first process (which has the context)

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
            if self._secret is None:
                self._secret = flare_party_secret(fl_ctx, SECRET_NAME, type(self).__name__)
            rng = np.random.default_rng([self._secret, round_idx, zlib.crc32(site.encode())])
            feats, parts = remote_bank_for(banks, site, self.bank_size, rng)
            meta[REMOTE_FEATURES], meta[REMOTE_PARTITIONS] = feats, parts
            others = len(banks) - (site in banks)
            self.log_info(fl_ctx, f"sending {site} {feats.shape[0]} remote features from {others} other sites")
        out = DXO(data_kind=dxo.data_kind, data=dxo.data, meta=meta)
        return out.update_shareable(shareable)
