import copy
import math

import pytest
import torch

from fedssl.core.masking import block_masks
from fedssl.core.schedule import warmup_cosine
from fedssl.core.tokenizer import PatchTokenizer, init_codebook, kmeans_stats, kmeans_update, patch_vectors
from fedssl.models import build_model
from fedssl.train.mim_loop import MIMTrainer, param_groups


def _fixed_batches(n_batches: int = 2, batch: int = 8, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    # smooth images (a patch is predictable from its neighbours), ImageNet-normalised range
    base = torch.randn(n_batches * batch, 3, 8, 8, generator=g)
    imgs = torch.nn.functional.interpolate(base, size=32, mode="bilinear", align_corners=False)
    return [(imgs[i * batch : (i + 1) * batch], torch.zeros(batch, dtype=torch.long)) for i in range(n_batches)]


def test_mae_trainer_reduces_the_loss_and_follows_the_schedule():
    batches = _fixed_batches()
    trainer = MIMTrainer(build_model("tiny_vit_mae"), "mae", lr=2e-3, warmup_rounds=1, total_rounds=8, mask_ratio=0.6)
    before = trainer.eval_loss(batches[0][0])
    seen: list[float] = []
    for r in range(6):
        trainer.train_round(batches, r, progress=lambda s, loss: seen.append(trainer.optimizer.param_groups[0]["lr"]))
    after = trainer.eval_loss(batches[0][0])
    assert after < 0.8 * before
    expected = [warmup_cosine(r + s / 2, 2e-3, 1, 8) for r in range(6) for s in range(2)]
    assert seen == pytest.approx(expected)
    assert trainer.step == 12 and trainer.rounds_done == 6
    assert trainer.last_stats["steps"] == 2 and trainer.last_stats["images"] == 16
    assert trainer.optimizer.param_groups[1]["weight_decay"] == 0.0


def test_mae_trainer_masks_the_ratio_it_is_given(monkeypatch):
    """The trainer passes its mask_ratio to the masking (issue 47 mutation run: a trainer masking 0.75 whatever it
    is given passed every test): 0.6 of the tiny grid's 64 patches is round(38.4) = 38 per image."""
    import fedssl.models.vit as vit

    seen = []
    real = vit.random_masking

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out[1].sum(dim=1).tolist())
        return out

    monkeypatch.setattr(vit, "random_masking", spy)
    trainer = MIMTrainer(build_model("tiny_vit_mae"), "mae", lr=1e-3, warmup_rounds=0, total_rounds=1, mask_ratio=0.6)
    trainer.compute_loss(torch.randn(2, 3, 32, 32))
    assert seen == [[38, 38]]


def test_beit_trainer_with_a_federated_kmeans_tokenizer_reduces_the_loss():
    batches = _fixed_batches()
    vecs = torch.cat([patch_vectors(x, 4).reshape(-1, 48) for x, _ in batches])
    codebook = init_codebook(vecs, 16, torch.Generator().manual_seed(0))
    halves = vecs.chunk(2)
    for _ in range(3):  # two "sites"
        codebook = kmeans_update(codebook, [kmeans_stats(h, codebook) for h in halves])
    tok = PatchTokenizer(codebook, 4)
    model = build_model("tiny_vit_beit", vocab_size=16, drop_path_rate=0.0)
    trainer = MIMTrainer(model, "beit", lr=5e-3, warmup_rounds=1, total_rounds=8, mask_ratio=0.4, tokenizer=tok,
                         clip_grad=3.0)
    before = trainer.eval_loss(batches[0][0])
    for r in range(6):
        trainer.train_round(iter(batches), r, steps_per_round=2)
    assert trainer.eval_loss(batches[0][0]) < 0.9 * before  # log(16) = 2.77 -> about 2.39


def test_trainer_state_dict_resumes_exactly():
    batches = _fixed_batches(batch=4)
    make = lambda: MIMTrainer(build_model("tiny_vit_mae"), "mae", lr=1e-3, warmup_rounds=1, total_rounds=4,  # noqa: E731
                              mask_ratio=0.75, seed=3)
    a = make()
    a.train_round(batches, 0)
    state = a.state_dict()
    b = make()
    b.load_state_dict(state)  # a restarted client
    assert b.step == 2 and b.rounds_done == 1
    la, lb = a.train_round(batches, 1), b.train_round(batches, 1)
    assert la == lb
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values()))


def test_param_groups_exclude_norms_biases_tokens_and_frozen_pos_embed():
    model = build_model("tiny_vit_beit")
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = param_groups(model, 0.05)
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert {"mask_token", "encoder.cls_token", "encoder.pos_embed", "encoder.norm.weight", "lm_head.bias",
            "encoder.blocks.0.ls1.gamma"} <= no_decay_names
    assert {names[id(p)] for p in decay["params"]} == {n for n, p in model.named_parameters() if p.ndim > 1} - {
        "mask_token", "encoder.cls_token", "encoder.pos_embed"}
    mae = build_model("tiny_vit_mae")
    groups = param_groups(mae, 0.05)
    listed = {id(p) for g in groups for p in g["params"]}
    assert id(mae.encoder.pos_embed) not in listed and id(mae.decoder.pos_embed) not in listed  # fixed sin-cos


def test_non_finite_loss_raises():
    trainer = MIMTrainer(build_model("tiny_vit_mae"), "mae", lr=1e-3, warmup_rounds=0, total_rounds=2)
    bad = torch.full((2, 3, 32, 32), float("nan"))
    with pytest.raises(FloatingPointError, match="round 0 step 0"):
        trainer.train_round([bad], 0)


def test_trainer_configuration_errors():
    mae = build_model("tiny_vit_mae")
    with pytest.raises(ValueError, match="method"):
        MIMTrainer(mae, "simclr", lr=1e-3)
    with pytest.raises(ValueError, match="warmup_rounds"):
        MIMTrainer(mae, "mae", lr=1e-3, warmup_rounds=10, total_rounds=5)
    with pytest.raises(ValueError, match="mask_ratio"):
        MIMTrainer(mae, "mae", lr=1e-3, mask_ratio=1.0)
    beit = build_model("tiny_vit_beit", vocab_size=8)
    with pytest.raises(ValueError, match="tokenizer"):
        MIMTrainer(beit, "beit", lr=1e-3, mask_ratio=0.4)
    with pytest.raises(ValueError, match="vocab_size"):
        MIMTrainer(beit, "beit", lr=1e-3, mask_ratio=0.4, tokenizer=PatchTokenizer(torch.randn(16, 48), 4))
    with pytest.raises(ValueError, match="patch size"):
        MIMTrainer(beit, "beit", lr=1e-3, mask_ratio=0.4, tokenizer=PatchTokenizer(torch.randn(8, 12), 2))
    trainer = MIMTrainer(mae, "mae", lr=1e-3)
    with pytest.raises(ValueError, match="steps_per_round"):
        trainer.train_round(iter([torch.randn(2, 3, 32, 32)]), 0)
    with pytest.raises(ValueError, match="no training batch"):
        trainer.train_round([], 0)


class _ConstTokens:
    """A tokenizer stand-in (like a TorchScript dVAE: no vocab_size / patch_size known in advance)."""

    vocab_size = None
    patch_size = None

    def __init__(self, value: int, n: int = 64):
        self.value, self.n = value, n

    def encode(self, imgs: torch.Tensor) -> torch.Tensor:
        return torch.full((imgs.shape[0], self.n), self.value, dtype=torch.long)


def test_beit_trainer_checks_the_token_ids_and_runs_with_bf16_autocast():
    imgs = torch.randn(2, 3, 32, 32)
    trainer = MIMTrainer(build_model("tiny_vit_beit", vocab_size=8), "beit", lr=1e-3, mask_ratio=0.4,
                         tokenizer=_ConstTokens(8))
    with pytest.raises(ValueError, match=r"tokenizer returned ids \(2, 64\) in \[8, 8\]"):
        trainer.train_round([imgs], 0)
    trainer.tokenizer = _ConstTokens(1, n=49)
    with pytest.raises(ValueError, match="one id per patch"):
        trainer.train_round([imgs], 0)
    amp = MIMTrainer(build_model("tiny_vit_beit", vocab_size=8), "beit", lr=1e-3, warmup_rounds=0, mask_ratio=0.4,
                     tokenizer=_ConstTokens(3), amp=True)
    assert math.isfinite(amp.train_round([imgs], 0))


def _expected_spread(pooled: torch.Tensor) -> float:
    return torch.nn.functional.normalize(pooled, dim=1).std(dim=0, unbiased=False).mean().item()


def test_feature_std_of_mae_is_the_spread_of_the_mean_visible_tokens():
    """Issue 14 item 4: MAE's encoder sees the visible patches only; the spread is that of their mean token
    (class token excluded), computed here from the pre-step model with the same mask draw."""
    imgs = _fixed_batches(1, batch=6)[0][0]
    trainer = MIMTrainer(build_model("tiny_vit_mae"), "mae", lr=1e-3, warmup_rounds=1, total_rounds=4, mask_ratio=0.75)
    model, g = copy.deepcopy(trainer.model).train(), torch.Generator().set_state(trainer.generator.get_state())
    with torch.no_grad():
        latent, _, _ = model.forward_encoder(imgs, 0.75, g)  # [6, 1 + 16, D]
    trainer.train_round([imgs], 0)
    assert trainer.last_stats["feature_std"] == pytest.approx(_expected_spread(latent[:, 1:].mean(dim=1)), rel=1e-5)


def test_feature_std_of_beit_pools_only_the_unmasked_positions():
    imgs = _fixed_batches(1, batch=6)[0][0]
    tok = PatchTokenizer(torch.randn(16, 48, generator=torch.Generator().manual_seed(0)), 4)
    trainer = MIMTrainer(build_model("tiny_vit_beit", vocab_size=16, drop_path_rate=0.0), "beit", lr=1e-3,
                         warmup_rounds=1, total_rounds=4, mask_ratio=0.4, tokenizer=tok)
    model, g = copy.deepcopy(trainer.model).train(), torch.Generator().set_state(trainer.generator.get_state())
    mask = block_masks(6, *trainer.grid_size, 0.4, None, g)
    with torch.no_grad():
        tokens = model.forward_features(imgs, mask)  # [6, 64, D], masked positions hold the mask embedding
    visible = (~mask).float().unsqueeze(-1)
    trainer.train_round([imgs], 0)
    expected = _expected_spread((tokens * visible).sum(dim=1) / visible.sum(dim=1))
    assert trainer.last_stats["feature_std"] == pytest.approx(expected, rel=1e-5)
    assert expected != pytest.approx(_expected_spread(tokens.mean(dim=1)), rel=1e-3)  # all positions would differ
