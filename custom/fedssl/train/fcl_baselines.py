"""FedRotation and FedSimCLR pre-training on one ACDC site: the baselines of FCL (Wu et al., MedIA 2022) Tables 1-3
that pre-train FCL's U-Net encoder with another self-supervised objective and FedAvg.

FCL sec. 5 "Baselines": "*Rotation* (Gidaris et al., 2018) is a self-supervised pre-training approach by predicting
the image rotations.  *SimCLR* (Chen et al., 2020a) [...] We combine these [...] self-supervised approaches with
*FedAvg* (McMahan et al., 2017) as their federated variants *FedRotation*, *FedSimCLR* [...] for pre-training the
encoder."  The paper gives no other setting for them: they run with the job's (sec. 5 "Training details": 200
rounds of 1 local epoch, batch 32, SGD lr 0.05 cosine, momentum 0.9, weight decay 1e-4, temperature 0.1 "for
contrastive loss"), on the same unlabelled slices as FCL (:class:`fedssl.data.acdc.PartitionSampleDataset`: one
slice from each of the S partitions of every volume, batches of ``batch_size // n_partitions`` volumes) and the same
U-Net encoder, so fine-tuning loads ``main.encoder.*`` as it loads FCL's.  No feature leaves a site; the server
averages the whole model (encoder and head).  One trainer per method, the settings are
:class:`fedssl.train.fcl.FCLSettings` (``objective``):

* :class:`FedRotationTrainer` (``objective="rotation"``): every slice of the batch augmented once
  (:func:`fedssl.data.transforms.augment_rotation_view`: the job's augmentation without the vertical flip, which
  with the horizontal one would make a 180 degree rotation), then rotated by 0, 90, 180 and 270 degrees, all four
  in the same batch as RotNet trains (:func:`fedssl.core.fedclf.rotated_batch`); cross-entropy of
  :class:`fedssl.models.unet.RotationNet`'s 4 logits (a linear classifier on the pooled bottleneck).  Chance:
  ln 4.
* :class:`FedSimCLRTrainer` (``objective="simclr"``): two augmented views of every slice (the job's augmentation,
  :func:`fedssl.data.transforms.augment_views`), both through the encoder and projection head in one batch of 2B
  (SimCLR's practice, and the reference code's, Chaitanya et al.: all views in one batch), NT-Xent over the 2B
  normalised views at ``tau`` (:func:`fedssl.core.fedclf.nt_xent`: each view's positive is its other view, the other
  2(B - 1) views its negatives).  Chance: ln(2B - 1).

Randomness as :class:`fedssl.train.fcl.FCLLocalTrainer`: the initial weights are the server's
(:class:`fedssl.models.unet.MoCoUNetEncoder` with the objective, seeding its own construction; its encoder is the one
FCL starts from at the same seed); slice sampling, batch order and augmentations draw from the trainer's generator
and dataset seeded with :func:`fedssl.core.seeds.site_seed` of the job seed and the site name; each round runs in the
owned global RNG of (that seed, round).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from typing import ClassVar

import torch
import torch.nn.functional as F

from fedssl.core.chance import nt_xent_chance, uniform_chance
from fedssl.core.checks import require
from fedssl.core.fedclf import ROTATIONS, nt_xent, rotated_batch
from fedssl.core.rng import owned_global_rng
from fedssl.core.schedule import cosine_lr
from fedssl.core.seeds import derived_seed
from fedssl.core.spread import normalised_spread
from fedssl.core.trainer import MixedPrecision, RoundStats, check_stop
from fedssl.data.loading import loader_options
from fedssl.data.transforms import augment_rotation_view, augment_views
from fedssl.data.volume import Volume
from fedssl.models.unet import MoCoUNetEncoder
from fedssl.train.fcl import FCLLocalTrainer, FCLSettings, require_settings_objective, site_partitions
from fedssl.train.pretraining import Pretrainer

Augment = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


class _PretextTrainer(Pretrainer):
    """What FedRotation and FedSimCLR share: the data, the network, the optimiser and the round loop; a subclass
    names its ``objective``, its ``default_augment`` and its :meth:`step`.

    Build order (it fixes every random draw): the partition dataset (site seed), the batch check, the network (its
    own fixed seed), the generator (site seed).  ``state_dict`` = model, optimiser, generator and the settings.
    ``device``: the torch device (the executor resolves the settings' "auto"); ``augment``: replaces the default
    augmentation (tests)."""

    objective: ClassVar[str]
    default_augment: ClassVar[Augment]
    finetune_hint = "fedssl.experiments.fcl_finetune"

    def __init__(self, volumes: Sequence[Volume], settings: FCLSettings, *, num_rounds: int,
                 device: str | torch.device = "cpu", site: str = "", augment: Augment | None = None):
        name = type(self).__name__
        settings.check(name)
        require_settings_objective(name, settings, self.objective)
        require(num_rounds > 0, name, "num_rounds", num_rounds, "use the job's number of rounds (paper: 200)")
        s = settings
        self.settings, self.num_rounds, self.workers = s, int(num_rounds), int(s.workers)
        self.data_seed, self.dataset, self.volumes_per_batch = site_partitions(s, volumes, site)
        self.device = torch.device(device)
        self.memory_format = torch.channels_last if s.channels_last else torch.contiguous_format
        self.model = MoCoUNetEncoder(s.features, s.proj_dim, norm=s.norm, head=s.head, image_size=s.image_size,
                                     objective=self.objective).to(self.device).to(memory_format=self.memory_format)
        self.augment = augment or type(self).default_augment
        self.precision = MixedPrecision(self.device, s.amp)
        self.generator = torch.Generator().manual_seed(self.data_seed)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=s.lr, momentum=s.sgd_momentum,
                                         weight_decay=s.weight_decay)
        self.max_steps_per_round = int(s.max_steps_per_round)

    # ------------------------------------------------------------------ LocalTrainer
    def train_round(self, round_idx: int, should_stop: Callable[[], bool] | None = None) -> RoundStats:
        """One local epoch; ``should_stop`` is checked before the round and after every optimiser step."""
        check_stop(should_stop)
        v, cap = self.volumes_per_batch, self.max_steps_per_round
        curve = []

        def progress(step: int, loss: float) -> None:
            curve.append({"loss": loss, "lr": float(self.optimizer.param_groups[0]["lr"])})
            check_stop(should_stop)

        data = self.dataset.batches(v, round_idx, cap, **loader_options(self.workers, self.device))
        out = self.train_batches(data, self.dataset.n_batches(v, cap), round_idx, progress)
        metrics = {k: val for k, val in out.items() if k not in ("loss", "steps")}
        metrics["lr"] = out["lr_end"]
        return RoundStats(loss=out["loss"], steps=out["steps"], samples=len(self.dataset), metrics=metrics, curve=curve)

    def train_batches(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], steps_per_round: int,
                      round_idx: int, progress: Callable[[int, float], None] | None = None) -> dict:
        """The loop of one local epoch over ``batches`` of ``(x [V, S, 1, H, W], part [V, S])`` (the partition ids
        are not used).  Returns the mean loss, the steps, the final lr, ``chance_loss`` (the loss's chance level,
        :mod:`fedssl.core.chance`, averaged over the steps) and the subclass's own statistics.  Runs in the owned
        global RNG of (data seed, objective, round)."""
        with owned_global_rng(derived_seed(self.data_seed, f"{self.objective}_round", round_idx), self.device):
            return self._train_batches(batches, steps_per_round, round_idx, progress)

    def _train_batches(self, batches, steps_per_round: int, round_idx: int, progress) -> dict:
        s = self.settings
        self.model.train()
        losses: list[float] = []
        chances: list[float] = []
        extras: dict[str, list[float]] = {}
        lr = s.lr
        for step, (x, _) in enumerate(batches):
            x = x.to(self.device, non_blocking=True).reshape(-1, *x.shape[2:])  # [V*S, 1, H, W], volume-major
            lr = cosine_lr(s.lr, (round_idx * steps_per_round + step) / (self.num_rounds * steps_per_round))
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            loss, chance, extra = self.step(x)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"{self.method_name} loss became {loss.item()} at round {round_idx} step "
                                         f"{step}; lower lr")
            self.precision.step(loss, self.optimizer)
            losses.append(float(loss.item()))
            chances.append(chance)
            for k, val in extra.items():
                extras.setdefault(k, []).append(val)
            if progress is not None:
                progress(step, losses[-1])
        if not losses:
            raise ValueError("no training batch in this round: the site has fewer volumes than one batch")
        n = len(losses)
        return {"loss": sum(losses) / n, "steps": n, "lr_end": lr, "chance_loss": sum(chances) / n,
                **{k: sum(vals) / n for k, vals in extras.items()}}

    def step(self, x: torch.Tensor) -> tuple[torch.Tensor, float, dict[str, float]]:
        """The loss of one batch of slices ``x [N, 1, H, W]`` (not yet augmented), its chance level and the
        step's own statistics."""
        raise NotImplementedError

    def view(self, x: torch.Tensor) -> torch.Tensor:
        """An augmented view of ``x`` from the trainer's generator, in the trainer's memory format."""
        return self.augment(x, self.generator).contiguous(memory_format=self.memory_format)

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state(),
                "config": {**asdict(self.settings), "num_rounds": self.num_rounds}}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])


class FedRotationTrainer(_PretextTrainer):
    """One site's FedRotation pre-training: 4-way rotation prediction (Gidaris et al., ICLR 2018) of every slice,
    all four rotations in one batch (``[4N, 1, H, W]``, block r rotated by r x 90 degrees), cross-entropy of
    :class:`fedssl.models.unet.RotationNet`'s logits.  Reports ``rotation_accuracy``."""

    objective = "rotation"
    default_augment = staticmethod(augment_rotation_view)
    method_name = "FedRotation"
    global_name = "the global model (the server's model must have objective 'rotation': shape.objective=rotation)"

    def step(self, x: torch.Tensor) -> tuple[torch.Tensor, float, dict[str, float]]:
        views, labels = rotated_batch(self.view(x))  # [4N, 1, H, W], [4N]
        views = views.contiguous(memory_format=self.memory_format)
        with self.precision.autocast():
            logits = self.model(views)
        logits = logits.float()
        loss = F.cross_entropy(logits, labels)
        accuracy = float((logits.detach().argmax(1) == labels).float().mean())
        return loss, uniform_chance(ROTATIONS), {"rotation_accuracy": accuracy}


class FedSimCLRTrainer(_PretextTrainer):
    """One site's FedSimCLR pre-training: two views of every slice through the encoder and projection head in one
    batch, NT-Xent (Chen et al., ICML 2020) over the 2N normalised views at ``tau``.  Reports ``feature_std``, the
    spread of the first views' normalised projections (0 = collapse, :mod:`fedssl.core.spread`)."""

    objective = "simclr"
    default_augment = staticmethod(augment_views)
    method_name = "FedSimCLR"
    global_name = "the global model (the server's model must have objective 'simclr': shape.objective=simclr)"

    def step(self, x: torch.Tensor) -> tuple[torch.Tensor, float, dict[str, float]]:
        n = int(x.shape[0])
        views = torch.cat([self.view(x), self.view(x)])  # [2N, 1, H, W]: view 1 of every slice, then view 2
        with self.precision.autocast():
            z = self.model(views)  # [2N, D], L2-normalised
        z1, z2 = z.float()[:n], z.float()[n:]
        return nt_xent(z1, z2, self.settings.tau), nt_xent_chance(n), {"feature_std": normalised_spread(z1)}


#: objective -> the trainer of its method (one trainer per method; the settings are :class:`FCLSettings`)
TRAINERS: dict[str, type] = {"fcl": FCLLocalTrainer, "rotation": FedRotationTrainer, "simclr": FedSimCLRTrainer}


def trainer_class(objective: str) -> type:
    """The trainer of ``objective`` (:data:`TRAINERS`); a ValueError naming the objectives otherwise."""
    if objective not in TRAINERS:
        raise ValueError(f"objective={objective!r}: use one of {list(TRAINERS)}")
    return TRAINERS[objective]
