"""FedDRA's site trainer: two-stage local training with a global anchor and a DRO-scaled step size.

"Distributionally Robust Alignment for Medical Federated Vision-Language Pre-training Under Data Heterogeneity"
(Shuai, Wu, Tang and Shen, TMLR), Algorithms 2-3.  One task of a communication turn, on one site:

- ``set_stage(stage, weight_scale)``: "align" (stage 1: only the alignment blocks and projections train, the
  encoders are frozen), "full_model" (stage 2: everything trains) or "fedavg" (plain FedAvg: one task per turn,
  everything trains, no anchor unless ``mu`` > 0); ``weight_scale`` = N lambda_i, the DRO factor on the step size
  (1 under uniform weights: plain training);
- ``load_global``: the received model (stage 2 receives only the aggregated alignment part: the encoders did not
  change in stage 1); with ``mu`` > 0 a frozen copy of it gives the anchors z* of eq. (1);
- ``train_round``: ``steps`` batches sampled uniformly from the site's training pairs (paper: "randomly sample 50
  batches of data for local training at each turn"), AdamW with a fresh state each task (as the authors' code,
  which builds a new trainer per stage), learning rate ``lr x weight_scale``: the step size is scaled, not the
  loss (the authors' code scales the loss, which Adam's normalisation undoes);
- after a stage-2 or FedAvg task, ``v_i``: the contrastive loss of the site's local model on a held-out part of its
  training pairs (Algorithm 1 lines 13-16), in batches of ``dro_batch`` pairs on every site: InfoNCE grows with the
  batch size (ln B at chance), so a site measured at a larger batch would look worse only for having more data;
- ``evaluate``: text-to-image retrieval on the site's test split (R@1 / R@5 within fixed-size batches, the
  paper's protocol, and over the whole split) and the cosine of matched vs unmatched image-text pairs (Fig. 4d-f).

Only the alignment part is uploaded after stage 1 (:meth:`global_state`).  No text or image leaves the site.

Randomness: the initial weights come from the model's ``seed``; everything data-side (held-out split, batch picks,
augmentations) from the site's seed ``site_seed(seed, site)``.  BERT's and the ViT's dropout draw from the global
generators, so each task runs in the owned global RNG of (site seed, tasks done) and each evaluation in that of
(site seed, split) (:func:`fedssl.core.rng.owned_global_rng`): two runs of one seed train the same weights (issue
42: the worst client's R@1 was 2.0 in one run of a seed and 3.8 in another), and the global generators are left as
they were.  The task count is in the restart state, and two tasks of one turn (stage 1, then stage 2) draw apart.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedssl.core.checks import require, require_amp, require_choice, require_int, require_workers
from fedssl.core.rng import owned_global_rng
from fedssl.core.seeds import derived_seed, site_seed
from fedssl.core.trainer import MixedPrecision, RoundStats, detached, load_checked, stoppable
from fedssl.core.vlp import STAGES, FedDRAConfig, trainable_names
from fedssl.core.vlp_gloria import gloria_loss, merge_word_pieces
from fedssl.core.vlp_mgca import mgca_loss
from fedssl.data.loading import load_batches, loader_options
from fedssl.data.vlp import COLOURS, VLPDataset, VLPRecord, load_manifest
from fedssl.data.vocab import load_vocab, make_tokenizer, tokenize
from fedssl.eval.retrieval import matched_cosine, text_to_image_recall
from fedssl.models.vlp import ALIGNMENT_PREFIXES, VisionLanguageModel, check_model_args

#: the retrieval batch of the paper's protocol ("for each text in a batch of image-text pairs")
RETRIEVAL_BATCH = 100


def split_holdout(records: Sequence[VLPRecord], fraction: float, seed: int, min_pairs: int = 0) -> tuple[list, list]:
    """(fit, held-out) by study, deterministic in ``seed``: ``fraction`` of the studies, but at least enough studies
    for ``min_pairs`` pairs (and at least one) while one study is left to train on; nothing when fraction is 0."""
    studies = sorted({r.study for r in records})
    if fraction <= 0 or len(studies) < 2:
        return list(records), []
    rng = np.random.default_rng(seed)
    size = {st: 0 for st in studies}
    for r in records:
        size[r.study] += 1
    order = [studies[i] for i in rng.permutation(len(studies))]
    target = max(1, int(round(fraction * len(studies))))
    held, pairs = set(), 0
    for st in order[:-1]:
        if len(held) >= target and pairs >= min_pairs:
            break
        held.add(st)
        pairs += size[st]
    return [r for r in records if r.study not in held], [r for r in records if r.study in held]


def site_records(root: str, source_root: str, site: str) -> tuple[list[VLPRecord], list[VLPRecord]]:
    """(train, test) pairs of the site's ``<root>/manifest.csv`` (``fedssl feddra split`` writes one per site); its
    relative paths start from ``source_root`` (``{site}`` replaced; "" = ``root``)."""
    source = source_root.replace("{site}", site) if source_root else root
    recs = load_manifest(os.path.join(root, "manifest.csv"), source, site=site)
    return [r for r in recs if r.split == "train"], [r for r in recs if r.split == "test"]


def site_tokenizer(site: str, tokenizer_path: str, vocab_path: str):
    """The site's tokenizer: the local Hugging Face one at ``tokenizer_path``, or (when that is "") the vocabulary the
    federation built, saved at ``vocab_path`` by the set_vocab task."""
    if tokenizer_path:
        return make_tokenizer(path=tokenizer_path)
    if not os.path.isfile(vocab_path):
        raise ValueError(f"{site}: no vocabulary at {vocab_path}; the job needs the FederatedVocabulary workflow "
                         "before training, or set tokenizer_path to a local Hugging Face tokenizer folder")
    return make_tokenizer(vocab=load_vocab(vocab_path))


#: the settings that build the site's VisionLanguageModel (the server's ``model`` component takes the same)
MODEL_KEYS = ("preset", "vocab_size", "proj_dim", "image_size", "in_chans", "text_weights", "image_weights")


@dataclass(frozen=True)
class FedDRASettings:
    """Paper settings as defaults (MIMIC-CXR, sec. 5.1 and appendix); every job argument of ``FedDRAExecutor``.

    data_root: the site folder holding ``manifest.csv``; "" = site config / FEDSSL_DATA_ROOT ("{site}" ok).
    source_root: the folder the manifest's relative paths start from ("" = data_root).
    preset, vocab_size, proj_dim, image_size, in_chans, text_weights, image_weights: the VisionLanguageModel
        arguments (:data:`MODEL_KEYS`), the same as the server's ``model`` component (``shape.*`` in a profile
        sets both).
    tokenizer_path: a local Hugging Face tokenizer folder; "" = the vocabulary built by the federation.
    colour: "grey" (chest X-rays) or "rgb" (fundus photographs).
    batch_size: pairs per batch; lr: AdamW's (x the DRO factor of the task); weight_decay: AdamW's.
    mu: anchor weight (paper: 5; 0 = no anchor); tau: InfoNCE temperature (the authors' code: 0.07).
    local_loss: the image-text objective L_MI: "convirt" (the paper's main one, default), "gloria" or "mgca"
        (FedDRA Table 2's other backbones; :mod:`fedssl.core.vlp_gloria`, :mod:`fedssl.core.vlp_mgca`).
    local_loss_args: that method's constants as a JSON object, {} = its paper's (GLoRIA: gamma1, gamma2, gamma3,
        global_weight, local_weight; MGCA: tau1, tau2, tau3, lambda1-3, num_prototypes, epsilon,
        sinkhorn_iterations).
    align_steps / steps: batches of stage 1 (the authors' code: 20) and stage 2 (paper: 50) per turn.
    holdout_fraction: training pairs held out for v_i (DRO's client loss), at least ``dro_batch`` of them.
    dro_batch: the batch of v_i, the same on every site (InfoNCE depends on it).
    max_text_len: the reports' token budget (paper: 128).
    min_word_count: the fewest occurrences on this site for a word to be counted in the vocabulary exchange.
    seed: the job seed (the data side of a site draws from ``site_seed(seed, site)``).
    device: "auto" (CUDA when available), "cpu", "cuda", "cuda:1" ...
    amp: bfloat16 autocast on GPUs that support it (float16 + gradient scaler on older ones).
    workers: DataLoader worker processes that decode and augment the next batches (0 = in the training process; the
        same batches either way), pinned on a CUDA device.
    """

    data_root: str = ""
    source_root: str = ""
    preset: str = "base"
    vocab_size: int = 30522
    proj_dim: int = 128
    image_size: int = 0
    in_chans: int = 0
    text_weights: str = ""
    image_weights: str = ""
    tokenizer_path: str = ""
    colour: str = "grey"
    batch_size: int = 32
    lr: float = 2e-5
    weight_decay: float = 0.05
    mu: float = 5.0
    tau: float = 0.07
    local_loss: str = "convirt"
    local_loss_args: dict = field(default_factory=dict)
    align_steps: int = 20
    steps: int = 50
    holdout_fraction: float = 0.1
    dro_batch: int = 16
    max_text_len: int = 128
    min_word_count: int = 5
    seed: int = 0
    device: str = "auto"
    amp: bool = False
    workers: int = 0

    def check(self, name: str) -> None:
        """Every argument checked; a ValueError names the component, the argument, its value and the fix."""
        check_model_args(**self.model_args)
        require(isinstance(self.data_root, str) and isinstance(self.source_root, str), name, "data_root",
                self.data_root, 'use path strings or ""')
        require(isinstance(self.tokenizer_path, str), name, "tokenizer_path", self.tokenizer_path,
                'use a folder path or ""')
        require_choice(name, "colour", self.colour, COLOURS)
        require_int(name, "min_word_count", self.min_word_count, 2,
                    "use 2 or more (5: a word seen fewer times never leaves the site)")
        try:
            self.loss_config()
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        require_amp(name, self.amp)
        require_workers(name, self.workers)
        require_int(name, "batch_size", self.batch_size, 2, "use a batch of at least 2 pairs (paper: 288-388)")
        require_int(name, "align_steps", self.align_steps, 0, "use the stage-1 steps per turn (the authors' code: 20)")
        require_int(name, "steps", self.steps, 1, "use the stage-2 / FedAvg steps per turn (paper: 50)")
        require_int(name, "dro_batch", self.dro_batch, 2,
                    "use the batch of the held-out loss v_i, the same on every site (16)")
        require_int(name, "max_text_len", self.max_text_len, 8, "use a token budget of at least 8 (paper: 128)")
        require(isinstance(self.lr, (int, float)) and self.lr > 0, name, "lr", self.lr,
                "use a learning rate > 0 (paper: 2e-5)")
        require(isinstance(self.holdout_fraction, (int, float)) and 0 <= self.holdout_fraction < 1, name,
                "holdout_fraction", self.holdout_fraction,
                "use a fraction in [0, 1) of the training pairs for the DRO loss (0.1)")

    @property
    def model_args(self) -> dict[str, Any]:
        """The VisionLanguageModel arguments among the settings (:data:`MODEL_KEYS`)."""
        return {k: getattr(self, k) for k in MODEL_KEYS}

    def loss_config(self) -> FedDRAConfig:
        """The local objective (:class:`fedssl.core.vlp.FedDRAConfig`: mu, tau, local_loss), checked."""
        return FedDRAConfig(mu=self.mu, tau=self.tau, local_loss=self.local_loss,
                            local_loss_args=dict(self.local_loss_args) if isinstance(self.local_loss_args, dict)
                            else self.local_loss_args)


class FedDRALocalTrainer:
    """One site's FedDRA training (a ``LocalTrainer``) with the settings of a :class:`FedDRASettings`.

    ``tokenizer``: the site's (the federation's vocabulary or a local one); ``device``: the torch device (the
    executor resolves the settings' "auto"); ``model_seed``: the seed of the model's initial weights (0, as the
    server's model component; a local run may tie it to its own seed); ``retrieval_batch``: the batch of the
    retrieval protocol (paper: 100); ``augment``: training augmentation (off for tests by hand).
    """

    def __init__(self, train_records: Sequence[VLPRecord], test_records: Sequence[VLPRecord], settings: FedDRASettings,
                 *, tokenizer, site: str = "site", device: torch.device | str = "cpu", model_seed: int | None = 0,
                 retrieval_batch: int = RETRIEVAL_BATCH, augment: bool = True):
        name, s = type(self).__name__, settings
        s.check(name)
        self.settings, self.workers = s, int(s.workers)
        require(len(train_records) >= 2, name, "train_records", len(train_records),
                f"{site} needs at least 2 image-report pairs to train")
        require_int(name, "retrieval_batch", retrieval_batch, 2, "use the retrieval batch (paper protocol: 100)")
        self.cfg = s.loss_config()
        self.site, self.seed, self.batch_size, self.lr = site, s.seed, s.batch_size, s.lr
        self.weight_decay, self.align_steps, self.steps = s.weight_decay, s.align_steps, s.steps
        self.max_text_len, self.retrieval_batch = s.max_text_len, retrieval_batch
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.model = VisionLanguageModel(**s.model_args, seed=model_seed).to(self.device)
        self.precision = MixedPrecision(self.device, s.amp)  # bfloat16 autocast on GPUs that support it
        size, chans = self.model.image_size, self.model.in_chans
        own = self.data_seed = site_seed(s.seed, site)
        self.dro_batch = s.dro_batch
        fit, held = split_holdout(train_records, s.holdout_fraction, own, min_pairs=s.dro_batch)
        if len(fit) < 2:
            fit, held = list(train_records), []
        data = dict(channels=chans, seed=own, colour=s.colour, site=site)
        self.fit = VLPDataset(fit, size, augment=augment, **data)
        self.held = VLPDataset(held, size, augment=False, **data) if held else None
        self.test = VLPDataset(list(test_records), size, augment=False, **data) if test_records else None
        self.rng = np.random.default_rng(own)
        self.prototypes = self._init_prototypes()
        self.stage, self.weight_scale = "fedavg", 1.0
        self.anchor: VisionLanguageModel | None = None
        self.tasks_done = 0
        self.aligned_round = -1  # the turn of the last stage-1 task (stage 2 needs this turn's)

    def _init_prototypes(self) -> torch.nn.Parameter | None:
        """MGCA's K prototypes ``[K, proj_dim]``, unit rows, drawn from a generator of the site's seed; they stay on
        the site (trained, checkpointed, never uploaded: :mod:`fedssl.core.vlp_mgca`).  None for other losses."""
        if self.cfg.local_loss != "mgca":
            return None
        g = torch.Generator().manual_seed(derived_seed(self.data_seed, "mgca_prototypes"))
        k, d = self.cfg.method.num_prototypes, self.model.proj_dim
        w = (torch.rand(k, d, generator=g) * 2 - 1) / d ** 0.5  # torch.nn.Linear's default range
        return torch.nn.Parameter(torch.nn.functional.normalize(w, dim=1).to(self.device))

    def _word_index(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[B, T]``: the word each token belongs to (0, 1, ...; a ``##`` piece continues the previous word), -1 for
        [CLS], [SEP], other special tokens and padding (GLoRIA / MGCA work on words)."""
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        out = torch.full(ids.shape, -1, dtype=torch.long)
        for b, (row, m) in enumerate(zip(ids.tolist(), mask.tolist())):
            pieces = self.tokenizer.convert_ids_to_tokens(row)
            w = -1
            for t, (tid, piece, keep) in enumerate(zip(row, pieces, m)):
                if not keep or tid in special:
                    continue
                if w < 0 or not str(piece).startswith("##"):
                    w += 1
                out[b, t] = w
        return out.to(ids.device)

    def _method_loss(self, images: torch.Tensor, ids: torch.Tensor,
                     mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, dict]]:
        """``(z_img, z_txt, (L_MI, terms))`` of GLoRIA or MGCA on token features."""
        z_img, regions, patch_attention = self.model.encode_image_tokens(images)
        z_txt, tokens, token_attention = self.model.encode_text_tokens(ids, mask)
        word_index = self._word_index(ids, mask)
        words, word_mask = merge_word_pieces(tokens.float(), word_index)
        if self.cfg.local_loss == "gloria":
            return z_img, z_txt, gloria_loss(z_img.float(), z_txt.float(), regions.float(), words, word_mask,
                                             self.cfg.method)
        word_attention, _ = merge_word_pieces(token_attention.float().unsqueeze(-1), word_index)
        with torch.no_grad():
            self.prototypes.copy_(torch.nn.functional.normalize(self.prototypes, dim=1))
        return z_img, z_txt, mgca_loss(z_img.float(), z_txt.float(), regions.float(), patch_attention, words,
                                       word_mask, word_attention[..., 0], self.prototypes, self.cfg.method)

    # ------------------------------------------------------------------ the seam
    def set_stage(self, stage: str, weight_scale: float = 1.0) -> None:
        require_choice(type(self).__name__, "stage", stage, STAGES)
        require(isinstance(weight_scale, float) and 0 < weight_scale < float("inf"), type(self).__name__,
                "weight_scale", weight_scale, "the DRO factor N lambda_i must be a finite number > 0")
        self.stage, self.weight_scale = stage, weight_scale

    def load_global(self, state: Mapping[str, Any], keep_local: Sequence[str] | bool = ()) -> list[str]:
        if self.stage == "full_model":
            kept = load_checked(self.model, state, f"{self.site}: the stage-2 download", keep_local=True)
        else:
            kept = load_checked(self.model, state, f"{self.site}: the global model", keep_local=keep_local)
        self.anchor = None
        if self.cfg.mu > 0:
            self.anchor = copy.deepcopy(self.model).eval()
            for p in self.anchor.parameters():
                p.requires_grad_(False)
        return [] if self.stage == "full_model" else kept

    def global_state(self) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        if self.stage == "align":
            return detached(state, trainable_names(state.keys(), "align", ALIGNMENT_PREFIXES))
        return detached(state)

    def state_dict(self) -> dict:
        state = {"model": detached(self.model.state_dict()), "rng": self.rng.bit_generator.state,
                 "tasks_done": self.tasks_done, "aligned_round": self.aligned_round}
        if self.prototypes is not None:
            state["prototypes"] = self.prototypes.detach().cpu().clone()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        load_checked(self.model, state["model"], f"{self.site}: the checkpoint")
        self.rng.bit_generator.state = state["rng"]
        self.tasks_done = int(state["tasks_done"])
        self.aligned_round = int(state["aligned_round"])
        if self.prototypes is not None and "prototypes" in state:
            saved = state["prototypes"]
            if not (isinstance(saved, torch.Tensor) and saved.shape == self.prototypes.shape):
                raise ValueError(f"{self.site}: the checkpoint's MGCA prototypes have shape "
                                 f"{getattr(saved, 'shape', None)}, expected {tuple(self.prototypes.shape)}; "
                                 "delete the site checkpoint or keep local_loss_args.num_prototypes")
            with torch.no_grad():
                self.prototypes.copy_(saved.to(self.device))

    # ------------------------------------------------------------------ training
    def _tokens(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = tokenize(self.tokenizer, list(texts), self.max_text_len)
        return ids.to(self.device), mask.to(self.device)

    def _batch(self, dataset: VLPDataset, indices) -> tuple[torch.Tensor, list[str]]:
        items = [dataset[int(i)] for i in indices]
        return torch.stack([im for im, _ in items]).to(self.device), [t for _, t in items]

    def _round_batches(self, steps: int, n: int, b: int) -> Iterator[tuple[torch.Tensor, list[str]]]:
        """``steps`` batches of ``b`` distinct pairs drawn uniformly from the ``n`` fitting pairs (drawn from the
        site's generator before the round, in the order the steps use them), built by ``workers`` processes."""
        picks = [self.rng.choice(n, size=b, replace=False) for _ in range(steps)]
        for images, texts in load_batches(self.fit, picks, **loader_options(self.workers, self.device)):
            yield images.to(self.device, non_blocking=True), texts

    def train_round(self, round_idx: int, should_stop: Callable[[], bool] | None = None) -> RoundStats:
        with owned_global_rng(derived_seed(self.data_seed, "feddra_task", self.tasks_done), self.device):
            return self._train_task(should_stop)

    def _train_task(self, should_stop: Callable[[], bool] | None) -> RoundStats:
        names = trainable_names([n for n, _ in self.model.named_parameters()], self.stage, ALIGNMENT_PREFIXES)
        train = set(names)
        params = []
        for n, p in self.model.named_parameters():
            p.requires_grad_(n in train)
            if n in train:
                params.append(p)
        if self.prototypes is not None:
            params.append(self.prototypes)  # MGCA's prototypes train in both stages (the site's own)
        lr = self.lr * self.weight_scale
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=self.weight_decay)
        steps = self.align_steps if self.stage == "align" else self.steps
        n, b = len(self.fit), min(self.batch_size, len(self.fit))
        self.fit.set_epoch(self.tasks_done)
        self.model.train()
        totals: dict[str, float] = {}
        losses = []
        for images, texts in stoppable(self._round_batches(steps, n, b), should_stop):
            ids, mask = self._tokens(texts)
            mi = None
            with self.precision.autocast():
                if self.cfg.local_loss == "convirt":
                    z_img, z_txt = self.model(images, ids, mask)
                else:
                    z_img, z_txt, mi = self._method_loss(images, ids, mask)
                anchors = (None, None)
                if self.anchor is not None:
                    with torch.no_grad():
                        anchors = self.anchor(images, ids, mask)
            z_img, z_txt = z_img.float(), z_txt.float()
            anchors = tuple(None if a is None else a.float() for a in anchors)
            loss, terms = self.cfg.loss(z_img, z_txt, *anchors, mi=mi)
            self.precision.step(loss, opt)
            losses.append(float(loss.detach()))
            for k, v in terms.items():
                totals[k] = totals.get(k, 0.0) + v
        for p in self.model.parameters():
            p.requires_grad_(True)
        self.tasks_done += 1
        metrics: dict[str, Any] = {k: v / max(len(losses), 1) for k, v in totals.items()}
        metrics.update(stage=self.stage, lr=lr, weight_scale=self.weight_scale)
        if self.stage != "align":
            metrics.update(self.holdout_metrics())
        return RoundStats(loss=float(np.mean(losses)) if losses else 0.0, steps=len(losses), samples=len(self.fit),
                          metrics=metrics)

    @torch.no_grad()
    def embed(self, dataset: VLPDataset) -> tuple[torch.Tensor, torch.Tensor]:
        """(z_img, z_txt) of every pair of ``dataset`` in order (eval mode)."""
        self.model.eval()
        zi, zt = [], []
        for start in range(0, len(dataset), self.batch_size):
            images, texts = self._batch(dataset, range(start, min(start + self.batch_size, len(dataset))))
            a, b = self.model(images, *self._tokens(texts))
            zi.append(a.cpu())
            zt.append(b.cpu())
        return torch.cat(zi), torch.cat(zt)

    @torch.no_grad()
    def holdout_metrics(self) -> dict[str, float]:
        """v_i (``dro_loss``): the contrastive loss on the held-out pairs (the local loss's contrastive term:
        ConVIRT's InfoNCE, GLoRIA's global loss or MGCA's ITA, FedDRA sec. 6), in consecutive batches of ``dro_batch``
        pairs, the same on every site (InfoNCE grows with the batch: ln B at chance), the remainder left out (a smaller
        batch only when the site holds fewer pairs), and the cosine of matched / unmatched held-out
        pairs (the paper's Fig. 4d-f, per turn); {} when nothing is held out."""
        if self.held is None:
            return {}
        z_img, z_txt = self.embed(self.held)
        b = min(self.dro_batch, len(z_img))
        values = [float(self.cfg.contrastive(z_img[s:s + b], z_txt[s:s + b]))
                  for s in range(0, len(z_img) - b + 1, b)]
        cos = matched_cosine(z_img, z_txt)
        return {"dro_loss": float(np.mean(values)), "holdout_cos_matched": cos["matched"],
                "holdout_cos_unmatched": cos["unmatched"]}

    def evaluate(self, split: str = "test") -> dict[str, Any]:
        dataset = {"test": self.test, "holdout": self.held}.get(split)
        if dataset is None or len(dataset) < 2:
            return {}
        with owned_global_rng(derived_seed(self.data_seed, "evaluate", split), self.device):
            z_img, z_txt = self.embed(dataset)
        batch = min(self.retrieval_batch, len(z_img))
        out: dict[str, Any] = {"n_pairs": len(z_img), "retrieval_batch": batch}
        for k, v in text_to_image_recall(z_img, z_txt, ks=(1, 5), batch_size=batch).items():
            out[k] = v
        for k, v in text_to_image_recall(z_img, z_txt, ks=(1, 5), batch_size=0).items():
            out[f"split_{k}"] = v
        cos = matched_cosine(z_img, z_txt)
        out.update(cos_matched=cos["matched"], cos_unmatched=cos["unmatched"])
        return out
