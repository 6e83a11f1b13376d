"""Client task-result filter: perturb the feature bank before it leaves the site (site privacy scope).

Configured by the *site* in ``local/privacy.json`` (scope ``perturbed_features``), not by the job, so a
hospital decides what its features look like outside.  A misconfigured filter (sigma not a finite number in
``SIGMA_RANGE``) refuses to build, which stops the job on that site rather than letting unperturbed features
through.

The noise of round r is drawn from ``default_rng([secret, r])``: a pure function of this site's secret and the round
(header ``current_round``), so a rerun that keeps the secret repeats it exactly and a restarted site continues the
same sequence; a result without a round is refused, never sent.  The secret is the site's own
(``fedssl.flare.party_folder``): drawn from the operating system on first use into its site config dir
``<site workspace>/local`` (in the simulator ``$FEDSSL_SECRETS_DIR/<site name>/``), mode 0600, never in a job
configuration, never sent; whoever knew it (or a seed in its place) could subtract the noise.  What sigma
means (the README's "Threat model" has the measurement): each shared feature f (unit vector, D = 128) becomes
normalise(f + N(0, sigma^2 I)); the noise has norm about sigma * sqrt(D), so (measured, 2000 random unit
features) sigma = 0.05 keeps a mean cosine of 0.87 with f, sigma = 0.1 0.66, sigma = 0.3 0.28.  It hides a feature's
exact value (and so blunts matching a shared feature to a known image), not the statistics of a whole bank.
"""

from __future__ import annotations

import math

import numpy as np
from nvflare.apis.dxo import DXO, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.app_constant import AppConstants

from fedssl.core.checks import require
from fedssl.core.privacy import perturb_features
from fedssl.flare.constants import BANK_FEATURES
from fedssl.flare.party_folder import flare_party_secret

#: accepted noise standard deviations: below 0.01 the features pass almost unchanged (cosine > 0.99 at D = 128),
#: above 1 nothing of them is left (noise norm ~11x the feature's)
SIGMA_RANGE = (0.01, 1.0)
#: the file name of the site's noise secret in its own folder
SECRET_NAME = "feature_bank_perturbation"


class FeatureBankPerturbation(Filter):
    def __init__(self, sigma: float = 0.05):
        """sigma: per-coordinate standard deviation of the Gaussian noise, in [0.01, 1] (default 0.05)."""
        super().__init__()
        lo, hi = SIGMA_RANGE
        require(isinstance(sigma, (int, float)) and not isinstance(sigma, bool) and math.isfinite(sigma)
                and lo <= sigma <= hi,
                type(self).__name__, "sigma", sigma, f"use a noise standard deviation in [{lo}, {hi}] (e.g. 0.05); "
                "remove the filter from the site's privacy scope to share unperturbed features")
        self.sigma = sigma
        self._secret: int | None = None  # this site's alone, read at the first process (which has the context)

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        dxo = from_shareable(shareable)
        feats = dxo.get_meta_prop(BANK_FEATURES)
        if feats is None:
            return shareable  # nothing shared but the model (e.g. FedMoCo)
        round_idx = _round_of(shareable, fl_ctx)
        if self._secret is None:
            self._secret = flare_party_secret(fl_ctx, SECRET_NAME, type(self).__name__)
        meta = dict(dxo.get_meta_props())
        meta[BANK_FEATURES] = perturb_features(feats, self.sigma, np.random.default_rng([self._secret, round_idx]))
        self.log_info(fl_ctx, f"perturbed {meta[BANK_FEATURES].shape[0]} shared features (sigma {self.sigma}, "
                              f"round {round_idx})")
        return DXO(data_kind=dxo.data_kind, data=dxo.data, meta=meta).update_shareable(shareable)


def _round_of(shareable: Shareable, fl_ctx: FLContext) -> int:
    """The round of the result (its header, which the site executor copies from the task), else of the task data."""
    task = fl_ctx.get_prop(FLContextKey.TASK_DATA)
    for source in (shareable, task):
        r = source.get_header(AppConstants.CURRENT_ROUND) if isinstance(source, Shareable) else None
        if isinstance(r, (int, np.integer)) and not isinstance(r, bool) and r >= 0:
            return int(r)
    raise RuntimeError("FeatureBankPerturbation: the result carries no round (header current_round), so its noise "
                       "would repeat across rounds; the features are not sent")
