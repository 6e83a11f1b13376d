"""The semantic mutants of the mutation run (issue 47), one list for the whole package.

Each :class:`Mutant` changes what a paper's method computes (an equation, the use of a hyper-parameter, which
features are banked or shared, an aggregation weight), not its syntax: ``original`` is an exact source snippet that
occurs exactly once in ``file`` and is replaced by ``replacement``; ``tests`` are the test files (or node ids) that
should notice.  ``method`` names the paper page the result belongs to (``jobs/<page>.md``; "shared" = the FedAvg
aggregator and state-dict arithmetic every method uses, listed in ``jobs/README.md``).

``tests/mutation/test_mutants.py`` checks this list without running anything; ``python -m tests.mutation.run`` runs
it.  When a snippet no longer matches (the code moved on), the runner reports the mutant as an error: update the
snippet here, keeping the semantic change it describes.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the paper pages of jobs/ (plus "shared") a mutant may belong to
METHODS = ("FCL", "SSL-FL", "FedCLF", "surgical", "FedDRA", "shared")


@dataclass(frozen=True)
class Mutant:
    id: str
    method: str
    file: str  # relative to the repository root
    original: str  # exact snippet, must occur once in ``file``
    replacement: str
    description: str  # the semantic change, one line
    tests: tuple[str, ...]  # test files or node ids, relative to the repository root


C = "custom/fedssl/"

# ---------------------------------------------------------------------------------------------------- test sets
T_FCL_LOSS = ("tests/unit/core/test_fcl_loss.py",)
T_PTNU = ("tests/unit/core/test_ptnu.py", "tests/unit/flare/test_fclopt_controller.py")
T_PRIVACY = ("tests/unit/core/test_privacy.py", "tests/security/test_feature_privacy.py")
T_BANK = ("tests/unit/core/test_memory_bank.py",)
T_FCL_TRAIN = ("tests/unit/train/test_fcl.py",)
T_FCL_HP = ("tests/unit/train/test_fcl.py", "tests/jobs/test_paper_hyperparameters.py")
T_EXCHANGE = ("tests/unit/core/test_memory_bank.py", "tests/unit/flare/test_feature_bank_collector.py",
              "tests/unit/flare/test_feature_bank_shuttle.py", "tests/security/test_feature_privacy.py")
T_PERTURB = ("tests/unit/flare/test_feature_bank_perturbation.py", "tests/security/test_feature_privacy.py")
T_MIM = ("tests/unit/core/test_mim.py",)
T_MASKING = ("tests/unit/core/test_masking.py", "tests/unit/core/test_mim.py")
T_VIT = ("tests/unit/models/test_vit.py", "tests/unit/core/test_mim.py")
T_MIM_TRAIN = ("tests/unit/train/test_mim_loop.py", "tests/unit/train/test_mim.py")
T_MIM_HP = ("tests/unit/train/test_mim.py", "tests/jobs/test_paper_hyperparameters.py")
T_FEDCLF = ("tests/unit/core/test_fedclf.py",)
T_FEDCLF_TRAIN = ("tests/unit/core/test_fedclf.py", "tests/unit/train/test_fedclf.py")
T_SURGICAL = ("tests/unit/core/test_surgical.py",)
T_SURGICAL_AGG = ("tests/unit/core/test_surgical.py", "tests/unit/flare/test_surgical_aggregator.py")
T_DRO = ("tests/unit/core/test_dro.py", "tests/unit/flare/test_feddra_controller.py")
T_VLP = ("tests/unit/core/test_vlp_loss.py",)
T_FEDDRA_TRAIN = ("tests/unit/core/test_vlp_loss.py", "tests/unit/train/test_feddra_trainer.py")
T_FEDAVG = ("tests/unit/flare/test_fedavg_aggregator.py", "tests/security/test_aggregation_integrity.py")
T_STATE = ("tests/unit/core/test_state_dict.py",)

MUTANTS: tuple[Mutant, ...] = (
    # ------------------------------------------------------------------------------------------------ FCL (ACDC)
    Mutant("fcl-tau-negatives", "FCL", C + "core/fcl_loss.py",
           "neg_logits = q @ neg.t() / tau  # [B, K]", "neg_logits = q @ neg.t()  # [B, K]",
           "temperature not applied to the negatives of eq. 3 (local term)", T_FCL_LOSS),
    Mutant("fcl-remote-over-bank", "FCL", C + "core/fcl_loss.py",
           "return (per_pos * w).sum(dim=1) / w.sum(dim=1).clamp_min(1.0)",
           "return (per_pos * w).sum(dim=1) / float(w.shape[1])",
           "remote term (eq. 4) divided by |Q'| instead of |A(q)|", T_FCL_LOSS),
    Mutant("fcl-remote-unfilled-rows", "FCL", C + "core/fcl_loss.py",
           " & (neg_part.view(1, -1) >= 0)  # [B, K]", "  # [B, K]",
           "unfilled bank rows (partition -1) no longer excluded from the remote positives A(q)", T_FCL_LOSS),
    Mutant("fcl-no-partner-volume", "FCL", C + "core/fcl_loss.py",
           "partner = torch.where(v % 2 == 0, v + 1, v - 1)", "partner = v.clone()",
           "local positive k_s^j of the paired volume replaced by the query's own key (P(q) loses x_s^j)",
           T_FCL_LOSS),
    Mutant("fcl-ns-no-remote", "FCL", C + "core/memory_bank.py",
           "if remote_feats is not None and remote_feats.shape[0] > 0:", "if False:",
           "negative sampling ignores the remote bank: Q = Q_l only (eq. 1 FE dropped)", T_BANK + T_FCL_TRAIN),
    Mutant("fcl-bank-holds-queries", "FCL", C + "train/fcl.py",
           "self.bank.enqueue(k.detach().cpu(), part.detach().cpu())",
           "self.bank.enqueue(q.detach().cpu(), part.detach().cpu())",
           "bank holds main-encoder (query) features instead of momentum features", T_FCL_TRAIN),
    Mutant("fcl-momentum-setting-ignored", "FCL", C + "train/fcl.py",
           "ema_update(self.model.momentum, self.model.main, s.momentum)",
           "ema_update(self.model.momentum, self.model.main, 0.9)",
           "momentum encoder uses m = 0.9 whatever the setting (paper 0.99)", T_FCL_TRAIN),
    Mutant("fcl-default-momentum", "FCL", C + "train/fcl.py",
           "    momentum: float = 0.99\n", "    momentum: float = 0.9\n",
           "paper default momentum 0.99 -> 0.9", T_FCL_HP),
    Mutant("fcl-ptnu-one-step", "FCL", C + "core/ptnu.py",
           "keep = m_d ** n", "keep = m_d",
           "PTNU closed form applies one EMA step instead of n (Algorithm 2)", T_PTNU),
    Mutant("fcl-dp-alpha-ignored", "FCL", C + "core/ptnu.py",
           "return float(alpha) * float(np.mean(d_pcs))", "return float(np.mean(d_pcs))",
           "DP prediction ignores alpha (eq. 13-14: d~ = mean d_pc)", T_PTNU),
    Mutant("fcl-dp-never-calibrated", "FCL", C + "core/ptnu.py",
           "    return d_exact / dp\n", "    return previous\n",
           "DP calibration keeps the previous alpha (eq. 15 never applied)", T_PTNU),
    Mutant("fcl-perturb-not-renormalised", "FCL", C + "core/privacy.py",
           "return noisy / np.maximum(norms, 1e-12)", "return noisy",
           "perturbed features not projected back to the unit sphere", T_PRIVACY),
    Mutant("fcl-perturb-same-noise", "FCL", C + "flare/feature_bank_perturbation.py",
           "np.random.default_rng([self._secret, round_idx])", "np.random.default_rng([self._secret, 0])",
           "the same feature noise every round (round not in the noise seed)", T_PERTURB),
    Mutant("fcl-shuttle-own-bank", "FCL", C + "core/memory_bank.py",
           "pooled = [banks[name] for name in sorted(banks) if name != site]",
           "pooled = [banks[name] for name in sorted(banks)]",
           "a site receives its own features back in its remote bank", T_EXCHANGE),
    Mutant("fcl-collector-no-fresh-filter", "FCL", C + "flare/feature_bank_collector.py",
           "f, p = self.fresh_rows.keep(site, f, p)", "f, p = f[p >= 0], p[p >= 0]",
           "server forwards rows a site already shared (fresh-row filter skipped)", T_EXCHANGE),
    Mutant("fcl-odd-volume-pairs-self", "FCL", C + "core/fcl_loss.py",
           "partner[-1] = 0", "partner[-1] = n_volumes - 1",
           "with an odd number of volumes the last one is its own partner (no cross-volume positive)", T_FCL_LOSS),
    Mutant("fcl-lr-per-round", "FCL", C + "train/fcl.py",
           "lr = cosine_lr(s.lr, (round_idx * steps_per_round + step) / (self.num_rounds * steps_per_round))",
           "lr = cosine_lr(s.lr, round_idx / self.num_rounds)",
           "cosine lr decay stepped once per round instead of per step", T_FCL_TRAIN),
    Mutant("fcl-shuttle-free-rider", "FCL", C + "core/memory_bank.py",
           "take = rng.permutation(f.shape[0])[: min(rows, own)]", "take = rng.permutation(f.shape[0])[:rows]",
           "remote bank size not bounded by what the site shared (free riding)", T_EXCHANGE),
    Mutant("fcl-perturb-sigma-tenth", "FCL", C + "core/privacy.py",
           "rng.normal(0.0, sigma, size=f.shape)", "rng.normal(0.0, sigma / 10, size=f.shape)",
           "feature noise std sigma -> sigma / 10", T_PRIVACY),
    # ------------------------------------------------------------------------------------ SSL-FL (Fed-MAE, Fed-BEiT)
    Mutant("sslfl-mask-count-floor", "SSL-FL", C + "core/masking.py",
           "n = int(round(num_patches * float(mask_ratio)))", "n = int(num_patches * float(mask_ratio))",
           "masked count floor(L * ratio) instead of round(L * ratio)", T_MASKING),
    Mutant("sslfl-mask-shuffled-order", "SSL-FL", C + "core/masking.py",
           "mask = torch.gather(mask, 1, ids_restore)  # back to patch order", "pass",
           "MAE mask left in shuffled order: the loss scores the wrong patches", T_MASKING + T_VIT),
    Mutant("sslfl-mae-loss-all-patches", "SSL-FL", C + "core/mim.py",
           "return (per_patch * m).sum() / n", "return per_patch.mean()",
           "MAE loss (eq. 4) averaged over all patches, not only the masked ones", T_MIM),
    Mutant("sslfl-norm-pix-ignored", "SSL-FL", C + "core/mim.py",
           "    if norm_pix:\n", "    if False:\n",
           "norm_pix_loss ignored in the MAE loss", T_MIM),
    Mutant("sslfl-norm-pix-no-std", "SSL-FL", C + "core/patches.py",
           "return (x - mean) / (var + eps) ** 0.5", "return x - mean",
           "norm_pix target centred but not divided by the patch std", T_MIM),
    Mutant("sslfl-beit-over-budget", "SSL-FL", C + "core/masking.py",
           "if 0 < new <= budget:", "if 0 < new:",
           "BEiT blocks may exceed the budget (mask ratio no longer 'at most')", T_MASKING),
    Mutant("sslfl-beit-no-mask-token", "SSL-FL", C + "models/vit.py",
           "x = x * (1.0 - w) + self.mask_token.expand(b, n, -1) * w", "x = x + 0.0 * w",
           "BEiT masked patches not replaced by the mask token (the encoder sees them)", T_VIT),
    Mutant("sslfl-mae-encoder-sees-all", "SSL-FL", C + "models/vit.py",
           "x = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, d))  # [B, V, D]", "pass",
           "MAE encoder gets every patch, masked ones included", T_VIT),
    Mutant("sslfl-mask-ratio-ignored", "SSL-FL", C + "train/mim_loop.py",
           "loss, _, _ = self.model(imgs, self.mask_ratio, generator=g)",
           "loss, _, _ = self.model(imgs, 0.75, generator=g)",
           "trainer masks 0.75 whatever the mask_ratio setting (SSL-FL 0.6)", T_MIM_TRAIN),
    Mutant("sslfl-default-mask-ratio", "SSL-FL", C + "train/mim.py",
           "    mask_ratio: float = 0.6\n", "    mask_ratio: float = 0.75\n",
           "paper default mask ratio 0.6 -> 0.75", T_MIM_HP),
    Mutant("sslfl-wd-on-norms", "SSL-FL", C + "train/mim_loop.py",
           "{\"params\": no_decay, \"weight_decay\": 0.0}",
           "{\"params\": no_decay, \"weight_decay\": float(weight_decay)}",
           "AdamW weight decay also on norms, biases, position embeddings and tokens", T_MIM_TRAIN),
    Mutant("sslfl-beit-budget-unrounded", "SSL-FL", C + "core/masking.py",
           "reference = round(float(max_mask_ratio) * BEIT_NUM_PATCHES / 5.0) * 5",
           "reference = float(max_mask_ratio) * BEIT_NUM_PATCHES",
           "BEiT masking budget 0.4 x 196 = 78 instead of the reference's 80", T_MASKING),
    Mutant("sslfl-lr-always-per-256", "SSL-FL", C + "train/mim.py",
           "return lr * batch_size / 256 if lr_per_256 else lr", "return lr * batch_size / 256",
           "absolute lr of Table I rescaled by batch / 256", T_MIM_HP),
    # ------------------------------------------------------------------------------------------------- FedCLF
    Mutant("fedclf-fe-no-remote-draws", "FedCLF", C + "core/fedclf.py",
           "return torch.cat([keys, drawn]), ", "return torch.cat([keys, keys]), ",
           "FE (eq. 4): the B remote draws replaced by a second copy of the local keys", T_FEDCLF),
    Mutant("fedclf-feneg-local-keys", "FedCLF", C + "core/fedclf.py",
           "return drawn, torch.ones(b, dtype=torch.bool)", "return keys, torch.zeros(b, dtype=torch.bool)",
           "FE+Neg (eq. 5) puts local keys into Q_CL", T_FEDCLF),
    Mutant("fedclf-feneg-starts-local", "FedCLF", C + "core/fedclf.py",
           "return NegativeQueue(remote, True) if queue == \"fe_neg\" else",
           "return NegativeQueue(bank.features, False, bank.ptr) if queue == \"fe_neg\" else",
           "FE+Neg starts Q_CL from the local bank instead of Q_r", T_FEDCLF),
    Mutant("fedclf-remote-draw-not-uniform", "FedCLF", C + "core/fedclf.py",
           "idx = torch.randint(int(remote.shape[0]), (b,), generator=generator)",
           "idx = torch.arange(b) % int(remote.shape[0])",
           "eq. 3 draws the first b remote rows instead of uniform ones", T_FEDCLF),
    Mutant("fedclf-queue-ptr-frozen", "FedCLF", C + "core/fedclf.py",
           "self.ptr = int((self.ptr + n) % len(self))", "self.ptr = int(self.ptr)",
           "Q_CL replaces the same rows every mini-batch instead of the oldest", T_FEDCLF),
    Mutant("fedclf-ntxent-self-pairs", "FedCLF", C + "core/fedclf.py",
           "logits = logits.masked_fill(torch.eye(2 * b, dtype=torch.bool, device=z.device), float(\"-inf\"))",
           "logits = logits",
           "FedSimCLR NT-Xent counts each view's similarity to itself as a negative", T_FEDCLF),
    Mutant("fedclf-rotation-labels", "FedCLF", C + "core/fedclf.py",
           "labels = torch.arange(ROTATIONS).repeat_interleave(int(x.shape[0]))",
           "labels = torch.arange(ROTATIONS).repeat(int(x.shape[0]))",
           "FedRotation labels misaligned with the rotated views", T_FEDCLF),
    Mutant("fedclf-momentum-setting-ignored", "FedCLF", C + "train/fedclf.py",
           "ema_update(self.model.momentum, self.model.main, self.settings.momentum)",
           "ema_update(self.model.momentum, self.model.main, 0.9)",
           "momentum encoder uses m = 0.9 whatever the setting", T_FEDCLF_TRAIN),
    Mutant("fedclf-queue-oldest-lost", "FedCLF", C + "core/fedclf.py",
           "NegativeQueue(bank.features, False, bank.ptr)", "NegativeQueue(bank.features, False)",
           "Q_CL (none / FE) replaces the bank's row 0 first instead of its oldest row", T_FEDCLF_TRAIN),
    # ------------------------------------------------------------------------------------------------ surgical
    Mutant("surgical-unheld-class-zeroed", "surgical", C + "core/surgical.py",
           "out_w[j], out_b[j] = gw[j], gb[j]", "out_w[j], out_b[j] = 0.0, 0.0",
           "a class no site holds is reset to zero instead of keeping its global row", T_SURGICAL_AGG),
    Mutant("surgical-bias-not-averaged", "surgical", C + "core/surgical.py",
           "out_w[j], out_b[j] = avg[\"w\"], avg[\"b\"][0]",
           "out_w[j], out_b[j] = avg[\"w\"], arrays[holders[0][0]][1][holders[0][1]]",
           "head bias (eq. 3) copied from the first holder instead of averaged", T_SURGICAL_AGG),
    Mutant("surgical-fedbn-averages-bn", "surgical", C + "core/surgical.py",
           "(strategy == \"fedavg\" or not is_bn(k))]", "(strategy != \"fedbn_plus\" or not is_bn(k))]",
           "FedBN averages the batch-norm tensors", T_SURGICAL_AGG),
    Mutant("surgical-fedbn-freezes-bn", "surgical", C + "core/surgical.py",
           "return [k for k in keys if strategy == \"fedbn_plus\" and is_bn(k)]",
           "return [k for k in keys if strategy != \"fedavg\" and is_bn(k)]",
           "FedBN freezes batch norm like FedBN+", T_SURGICAL),
    Mutant("surgical-slice-global-order", "surgical", C + "core/surgical.py",
           "return w[idx].copy(), b[idx].copy()", "return w[sorted(idx)].copy(), b[sorted(idx)].copy()",
           "numpy head slice in global class order, not the site's order", T_SURGICAL),
    Mutant("surgical-backbone-not-updated", "surgical", C + "core/surgical.py",
           "    out.update(avg)\n", "    pass\n",
           "surgical_merge keeps the old backbone (eq. 1 not applied)", T_SURGICAL),
    Mutant("surgical-head-weighted", "surgical", C + "flare/surgical_aggregator.py",
           "global_head=(global_weights[wk], global_weights[bk]))",
           "global_head=(global_weights[wk], global_weights[bk]), weights=dict(self._weights))",
           "surgical head merge weighted by the backbone weights instead of the plain mean of eq. 2",
           T_SURGICAL_AGG),
    Mutant("surgical-union-all-classes", "surgical", C + "core/surgical.py",
           "out = [c for c in order if c in seen]", "out = list(order)",
           "the global class list holds classes that no site declared", T_SURGICAL_AGG),
    # ------------------------------------------------------------------------------------------------- FedDRA
    Mutant("feddra-dro-step-flipped", "FedDRA", C + "core/dro.py",
           "logits = np.log(np.maximum(lam, 1e-300)) + float(gamma) * shifted",
           "logits = np.log(np.maximum(lam, 1e-300)) - float(gamma) * shifted",
           "sign of the DRO step flipped (weight moves to the best site)", T_DRO),
    Mutant("feddra-radius-halved", "FedDRA", C + "core/dro.py",
           "radius2 = 2.0 * float(rho) / n", "radius2 = float(rho) / n",
           "chi^2 ball radius halved (D = N ||lam - u||^2 instead of N/2)", T_DRO),
    Mutant("feddra-no-projection", "FedDRA", C + "core/dro.py",
           "new = project_chi2_ball(new, rho, fixed=~valid, min_share=min_share)", "new = new",
           "DRO weights not projected onto the chi^2 uncertainty set", T_DRO),
    Mutant("feddra-step-scale-no-n", "FedDRA", C + "core/dro.py",
           "return float(n_sites) * float(weight)", "return float(weight)",
           "step size scaled by lambda_i instead of N lambda_i", T_DRO + ("tests/unit/core/test_weight_scale.py",)),
    Mutant("feddra-one-direction", "FedDRA", C + "core/vlp.py",
           "(1.0 - image_weight) * F.cross_entropy(logits.t(), target)",
           "(1.0 - image_weight) * F.cross_entropy(logits, target)",
           "ConVIRT loss drops the text->image direction", T_VLP),
    Mutant("feddra-anchor-mean", "FedDRA", C + "core/vlp.py",
           "(((z_img - z_img_star.detach()) ** 2).sum(-1)", "(((z_img - z_img_star.detach()) ** 2).mean(-1)",
           "anchor term of the image embedding is an MSE, not the squared norm of sec. 4.1", T_VLP),
    Mutant("feddra-mu-ignored", "FedDRA", C + "core/vlp.py",
           "total = mi + self.mu * c", "total = mi + c",
           "anchor weight mu ignored in L_local = L_MI + mu L_C (eq. 1)", T_VLP),
    Mutant("feddra-align-trains-all", "FedDRA", C + "core/vlp.py",
           "return [n for n in names if n.startswith(tuple(alignment_prefixes))]", "return names",
           "stage 1 trains the encoders too (not only the alignment modules)", T_FEDDRA_TRAIN),
    Mutant("feddra-lr-not-scaled", "FedDRA", C + "train/feddra.py",
           "lr = self.lr * self.weight_scale", "lr = self.lr",
           "DRO weight N lambda_i not applied to the site's step size", T_FEDDRA_TRAIN),
    Mutant("feddra-floor-halved", "FedDRA", C + "core/dro.py",
           "floor = float(min_share) / n", "floor = float(min_share) / (2 * n)",
           "DRO weight floor min_share / (2N) instead of min_share / N", T_DRO),
    Mutant("feddra-divergence-no-half", "FedDRA", C + "core/dro.py",
           "return float(np.mean((n * lam - 1.0) ** 2) / 2.0)", "return float(np.mean((n * lam - 1.0) ** 2))",
           "chi^2 divergence without the 1/2 of f(t) = (t - 1)^2 / 2", T_DRO),
    # ------------------------------------------------------------------------- shared FedAvg aggregator, state dicts
    Mutant("shared-num-samples-ignored", "shared", C + "flare/fedavg_aggregator.py",
           "        return float(n)\n", "        return 1.0\n",
           "num_samples weighting ignored: every site counts 1", T_FEDAVG),
    Mutant("shared-no-relative-cap", "shared", C + "flare/fedavg_aggregator.py",
           "counted = min(claimed, self.max_weight_ratio * float(np.median(others))) if others else claimed",
           "counted = claimed",
           "largest claim not capped at max_weight_ratio x the others' median", T_FEDAVG),
    Mutant("shared-holds-smallest", "shared", C + "flare/fedavg_aggregator.py",
           "if held is None or weight > held[1]:", "if held is None or weight < held[1]:",
           "the smallest claim is held (and capped) instead of the largest", T_FEDAVG),
    Mutant("shared-excluded-every-round", "shared", C + "flare/fedavg_aggregator.py",
           "and self.average_excluded_at_end and self.is_last_round(fl_ctx)",
           "and self.average_excluded_at_end",
           "knowledge-split keys expected (averaged) every round, not only in the last", T_FEDAVG),
    Mutant("shared-last-round-off-by-one", "shared", C + "flare/fedavg_aggregator.py",
           "return self._num_rounds is not None and current == self._num_rounds - 1",
           "return self._num_rounds is not None and current == self._num_rounds",
           "last round detected one round late (excluded keys never averaged)", T_FEDAVG),
    Mutant("shared-merge-drops-keys", "shared", C + "core/state_dict.py",
           "    merged = dict(base)\n    merged.update(update)\n", "    merged = dict(update)\n",
           "keys left out of aggregation vanish from the global model", T_STATE + (
               "tests/unit/flare/test_merging_shareable_generator.py",)),
    Mutant("shared-ema-swapped", "shared", C + "core/state_dict.py",
           "pt.mul_(m).add_(po.detach(), alpha=1.0 - m)", "pt.mul_(1.0 - m).add_(po.detach(), alpha=m)",
           "EMA weights swapped: xi <- (1 - m) xi + m theta", T_STATE),
    Mutant("shared-cap-by-mean", "shared", C + "flare/fedavg_aggregator.py",
           "self.max_weight_ratio * float(np.median(others))", "self.max_weight_ratio * float(np.mean(others))",
           "relative cap against the others' mean instead of their median", T_FEDAVG),
    Mutant("shared-int-buffers-floor", "shared", C + "core/state_dict.py",
           "out[k] = np.rint(acc / self.total_weight).astype(dtype)",
           "out[k] = np.floor(acc / self.total_weight).astype(dtype)",
           "integer buffers (BN counters) averaged by floor instead of rounding", T_STATE),
)
