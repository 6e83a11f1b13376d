"""FedDRA's site trainer (fedssl.train.feddra): what each stage trains and uploads, the DRO step-size factor, the
anchor and the held-out loss v_i, on a tiny synthetic MIMIC-CXR site."""

from __future__ import annotations

import math

import pytest
import torch

from fedssl.data.vlp import load_mimic_vlp
from fedssl.data.vocab import build_wordpiece_vocab, make_tokenizer, merge_word_counts, site_word_counts
from fedssl.models.vlp import ALIGNMENT_PREFIXES
from fedssl.train.feddra import FedDRALocalTrainer, FedDRASettings, split_holdout

torch.set_num_threads(1)
MODEL = {"preset": "tiny", "vocab_size": 256}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    from fedssl.data.vlp_synthetic import write_synthetic_mimic

    root = tmp_path_factory.mktemp("mimic")
    write_synthetic_mimic(str(root), n_patients=24, image_px=32, seed=0)
    records, _ = load_mimic_vlp(str(root), site="site-1")
    counts = site_word_counts([r.text for r in records], min_count=2)
    tok = make_tokenizer(vocab=build_wordpiece_vocab(merge_word_counts([counts], min_count=2), 256))
    return [r for r in records if r.split == "train"], [r for r in records if r.split == "test"], tok


def trainer(site, augment=False, **kw):
    train, test, tok = site
    args = dict(batch_size=4, align_steps=2, steps=2, lr=1e-3, max_text_len=32, holdout_fraction=0.2, dro_batch=3)
    args.update(kw)
    return FedDRALocalTrainer(train, test, FedDRASettings(**MODEL, **args), tokenizer=tok, site="site-1",
                              augment=augment)


def changed_parts(before, after):
    return {k.split(".")[0] for k in after if not torch.equal(before[k], after[k])}


def test_stage_one_trains_and_uploads_only_the_alignment_part(site):
    tr = trainer(site)
    start = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr.set_stage("align", 1.0)
    tr.load_global(start)
    stats = tr.train_round(0)
    assert changed_parts(start, tr.model.state_dict()) == {"image_align", "text_align", "image_proj", "text_proj"}
    up = tr.global_state()
    assert up and all(k.startswith(ALIGNMENT_PREFIXES) for k in up)
    assert set(up) == {k for k in start if k.startswith(ALIGNMENT_PREFIXES)}
    assert "dro_loss" not in stats.metrics and stats.steps == 2
    assert all(p.requires_grad for p in tr.model.parameters())  # the freeze does not outlive the task


def test_stage_two_takes_a_partial_download_and_trains_everything(site):
    tr = trainer(site)
    start = {k: v.clone() for k, v in tr.model.state_dict().items()}
    aligned = {k: v + 0.01 for k, v in start.items() if k.startswith(ALIGNMENT_PREFIXES)}
    tr.set_stage("full_model", 1.0)
    tr.load_global(aligned)  # the stage-2 download: only the aggregated alignment part
    assert torch.equal(tr.model.state_dict()[next(iter(aligned))], aligned[next(iter(aligned))])
    stats = tr.train_round(0)
    parts = changed_parts(start, tr.model.state_dict())
    assert {"image_encoder", "text_encoder", "image_align", "text_align"} <= parts
    assert set(tr.global_state()) == set(start)  # the whole model goes up
    assert math.isfinite(stats.metrics["dro_loss"]) and stats.metrics["dro_loss"] > 0
    # the per-turn cosine is that of the held-out pairs under the trained model (Fig. 4d-f), recomputed here
    z_img, z_txt = tr.embed(tr.held)
    cos = torch.nn.functional.cosine_similarity(z_img, z_txt).mean()
    assert stats.metrics["holdout_cos_matched"] == pytest.approx(float(cos), abs=1e-5)


def test_the_dro_factor_scales_the_step_size(site):
    tr = trainer(site)
    tr.set_stage("fedavg", 1.5)
    assert tr.train_round(0).metrics["lr"] == pytest.approx(1.5e-3)
    with pytest.raises(ValueError, match="weight_scale"):
        tr.set_stage("fedavg", float("inf"))


def test_the_anchor_is_a_frozen_copy_of_the_received_model(site):
    tr = trainer(site, mu=5.0)
    received = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr.set_stage("fedavg", 1.0)
    tr.load_global(received)
    stats = tr.train_round(0)
    # the anchor kept the received weights while the model moved; step 1 starts at the anchor (term 0)
    anchor = tr.anchor.state_dict()
    assert all(torch.equal(anchor[k], received[k]) for k in received)
    assert not all(torch.equal(tr.model.state_dict()[k], received[k]) for k in received)
    assert stats.metrics["loss_anchor"] > 0
    assert not any(p.requires_grad for p in tr.anchor.parameters())
    no_anchor = trainer(site, mu=0.0)
    no_anchor.set_stage("fedavg", 1.0)
    no_anchor.load_global(received)
    assert no_anchor.anchor is None and "loss_anchor" not in no_anchor.train_round(0).metrics


def test_holdout_is_by_study_and_deterministic(site):
    train, _, _ = site
    fit, held = split_holdout(train, 0.25, seed=3)
    assert held and not {r.study for r in fit} & {r.study for r in held}
    assert len(fit) + len(held) == len(train)
    assert split_holdout(train, 0.25, seed=3) == (fit, held)
    assert split_holdout(train, 0.25, seed=4) != (fit, held)
    # a small site still holds out enough pairs for one v_i batch of the common size
    few, many = split_holdout(train, 0.01, seed=3, min_pairs=8)
    assert len(many) >= 8 and len(split_holdout(train, 0.01, seed=3)[1]) < 8


def test_v_i_is_measured_in_batches_of_dro_batch_whatever_the_site_size(site):
    tr = trainer(site, dro_batch=3)
    z = torch.nn.functional.normalize(torch.randn(len(tr.held), 8, generator=torch.Generator().manual_seed(0)), dim=1)
    tr.embed = lambda dataset: (z, z)  # identical pairs: the loss is that of 3-pair batches, not of the whole hold-out
    expected = [float(tr.cfg.loss(z[s:s + 3], z[s:s + 3])[1]["loss_mi"]) for s in range(0, len(z) - 2, 3)]
    assert tr.holdout_metrics()["dro_loss"] == pytest.approx(sum(expected) / len(expected))


def test_checkpoint_round_trip_keeps_the_stage_one_turn(site):
    tr = trainer(site)
    tr.aligned_round = 3
    tr.set_stage("fedavg", 1.0)
    tr.train_round(0)
    state = tr.state_dict()
    other = trainer(site)
    other.load_state_dict(state)
    assert other.aligned_round == 3 and other.tasks_done == 1
    assert all(torch.equal(other.model.state_dict()[k], v) for k, v in tr.model.state_dict().items())


def test_amp_runs_both_encoders_in_bfloat16_and_keeps_the_loss_float32(site):
    from fedssl.core.trainer import MixedPrecision
    from tests.unit.core.test_mixed_precision import float32, layer_dtypes

    tr = trainer(site, amp=True)
    assert tr.precision.dtype is None  # amp on a CPU: float32
    tr.precision = MixedPrecision("cpu", True, force=torch.bfloat16)
    seen = layer_dtypes(tr.model)
    stats = tr.train_round(0)
    # the training steps in bfloat16; the held-out loss v_i after them is measured in float32
    assert torch.bfloat16 in seen and math.isfinite(stats.loss) and float32(tr.model)


def test_loader_workers_give_the_same_turn(site, loader_workers):
    a, b = trainer(site, augment=True), trainer(site, augment=True, workers=2)
    start = {k: v.clone() for k, v in a.model.state_dict().items()}
    for tr in (a, b):
        tr.set_stage("fedavg", 1.0)
        tr.load_global(start)
    losses = []
    for tr in (a, b):
        torch.manual_seed(0)  # dropout draws from torch's global generator: the loader must not consume it
        losses.append(tr.train_round(0).loss)
    assert losses[0] == losses[1]
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())
    assert loader_workers == [2]
    with pytest.raises(ValueError, match="workers=-1"):
        trainer(site, workers=-1)


def test_the_local_loss_is_the_symmetric_infonce_with_the_jobs_temperature(site):
    """Issue 47: an image-to-text-only loss and an ignored temperature passed every test.  The trainer's batch
    loss must equal the mean of both InfoNCE directions at the settings' tau (hand formula), anchor off."""
    import torch.nn.functional as F

    from fedssl.train.feddra import FedDRASettings

    cfg = FedDRASettings(**MODEL, mu=0.0, tau=0.2).loss_config()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    logits = F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).t() / 0.2
    t = torch.arange(5)
    both = 0.5 * F.cross_entropy(logits, t) + 0.5 * F.cross_entropy(logits.t(), t)
    assert float(cfg.loss(a, b)[0]) == pytest.approx(float(both), rel=1e-6)
    assert float(cfg.loss(a, b)[0]) != pytest.approx(float(F.cross_entropy(logits, t)), rel=1e-3)


# ------------------------------------------------------------------ GLoRIA / MGCA local losses (issue 47)
def test_word_index_joins_pieces_and_skips_specials(site):
    tr = trainer(site, local_loss="gloria")
    ids, mask = tr._tokens(["effusions pleurae"])  # unseen forms: split into ## pieces
    pieces = tr.tokenizer.convert_ids_to_tokens(ids[0].tolist())
    index = tr._word_index(ids, mask)[0].tolist()
    expected, w = [], -1
    for p, m in zip(pieces, mask[0].tolist()):
        if not m or p in ("[CLS]", "[SEP]"):
            expected.append(-1)
            continue
        w += 0 if p.startswith("##") and w >= 0 else 1
        expected.append(w)
    assert any(p.startswith("##") for p in pieces)
    assert index == expected and index[0] == -1 and max(index) == 1  # two words, whatever the pieces


def test_gloria_and_mgca_train_and_take_their_own_contrastive_term_for_dro(site):
    from fedssl.core.vlp_gloria import global_loss
    from fedssl.core.vlp_mgca import ita_loss

    for loss, term, keys in (("gloria", lambda a, b: global_loss(a, b, 10.0), {"loss_global", "loss_local"}),
                             ("mgca", lambda a, b: ita_loss(a, b, 0.1), {"loss_ita", "loss_cta", "loss_cpa"})):
        tr = trainer(site, local_loss=loss, local_loss_args={"num_prototypes": 8} if loss == "mgca" else {})
        start = {k: v.clone() for k, v in tr.model.state_dict().items()}
        tr.set_stage("full_model", 1.0)
        tr.load_global(start)
        stats = tr.train_round(0)
        assert keys <= set(stats.metrics) and math.isfinite(stats.loss)
        assert changed_parts(start, tr.model.state_dict()) >= {"image_encoder", "text_encoder", "image_align"}
        z_img, z_txt = tr.embed(tr.held)
        b = tr.dro_batch
        want = [float(term(z_img[s:s + b], z_txt[s:s + b])) for s in range(0, len(z_img) - b + 1, b)]
        assert stats.metrics["dro_loss"] == pytest.approx(sum(want) / len(want), rel=1e-5)


def test_mgca_prototypes_are_the_sites_own_seeded_and_checkpointed(site):
    before = torch.get_rng_state()
    tr = trainer(site, local_loss="mgca", local_loss_args={"num_prototypes": 8})
    assert torch.equal(torch.get_rng_state(), before)  # drawn from the trainer's own generator
    again = trainer(site, local_loss="mgca", local_loss_args={"num_prototypes": 8})
    assert torch.equal(tr.prototypes, again.prototypes) and tr.prototypes.shape == (8, tr.model.proj_dim)
    start = tr.prototypes.detach().clone()
    tr.set_stage("align", 1.0)
    tr.load_global(tr.model.state_dict())
    tr.train_round(0)
    assert (start - tr.prototypes.detach()).abs().max() > 1e-4  # trained in stage 1 too
    assert not any("prototype" in k for k in tr.global_state())  # never uploaded
    again.load_state_dict(tr.state_dict())
    assert torch.equal(again.prototypes, tr.prototypes)


def test_local_loss_arguments_are_checked_at_once(site):
    with pytest.raises(ValueError, match=r"local_loss.*'clip'.*convirt"):
        trainer(site, local_loss="clip")
    with pytest.raises(ValueError, match=r"local_loss_args has unknown keys \['gamma9'\]"):
        trainer(site, local_loss="gloria", local_loss_args={"gamma9": 1.0})
    with pytest.raises(ValueError, match=r"tau2=-1"):
        trainer(site, local_loss="mgca", local_loss_args={"tau2": -1})


def test_evaluate_records_the_gallery_batch_it_ranked_in(site):
    """The per-client chance level needs the batch each text was ranked in: min(retrieval_batch, pairs)."""
    tr = trainer(site)
    out = tr.evaluate("test")
    assert out["n_pairs"] == len(tr.test) and out["retrieval_batch"] == min(100, len(tr.test))
    tr.retrieval_batch = 2
    assert tr.evaluate("test")["retrieval_batch"] == 2
