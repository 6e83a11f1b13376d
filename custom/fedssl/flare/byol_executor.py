"""Client executor for FedBYOL / FCLOpt / FCLOpt-PTNU / FCLOpt-PTNU-DP (FCL (Wu et al., MedIA 2022) section 4).

The math is :class:`fedssl.train.byol.BYOLLocalTrainer`, the round protocol
:class:`fedssl.flare.trainer_executor.TrainerExecutor`.  The server's task says which mode runs (meta
``byol_mode``).  Per round:
- ``report_distance`` (DP only): keep the downloaded global online network, reply d_pc (eq. 12);
- ``train``: load the global online network + predictor; get the target network from the download
  (FCLOpt), keep the local one (FedBYOL), or predict it from the local one with PTNU (Algorithm 2,
  distance d from the server); train one local BYOL epoch; upload what the mode uploads.

Every train result carries, under the ``summary_record`` meta, ``feature_std``: the round's mean spread of the
online projections (0 = collapse; :mod:`fedssl.core.spread`), which the run summary averages over the sites per
round (``site_record_means``).
"""

from __future__ import annotations

from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal

from fedssl.core.checks import takes_settings
from fedssl.core.ptnu import uploads_target
from fedssl.core.trainer import RoundStats
from fedssl.data.acdc import load_site
from fedssl.flare.constants import (DISTANCE_KEY, DISTANCE_TASK, MODE_KEY, MODES, PROXY_KEY, SITE_RECORD_META,
                                    UPLOAD_TARGET_KEY)
from fedssl.flare.site_executor import pick_device
from fedssl.flare.trainer_executor import TrainerExecutor
from fedssl.train.byol import BYOLLocalTrainer, BYOLSettings


class BYOLExecutor(TrainerExecutor):
    task_handlers = {"train": "train", DISTANCE_TASK: "report_distance"}
    checkpoint_name = "byol_client_state.pt"
    metrics_name = "byol_metrics.jsonl"

    @takes_settings(BYOLSettings)
    def __init__(self, **args):
        """The arguments are the fields of :class:`fedssl.train.byol.BYOLSettings` (paper settings as defaults, FCL
        (Wu et al., MedIA 2022) section 5, documented there), each stored verbatim and checked at once; an unknown
        name is refused."""
        super().__init__()
        self.configure(BYOLSettings, args)
        self.global_online: dict | None = None  # DP: kept from report_distance for this round's train
        self.mode: str | None = None  # this round's mode and PTNU iterations (None: no PTNU)
        self.ptnu_iterations: int | None = None

    def build_trainer(self, fl_ctx: FLContext, num_rounds: int) -> BYOLLocalTrainer:
        site = self.site_name(fl_ctx)
        volumes = load_site(self.resolve_root(self.data_root, fl_ctx), with_labels=False, site=site,
                            target_spacing=self.target_spacing, image_size=self.image_size, frames=self.frames)
        trainer = BYOLLocalTrainer(volumes, self.settings, num_rounds=num_rounds, site=site,
                                   device=pick_device(self.device))
        self.log_info(fl_ctx, f"{site}: {len(volumes)} unlabelled volumes, data seed {trainer.data_seed}, "
                              f"device {trainer.device}")
        return trainer

    # ------------------------------------------------------------------ tasks
    def report_distance(self, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        trainer = self.ensure_trainer(shareable, fl_ctx)
        self.global_online = dict(from_shareable(shareable).data)
        d_pc = trainer.proxy_distance(self.global_online)
        return DXO(data_kind=DataKind.METRICS, data={PROXY_KEY: d_pc}, meta={PROXY_KEY: d_pc}).to_shareable()

    def receive(self, dxo: DXO, fl_ctx: FLContext, round_idx: int) -> dict:
        """The download, applied the way the round's mode says (DP: the online network of ``report_distance``)."""
        site, mode = self.site_name(fl_ctx), dxo.get_meta_prop(MODE_KEY)
        if mode not in MODES:
            raise ValueError(f"{site}: task has byol_mode={mode!r}; the server must run FCLOptController")
        if mode == "ptnu_dp":
            if self.global_online is None:
                raise ValueError(f"{site}: train task without a preceding report_distance task in this round (DP)")
            weights, self.global_online = self.global_online, None
        else:
            weights = dxo.data or {}
        distance = dxo.get_meta_prop(DISTANCE_KEY)
        self.mode = mode
        self.ptnu_iterations = self.trainer.apply_global(mode, weights, None if distance is None else float(distance))
        return {"mode": mode, "ptnu_iterations": self.ptnu_iterations}

    def result_state(self, stats: RoundStats, dxo: DXO) -> dict:
        return self.trainer.global_state(with_target=uploads_target(self.mode, dxo.get_meta_prop(UPLOAD_TARGET_KEY)))

    def result_meta(self, stats: RoundStats, dxo: DXO, fl_ctx: FLContext) -> dict:
        """The summary record: the round's feature spread (a bounded number, no feature)."""
        return {SITE_RECORD_META: {"feature_std": stats.metrics["feature_std"]}}

    def describe_round(self, stats: RoundStats) -> str:
        n = self.ptnu_iterations
        return (f"loss {stats.loss:.4f} ({self.mode}" + (f", PTNU {n} iterations" if n is not None else "")
                + f", feature spread {stats.metrics['feature_std']:.3f})")
