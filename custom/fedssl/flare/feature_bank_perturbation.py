"""Client task-result filter: perturb the feature bank before it leaves the site (site privacy scope).

Configured by the *site* in ``local/privacy.json`` (scope ``perturbed_features``), not by the job, so a
hospital decides what its features look like outside.  A misconfigured filter (sigma not a finite number in
``SIGMA_RANGE``) refuses to build, which stops the job on that site rather than letting unperturbed features
through.

The noise is drawn from a secret of this site (``secrets``, the operating system's entropy), never from a seed
that a job configuration or another party knows: whoever knew the seed could subtract the noise.  What sigma
means (the README's "Threat model" has the measurement): each shared feature f (unit vector, D = 128) becomes
normalise(f + N(0, sigma^2 I)); the noise has norm about sigma * sqrt(D), so (measured, 2000 random unit
features) sigma = 0.05 keeps a mean cosine of 0.87 with f, sigma = 0.1 0.66, sigma = 0.3 0.28.  It hides a feature's exact
value (and so blunts matching a shared feature to a known image), not the statistics of a whole bank.
"""

from __future__ import annotations

import math
import secrets

import numpy as np
from nvflare.apis.dxo import DXO, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable

from fedssl.core.checks import require
from fedssl.core.privacy import perturb_features

from fedssl.flare.constants import BANK_FEATURES

#: accepted noise standard deviations: below 0.01 the features pass almost unchanged (cosine > 0.99 at D = 128),
#: above 1 nothing of them is left (noise norm ~11x the feature's)
SIGMA_RANGE = (0.01, 1.0)


class FeatureBankPerturbation(Filter):
    def __init__(self, sigma: float = 0.05):
        """sigma: per-coordinate standard deviation of the Gaussian noise, in [0.01, 1] (default 0.05)."""
        super().__init__()
        lo, hi = SIGMA_RANGE
        require(isinstance(sigma, (int, float)) and not isinstance(sigma, bool) and math.isfinite(sigma) and lo <= sigma <= hi,
                type(self).__name__, "sigma", sigma, f"use a noise standard deviation in [{lo}, {hi}] (e.g. 0.05); "
                "remove the filter from the site's privacy scope to share unperturbed features")
        self.sigma = sigma
        self._rng = np.random.default_rng(secrets.randbits(128))  # this site's secret: no seed anyone else knows

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        dxo = from_shareable(shareable)
        feats = dxo.get_meta_prop(BANK_FEATURES)
        if feats is None:
            return shareable  # nothing shared but the model (e.g. FedMoCo)
        meta = dict(dxo.get_meta_props())
        meta[BANK_FEATURES] = perturb_features(feats, self.sigma, self._rng)
        self.log_info(fl_ctx, f"perturbed {meta[BANK_FEATURES].shape[0]} shared features (sigma {self.sigma})")
        return DXO(data_kind=dxo.data_kind, data=dxo.data, meta=meta).update_shareable(shareable)
