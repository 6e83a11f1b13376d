"""The maths of FedCLF local pre-training and its baselines (the negative queue modes and the losses), free of any
FLARE type; the trainer that uses them is :class:`fedssl.train.fedclf.FedCLFLocalTrainer`.

"Federated Self-Supervised Learning for Dermatological Disease Diagnosis" (FedCLF / FedMAE-KS), section III:
MoCo with a main and a momentum network; a local FIFO bank ``Q_l`` of the K latest momentum features (eq. 1,
uploaded every round); the remote bank ``Q_r`` = the other devices' banks (eq. 2, through the feature exchange);
the negatives ``Q_CL`` of the contrastive loss (eq. 6), built per round by the queue mode:

* ``"none"`` -- W/o FE (FedMoCo, Local CL; Fig. 6): ``Q_CL`` is MoCo's own queue, the local bank, and after each
  mini-batch its oldest B entries are replaced by the batch's momentum features;
* ``"fe"`` -- FE (eq. 4): ``Q_CL`` starts as ``Q_l`` and its oldest 2B entries are replaced by the batch's B
  momentum features plus B features drawn uniformly from ``Q_r`` (eq. 3);
* ``"fe_neg"`` -- FE+Neg (eq. 5), FedCLF: ``Q_CL`` starts as ``Q_r`` and its oldest B entries are replaced by B
  features drawn uniformly from ``Q_r``: no local negative at all.

Before a device has received a remote bank (the first round; the bank exchanged at the end of a round is the
next round's ``Q_r``), ``Q_r`` is the device's own bank as it stands at the start of the round: at round 0 MoCo's
initial random unit vectors, so no data of anyone.

The baselines of Tables I-III share the trainer: ``method="simclr"`` (FedSimCLR: NT-Xent over the two views of
the batch, Chen et al., ICML 2020, :func:`nt_xent`) and ``method="rotation"`` (FedRotation: 4-way rotation
prediction, Gidaris et al., ICLR 2018, :func:`rotated_batch`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedssl.core.fcl_loss import contrastive_term
from fedssl.core.memory_bank import FeatureBank

METHODS = ("moco", "simclr", "rotation")
QUEUE_MODES = ("none", "fe", "fe_neg")
#: the rotation classes of FedRotation: k x 90 degrees
ROTATIONS = 4


class NegativeQueue:
    """``Q_CL``: a FIFO of ``[M, D]`` features whose oldest entries are replaced after each mini-batch; each entry
    remembers whether it came from the remote bank (for the round's ``queue_remote_fraction``)."""

    def __init__(self, features: torch.Tensor, remote: bool, oldest: int = 0):
        if features.dim() != 2 or features.shape[0] < 1:
            raise ValueError(f"a negative queue needs features [M, D] with M >= 1, got {tuple(features.shape)}")
        self.features = features.detach().clone()
        self.is_remote = torch.full((features.shape[0],), bool(remote))
        self.ptr = int(oldest) % int(features.shape[0])

    def __len__(self) -> int:
        return int(self.features.shape[0])

    @torch.no_grad()
    def replace_oldest(self, new: torch.Tensor, remote: torch.Tensor) -> None:
        """Put ``new [n, D]`` (``remote [n]`` bool) in place of the ``n`` oldest entries (n > M: the last M)."""
        n = int(new.shape[0])
        if n > len(self):
            new, remote, n = new[-len(self):], remote[-len(self):], len(self)
        idx = (self.ptr + torch.arange(n)) % len(self)
        self.features[idx.to(self.features.device)] = new.detach().to(self.features)
        self.is_remote[idx] = remote.cpu()
        self.ptr = int((self.ptr + n) % len(self))

    @property
    def remote_fraction(self) -> float:
        return float(self.is_remote.float().mean())


def sample_remote(remote: torch.Tensor, b: int, generator: torch.Generator) -> torch.Tensor:
    """Eq. (3): ``b`` features of ``remote [R, D]`` at indices drawn uniformly from [0, R - 1]."""
    idx = torch.randint(int(remote.shape[0]), (b,), generator=generator)
    return remote[idx.to(remote.device)]


def initial_queue(queue: str, bank: FeatureBank, remote: torch.Tensor) -> NegativeQueue:
    """``Q_CL`` at the start of a round: the local bank, oldest entry first where the bank's is (``none``, ``fe``),
    or the remote bank (``fe_neg``; the server shuffled it, so any entry may go first)."""
    return NegativeQueue(remote, True) if queue == "fe_neg" else NegativeQueue(bank.features, False, bank.ptr)


def queue_update(queue: str, keys: torch.Tensor, remote: torch.Tensor,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The features that replace the oldest of ``Q_CL`` after a mini-batch of momentum ``keys [B, D]`` and whether
    each is remote: ``none`` the keys; ``fe`` (eq. 4) the keys and B remote draws; ``fe_neg`` (eq. 5) B remote draws."""
    b = int(keys.shape[0])
    if queue == "none":
        return keys, torch.zeros(b, dtype=torch.bool)
    drawn = sample_remote(remote, b, generator).to(keys)
    if queue == "fe":
        return torch.cat([keys, drawn]), torch.cat([torch.zeros(b, dtype=torch.bool), torch.ones(b, dtype=torch.bool)])
    return drawn, torch.ones(b, dtype=torch.bool)


def info_nce(q: torch.Tensor, k: torch.Tensor, negatives: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. (6), batch mean: -log(e^{q.k+/tau} / (e^{q.k+/tau} + sum_{n in Q_CL} e^{q.n/tau}))."""
    return contrastive_term(q, k.unsqueeze(1), negatives, tau).mean()


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, tau: float) -> torch.Tensor:
    """SimCLR's NT-Xent over the 2B normalised views of a batch: each view's positive is its other view, the
    2(B - 1) other views are its negatives."""
    z = torch.cat([z1, z2])  # [2B, D]
    b = int(z1.shape[0])
    logits = z @ z.t() / tau
    logits = logits.masked_fill(torch.eye(2 * b, dtype=torch.bool, device=z.device), float("-inf"))
    target = torch.cat([torch.arange(b, 2 * b), torch.arange(0, b)]).to(z.device)
    return F.cross_entropy(logits, target)


def rotated_batch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image of ``x [B, C, H, W]`` (square) rotated by 0, 90, 180 and 270 degrees: ``[4B, C, H, W]`` and the
    rotation labels ``[4B]`` (block r holds rotation r)."""
    if x.shape[-1] != x.shape[-2]:
        raise ValueError(f"rotation prediction needs square images, got {tuple(x.shape[-2:])}")
    views = torch.cat([torch.rot90(x, r, dims=(-2, -1)) for r in range(ROTATIONS)])
    labels = torch.arange(ROTATIONS).repeat_interleave(int(x.shape[0])).to(x.device)
    return views, labels
