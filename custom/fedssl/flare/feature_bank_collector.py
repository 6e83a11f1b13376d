"""Server component for FCL feature exchange (FCL (Wu et al., MedIA 2022) eq. (1)): collects each site's feature bank.

The aggregator calls it through its generic ``collectors`` hook (``FedAvgAggregator(collectors=["bank_collector"])``)
for every contribution that passed the aggregator's own checks: the site's ``bank_features`` / ``bank_partitions``
result meta is validated (``fedssl.core.memory_bank.check_bank``: cast to float32 / int64, width D = ``proj_dim``,
at most ``bank_size`` rows, finite, unit-norm rows, partition ids in range, not degenerate), reduced to the filled
rows the site has not shared before (``fedssl.core.memory_bank.FreshRows``: a row is forwarded once, so no receiver
can link it across rounds) and handed back; a bad bank rejects
the site's contribution for the round (logged, never forwarded, the round goes on for the others); the aggregator passes
the banks on, per site, under ``collected`` in the aggregate's meta, where the :class:`FeatureBankShuttle` task-data
filter turns them into each site's shuffled remote bank (the other sites' features, no site names).

A site that sends no bank while the bank is collected is rejected for the round, naming both switches:
FedMoCo is ``feature_exchange=false`` on the sites and ``collectors=[]`` on the aggregator.

A collector (the hook's contract): a server component with ``collect(site, dxo) -> dict`` that returns the
site's meta items to pass on, or raises ``ValueError`` (e.g. ``ContributionError``) to reject the contribution.
"""

from __future__ import annotations

from nvflare.apis.dxo import DXO
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_context import FLContext

from fedssl.core.checks import require_int
from fedssl.core.memory_bank import FreshRows, check_bank
from fedssl.core.untrusted import ContributionError
from fedssl.flare.constants import BANK_FEATURES, BANK_PARTITIONS


class FeatureBankCollector(FLComponent):
    def __init__(self, bank_size: int = 4096, proj_dim: int = 128, n_partitions: int = 4):
        """
        Args:
            bank_size: K, the sites' bank size (paper: 4096): the most rows a site's bank may have.
            proj_dim: D, the projection width (paper: 128): the width of every feature.
            n_partitions: S, the partitions per volume (paper: 4): partition ids lie in [0, S) (-1: unfilled).
        """
        super().__init__()
        name = type(self).__name__
        require_int(name, "bank_size", bank_size, 1, "use the sites' bank size K (paper: 4096)")
        require_int(name, "proj_dim", proj_dim, 1, "use the projection width D of the sites' model (paper: 128)")
        require_int(name, "n_partitions", n_partitions, 1, "use the sites' number of partitions per volume (paper: 4)")
        self.bank_size, self.proj_dim, self.n_partitions = bank_size, proj_dim, n_partitions
        #: digests of the rows each site shared: its last 4 banks' worth, in memory only
        self.fresh_rows = FreshRows(history=4 * bank_size)

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.START_RUN:
            self.fresh_rows.reset()

    def collect(self, site: str, dxo: DXO) -> dict:
        """The site's validated new rows ``{bank_features: float32 [n, D], bank_partitions: int64 [n]}``, n <= K."""
        features = dxo.get_meta_prop(BANK_FEATURES)
        if features is None:
            raise ContributionError(
                f"{site} sent no feature bank but the server collects banks (FeatureBankCollector in the aggregator's "
                "collectors); run every site with feature_exchange=true, or for FedMoCo set feature_exchange=false "
                "on the sites and collectors=[] on the aggregator")
        f, p = check_bank(features, dxo.get_meta_prop(BANK_PARTITIONS), site, dim=self.proj_dim,
                          max_rows=self.bank_size, n_partitions=self.n_partitions)
        f, p = self.fresh_rows.keep(site, f, p)
        return {BANK_FEATURES: f, BANK_PARTITIONS: p}
