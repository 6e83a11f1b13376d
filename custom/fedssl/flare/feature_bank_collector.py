"""Server component for FCL feature exchange (FCL (Wu et al., MedIA 2022) eq. (1)): collects each site's feature bank.

The aggregator calls it through its generic ``collectors`` hook (``FedAvgAggregator(collectors=["bank_collector"])``)
for every contribution that passed the aggregator's own checks: the site's ``bank_features`` / ``bank_partitions``
result meta is validated (float ``[K, D]``, finite; int ``[K]``) and handed back; the aggregator passes the
banks on, per site, under ``collected`` in the aggregate's meta, where the :class:`FeatureBankShuttle` task-data
filter turns them into each site's shuffled remote bank (the other sites' features, no site names).

A site that sends no bank while the bank is collected is rejected for the round, naming both switches:
FedMoCo is ``feature_exchange=false`` on the sites and ``collectors=[]`` on the aggregator.

A collector (the hook's contract): a server component with ``collect(site, dxo) -> dict`` that returns the
site's meta items to pass on, or raises ``ValueError`` (e.g. ``ContributionError``) to reject the contribution.
"""

from __future__ import annotations

from nvflare.apis.dxo import DXO
from nvflare.apis.fl_component import FLComponent

from fedssl.core.memory_bank import check_bank
from fedssl.core.state_dict import ContributionError
from fedssl.flare.constants import BANK_FEATURES, BANK_PARTITIONS


class FeatureBankCollector(FLComponent):
    def collect(self, site: str, dxo: DXO) -> dict:
        """The site's validated bank ``{bank_features: float32 [K, D], bank_partitions: int64 [K]}``."""
        features = dxo.get_meta_prop(BANK_FEATURES)
        if features is None:
            raise ContributionError(
                f"{site} sent no feature bank but the server collects banks (FeatureBankCollector in the aggregator's "
                "collectors); run every site with feature_exchange=true, or for FedMoCo set feature_exchange=false "
                "on the sites and collectors=[] on the aggregator")
        f, p = check_bank(features, dxo.get_meta_prop(BANK_PARTITIONS), site)
        return {BANK_FEATURES: f, BANK_PARTITIONS: p}
