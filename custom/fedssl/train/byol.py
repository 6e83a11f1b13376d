"""FedBYOL / FCLOpt / FCLOpt-PTNU / FCLOpt-PTNU-DP on one site (FCL (Wu et al., MedIA 2022) section 4) as a LocalTrainer.

:class:`BYOLLocalTrainer` holds :class:`fedssl.core.byol.BYOLTrainer` (online network + predictor, target
network, optimiser, generator) and the site's :class:`fedssl.data.acdc.PartitionSampleDataset` (slices sampled
one per partition of each volume, as in FCL).  One round = one local BYOL epoch.

What the site does with the download depends on the mode (:meth:`BYOLLocalTrainer.apply_global`):

- ``fclopt``: load the global online network, predictor and target network;
- ``fedbyol``: load the global online network and predictor, keep the local target network;
- ``ptnu`` / ``ptnu_dp``: load the global online network and predictor, then predict the target network from
  the local one with PTNU (Algorithm 2) to the distance the server sent.

Before its first round a site's "local target" is a copy of the global online network.  DP's
``report_distance`` is :meth:`BYOLLocalTrainer.proxy_distance` (eq. 12).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fedssl.core.byol import FCLOPT_LR, BYOLConfig, BYOLTrainer
from fedssl.core.ptnu import ONLINE, TARGET, predict_target, proxy_distance
from fedssl.core.seeds import site_seed
from fedssl.core.trainer import RoundStats, check_stop, detached, load_checked
from fedssl.data.acdc import PartitionSampleDataset
from fedssl.data.loading import check_workers, loader_options
from fedssl.data.transforms import augment_views
from fedssl.data.volume import Volume
from fedssl.models.unet import PAPER_FEATURES, BYOLUNetEncoder

#: the modes of :meth:`BYOLLocalTrainer.apply_global` (the FCLOptController's ``mode``)
BYOL_MODES = ("fedbyol", "fclopt", "ptnu", "ptnu_dp")


def _numpy(state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}


class BYOLLocalTrainer:
    """One site's BYOL pre-training (a ``LocalTrainer``); paper settings as defaults (FCL (Wu et al., MedIA 2022)
    section 5: lr 0.5 cosine (FCLOpt; FedBYOL runs at 0.05), eq. 6 one-directional, m 0.99, m_d 0.995, batch 32
    images).

    Randomness: the model's initial weights come from the job ``seed`` (every site builds the same network);
    everything drawn from the data (the slices sampled per partition, the batch order, the augmentations) from
    :attr:`data_seed` = ``fedssl.core.seeds.site_seed(seed, site)``, so sites draw independently and a site's
    run is reproducible from (seed, site name); each round runs in the owned global RNG of (data seed, round)
    (:meth:`fedssl.core.byol.BYOLTrainer.train_round`).  ``state_dict`` = the BYOLTrainer's (model, optimiser,
    generator, config); a trainer restored from one has a local target network (:attr:`has_local_target`).
    """

    def __init__(self, volumes: Sequence[Volume], *, num_rounds: int, n_partitions: int = 4,
                 features: Sequence[int] = PAPER_FEATURES, proj_dim: int = 128, pred_hidden: int = 512,
                 batch_size: int = 32, lr: float = FCLOPT_LR, momentum: float = 0.99, m_d: float = 0.995,
                 symmetric: bool = False, max_ptnu_iterations: int = 100_000, max_steps_per_round: int = 0,
                 seed: int = 0, site: str = "", device: str | torch.device = "cpu", amp: bool = False,
                 workers: int = 0):
        self.workers = check_workers(workers, type(self).__name__)
        #: the seed of every data-side draw at this site (partition sampling, batch order, augmentations)
        self.data_seed = site_seed(seed, site)
        self.dataset = PartitionSampleDataset(list(volumes), n_partitions, seed=self.data_seed)
        model = BYOLUNetEncoder(features, proj_dim, pred_hidden, seed=seed)
        cfg = BYOLConfig(lr=lr, momentum=momentum, num_rounds=num_rounds, symmetric=symmetric)
        self.trainer = BYOLTrainer(model, cfg, augment_views, device=device, seed=self.data_seed, amp=amp)
        self.volumes_per_batch = max(1, batch_size // n_partitions)
        self.max_steps_per_round = int(max_steps_per_round)
        self.m_d, self.max_ptnu_iterations = float(m_d), int(max_ptnu_iterations)
        #: True once the site has a target network of its own (after its first round, or restored)
        self.has_local_target = False

    @property
    def model(self) -> BYOLUNetEncoder:
        return self.trainer.model

    @property
    def device(self) -> torch.device:
        return self.trainer.device

    # ------------------------------------------------------------------ target handling
    def local_target(self) -> dict[str, np.ndarray]:
        """This site's last target network (``target.*``); before its first round: a copy of its online network.
        Copies (no alias of the live parameters), so it stays what it was when the model changes."""
        state = self.model.state_dict()
        if self.has_local_target:
            return _numpy({k: v for k, v in state.items() if k.startswith(TARGET)})
        return _numpy({TARGET + k[len(ONLINE):]: v for k, v in state.items() if k.startswith(ONLINE)})

    def load_partial(self, state: Mapping[str, Any], source: str = "the global model") -> None:
        """Load the tensors ``state`` has (any subset of the model's keys; the others stay as they are)."""
        load_checked(self.model, state, source, keep_local=True)

    def predict_target(self, local_target: Mapping[str, np.ndarray], online: Mapping[str, Any], distance: float) -> int:
        """PTNU (Algorithm 2): load the target predicted from ``local_target`` towards the global ``online``
        network (``online.*`` keys) to ``distance``; returns the number of iterations."""
        online = {k: v for k, v in online.items() if k.startswith(ONLINE)}
        predicted, iterations = predict_target(local_target, online, float(distance), self.m_d, self.max_ptnu_iterations)
        self.load_partial(predicted, "the PTNU-predicted target network")
        return iterations

    def apply_global(self, mode: str, weights: Mapping[str, Any], distance: float | None = None) -> int | None:
        """Apply the round's download the way ``mode`` does (module docstring); returns the PTNU iterations
        (None for fclopt / fedbyol).  ``distance``: the server's target distance (ptnu / ptnu_dp)."""
        if mode not in BYOL_MODES:
            raise ValueError(f"mode={mode!r}: use one of {list(BYOL_MODES)}")
        if mode in ("ptnu", "ptnu_dp") and distance is None:
            raise ValueError(f"mode {mode} needs the server's target distance; the server must run FCLOptController")
        local_target = self.local_target() if self.has_local_target else None
        self.load_partial(weights)  # online + predictor (+ target for fclopt)
        if local_target is None:  # first round: the local target starts as the global online network
            local_target = self.local_target()
        iterations = None
        if mode in ("ptnu", "ptnu_dp"):
            iterations = self.predict_target(local_target, weights, distance)
        elif mode == "fedbyol" or (mode == "fclopt" and not any(k.startswith(TARGET) for k in weights)):
            self.load_partial(local_target, "this site's target network")
        self.has_local_target = True
        return iterations

    def proxy_distance(self, global_online: Mapping[str, Any]) -> float:
        """DP (eq. 12): d_pc = d(global online network, this site's target network).  Before its first round
        the site loads the global online network and starts its target network as a copy of it."""
        if not self.has_local_target:
            self.load_partial(global_online)
            self.model.target.load_state_dict(self.model.online.state_dict())
            self.has_local_target = True
        return proxy_distance(dict(global_online), self.local_target())

    # ------------------------------------------------------------------ LocalTrainer
    def train_round(self, round_idx: int, should_stop: Callable[[], bool] | None = None) -> RoundStats:
        """One local BYOL epoch; ``should_stop`` is checked before the round and after every optimiser step."""
        check_stop(should_stop)
        v, cap = self.volumes_per_batch, self.max_steps_per_round
        steps = self.dataset.n_batches(v, cap)
        images = (x.flatten(0, 1) for x, _ in self.dataset.batches(v, round_idx, cap,
                                                                   **loader_options(self.workers, self.device)))  # [V*S, 1, H, W]
        optimizer, curve = self.trainer.optimizer, []

        def progress(step: int, loss: float) -> None:
            curve.append({"loss": loss, "lr": float(optimizer.param_groups[0]["lr"])})
            check_stop(should_stop)

        out = self.trainer.train_round(images, steps, round_idx, progress)
        return RoundStats(loss=out["loss"], steps=out["steps"], samples=len(self.dataset),
                          metrics={"lr": out["lr_end"], "lr_end": out["lr_end"], "feature_std": out["feature_std"]},
                          curve=curve)

    def evaluate(self, split: str = "val") -> dict[str, Any]:
        raise ValueError(f"split={split!r}: BYOL pre-training reads unlabelled images only; evaluate the encoder by "
                         "fine-tuning it (fedssl.experiments.fcl_finetune)")

    def state_dict(self) -> dict:
        return self.trainer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.trainer.load_state_dict(dict(state))
        self.has_local_target = True

    def global_state(self, with_target: bool = True) -> dict[str, torch.Tensor]:
        """The whole model (online, predictor, target); without ``target.*`` when ``with_target`` is False."""
        state = self.model.state_dict()
        return detached(state, [k for k in state if with_target or not k.startswith(TARGET)])

    def load_global(self, state: Mapping[str, Any], keep_local: Sequence[str] = ()) -> list[str]:
        return load_checked(self.model, state, "the global BYOL model", keep_local)
