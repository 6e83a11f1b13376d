"""Client task-result filter: perturb the feature bank before it leaves the site (site privacy scope).

Configured by the *site* in ``local/privacy.json`` (scope ``perturbed_features``), not by the job, so a
hospital decides what its features look like outside.  A misconfigured filter (sigma <= 0) refuses to
build, which stops the job on that site rather than letting unperturbed features through.
"""

from __future__ import annotations

import numpy as np
from nvflare.apis.dxo import DXO, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

from fedssl.core.checks import require
from fedssl.core.privacy import perturb_features

BANK_KEY = "bank_features"


class FeatureBankPerturbation(Filter):
    def __init__(self, sigma: float = 0.05, seed: int = 0):
        super().__init__()
        name = type(self).__name__
        require(isinstance(sigma, (int, float)) and not isinstance(sigma, bool) and sigma > 0, name, "sigma", sigma,
                "use a noise standard deviation > 0 (e.g. 0.05); remove the filter from the scope to share raw features")
        require(isinstance(seed, int), name, "seed", seed, "use an integer")
        self.sigma = sigma
        self.seed = seed
        self._calls = 0

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        dxo = from_shareable(shareable)
        feats = dxo.get_meta_prop(BANK_KEY)
        if feats is None:
            return shareable  # nothing shared but the model (e.g. FedMoCo)
        rng = np.random.default_rng([self.seed, self._calls])
        self._calls += 1
        meta = dict(dxo.get_meta_props())
        meta[BANK_KEY] = perturb_features(feats, self.sigma, rng)
        self.log_info(fl_ctx, f"perturbed {meta[BANK_KEY].shape[0]} shared features (sigma {self.sigma})")
        return DXO(data_kind=dxo.data_kind, data=dxo.data, meta=meta).update_shareable(shareable)
