"""FCLExecutor on tiny synthetic ACDC: one real train task, checkpoint resume, and bad data per site."""

import json
import math
import os

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.signal import Signal

import fedssl.train.fcl as train_fcl
from fedssl.core.trainer import RoundStats
from fedssl.data.acdc_synthetic import write_synthetic_acdc
from fedssl.flare.constants import REMOTE_FEATURES, REMOTE_PARTITIONS, SITE_RECORD_META
from fedssl.experiments.fcl_finetune import export_unet_init
from fedssl.flare.fcl_executor import FCLExecutor
from fedssl.models.unet import TINY_FEATURES, MoCoUNetEncoder
from fedssl.train.fcl import FCLSettings
from tests.unit.flare.fakes import CountingSignal, FakeEngine, context

torch.set_num_threads(1)
ARGS = dict(image_size=32, target_spacing=4.0, features=list(TINY_FEATURES), proj_dim=8, batch_size=8, bank_size=32,
            max_steps_per_round=2, device="cpu")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("acdc")
    write_synthetic_acdc(root, n_patients=4, n_sites=1, seed=0, shape=(48, 48), n_frames=4, slices_range=(5, 6))
    return str(root / "site-1")


def task(round_idx=0, remote=None):
    torch.manual_seed(0)
    weights = {k: v.numpy() for k, v in MoCoUNetEncoder(TINY_FEATURES, 8, image_size=32).state_dict().items()}
    meta = {} if remote is None else {REMOTE_FEATURES: remote[0], REMOTE_PARTITIONS: remote[1]}
    s = DXO(DataKind.WEIGHTS, data=weights, meta=meta).to_shareable()
    s.set_header("current_round", round_idx)
    s.set_header("num_rounds", 2)
    return s


def run(executor, tmp_path, shareable, site="site-1"):
    return executor.execute("train", shareable, context(site=site, engine=FakeEngine(tmp_path)), Signal())


def test_train_task_returns_weights_bank_and_count_then_resumes(data, tmp_path):
    ex = FCLExecutor(data_root=data, **ARGS)
    out = from_shareable(run(ex, tmp_path, task(0)))
    assert out.data_kind == DataKind.WEIGHTS and out.get_meta_prop("num_samples") == 16  # 4 patients x 4 cine frames
    # the rows the bank took in this round, each shared once: 2 steps x 2 volumes x 4 partitions (bank K = 32)
    assert out.get_meta_prop("bank_features").shape == (16, 8) and np.isfinite(out.get_meta_prop("loss"))
    assert (out.get_meta_prop("bank_partitions") >= 0).sum() == 16
    assert os.path.isfile(tmp_path / "fcl_client_state.pt")
    # a fresh executor (client restart) resumes the bank from the checkpoint and uses the remote bank
    remote = (np.eye(8, dtype=np.float32)[np.arange(16) % 8], np.arange(16, dtype=np.int64) % 4)
    ex2 = FCLExecutor(data_root=data, **ARGS)
    out2 = from_shareable(run(ex2, tmp_path, task(1, remote)))
    assert out2.get_meta_prop("bank_features").shape == (16, 8)  # round 1's rows only, none of round 0's again
    assert ex2.trainer.bank.filled == 32 and ex2.last_round == 1
    records = [json.loads(line) for line in open(tmp_path / "fcl_metrics.jsonl")]
    assert [(r["round"], r["remote_features"]) for r in records] == [(0, 0), (1, 16)]  # the remote bank was used
    assert records[1]["loss"] == pytest.approx(records[1]["loss_local"] + records[1]["loss_remote"])


def test_fedmoco_uploads_no_features(data, tmp_path):
    out = from_shareable(run(FCLExecutor(data_root=data, feature_exchange=False, **ARGS), tmp_path, task(0)))
    assert out.get_meta_prop("bank_features") is None


@pytest.mark.parametrize("breakage", ["missing_root", "no_info_cfg", "corrupt_nifti"])
def test_bad_data_fails_this_site_with_a_clear_message(data, tmp_path, breakage, caplog):
    import shutil

    root = tmp_path / "site-3"
    if breakage != "missing_root":
        shutil.copytree(data, root)
    patient = sorted(p for p in os.listdir(root) if p.startswith("patient"))[0] if root.exists() else ""
    if breakage == "no_info_cfg":
        os.remove(root / patient / "Info.cfg")
        culprit = str(root / patient / "Info.cfg")
    elif breakage == "corrupt_nifti":
        culprit = str(root / patient / f"{patient}_4d.nii.gz")  # pre-training reads the cine (frames="all")
        with open(culprit, "wb") as f:
            f.write(b"garbage")
    else:
        culprit = str(root)
    reply = run(FCLExecutor(data_root=str(root), **ARGS), tmp_path, task(0), site="site-3")
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "site-3" in errors[0] and culprit in errors[0]


def test_local_cl_never_loads_the_aggregate_after_round_0(data, tmp_path):
    ex = FCLExecutor(data_root=data, federated=False, **ARGS)
    run(ex, tmp_path, task(0))
    mine = {k: v.clone() for k, v in ex.trainer.model.state_dict().items()}
    poisoned = task(1)
    dxo = from_shareable(poisoned)
    zeros = DXO(DataKind.WEIGHTS, data={k: np.zeros_like(v) for k, v in dxo.data.items()}).update_shareable(poisoned)
    ex.trainer.train_round = lambda round_idx, should_stop: RoundStats(
        loss=1.0, steps=1, samples=8, metrics={"loss_local": 1.0, "loss_remote": 0.0, "remote_features": 0,
                                               "bank_filled": 0, "bank_fill": 0.0, "feature_std": 0.1})
    run(ex, tmp_path, zeros)
    assert all(torch.equal(mine[k], v) for k, v in ex.trainer.model.state_dict().items())
    # a restarted Local CL client knows from its checkpoint that it trained already: it does not load either
    ex2 = FCLExecutor(data_root=data, federated=False, **ARGS)
    ex2.ensure_trainer(zeros, context(site="site-1", engine=FakeEngine(tmp_path)))
    assert ex2.last_round == 1
    ex2.trainer.train_round = ex.trainer.train_round
    run(ex2, tmp_path, zeros)
    assert all(torch.equal(mine[k], v) for k, v in ex2.trainer.model.state_dict().items())
    # the federated executor does load it
    fed = FCLExecutor(data_root=data, **ARGS)
    (tmp_path / "fed").mkdir()
    run(fed, tmp_path / "fed", task(0))
    fed.trainer.train_round = ex.trainer.train_round
    run(fed, tmp_path / "fed", zeros)
    assert all(not v.is_floating_point() or not v.any() for v in fed.trainer.model.state_dict().values())


def test_abort_during_a_round_stops_within_one_step(data, tmp_path):
    ex = FCLExecutor(data_root=data, **dict(ARGS, max_steps_per_round=3, batch_size=8))
    c = context(site="site-1", engine=FakeEngine(tmp_path))
    ex.ensure_trainer(task(0), c)
    steps = []
    step = ex.trainer.optimizer.step
    ex.trainer.optimizer.step = lambda *a, **k: (steps.append(1), step(*a, **k))[1]
    signal = CountingSignal(after=2)  # read before the round (no), then after the first step (yes)
    reply = ex.execute("train", task(0), c, signal)
    assert reply.get_return_code() == ReturnCode.TASK_ABORTED
    assert len(steps) == 1 and signal.reads == 2 and ex.trainer.bank.filled == 8  # 2 volumes x 4 partitions
    assert not os.path.isfile(tmp_path / "fcl_client_state.pt") and ex.last_round == -1  # nothing recorded


def test_a_global_model_that_does_not_fit_names_the_keys(data, tmp_path, caplog):
    s = task(0)
    dxo = from_shareable(s)
    data_ = dict(dxo.data)
    missing = sorted(data_)[0]
    del data_[missing]
    reply = run(FCLExecutor(data_root=data, **ARGS), tmp_path, DXO(DataKind.WEIGHTS, data=data_).update_shareable(s))
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "site-1" in errors[0] and "lacks 1 keys" in errors[0] and missing in errors[0]


def test_pretraining_reads_every_cine_frame_and_reports_bounded_counts(data, tmp_path):
    """Issue 13 item 7: all frames of the 4D cine by default (FCL sec. 5.1), ED/ES as a switch; the summary record
    carries the round's counts: volumes, steps, filled bank slots (2 steps x 2 volumes x 4 partitions = 16 of 32),
    and (issue 14 item 4) the round's feature spread, the one the trainer measured."""
    out = from_shareable(run(FCLExecutor(data_root=data, **ARGS), tmp_path, task(0)))
    record = out.get_meta_prop(SITE_RECORD_META)
    (logged,) = [json.loads(line) for line in open(tmp_path / "fcl_metrics.jsonl")]
    assert record.pop("feature_std") == logged["feature_std"] and 0 < logged["feature_std"] < 1
    # issue 44: the local term's chance level, ln(K + 1) of the K = 32 negatives each step drew
    assert record.pop("chance_loss_local") == logged["chance_loss_local"] == pytest.approx(math.log(33))
    # issue 47 (Table 7): the rows shared this round (each sent once) and the remote rows received (none in round 0)
    assert record == {"volumes": 16, "steps_per_round": 2, "bank_filled": 16, "bank_fill": 0.5, "bank_size": 32,
                      "rows_shared": 16, "remote_features": 0}
    (tmp_path / "ed_es").mkdir()
    ed_es = FCLExecutor(data_root=data, frames="ed_es", **dict(ARGS, max_steps_per_round=0))
    record = from_shareable(run(ed_es, tmp_path / "ed_es", task(0))).get_meta_prop(SITE_RECORD_META)
    # 8 volumes / 2 per batch
    assert (record["volumes"], record["steps_per_round"], record["bank_filled"]) == (8, 4, 32)
    assert [v.phase for v in ed_es.trainer.dataset.volumes[:2]] == ["ED", "ES"]


def remote_rows():
    """16 distinctive unit rows (one-hot, scaled by sign) with partition ids 0..3."""
    return np.eye(8, dtype=np.float32)[np.arange(16) % 8] * np.where(np.arange(16) < 8, 1, -1)[:, None].astype(
        np.float32), np.arange(16, dtype=np.int64) % 4


def negatives_of_the_next_step(monkeypatch, executor, tmp_path, shareable):
    """The negatives Q' handed to the loss in the first step of the task."""
    seen = []
    original = train_fcl.fcl_loss_terms
    monkeypatch.setattr(train_fcl, "fcl_loss_terms",
                        lambda q, pos, q_part, neg, neg_part, *a, **k: (seen.append((neg.detach().clone(),
                                                                                     neg_part.clone())),
                                                                        original(q, pos, q_part, neg, neg_part, *a,
                                                                                 **k))[1])
    run(executor, tmp_path, shareable)
    return seen[0]


def test_the_received_remote_bank_is_among_the_next_steps_negatives(data, tmp_path, monkeypatch):
    """Eq. (1): Q = Q_l,c U remote.  Without negative sampling Q' = Q, so the first step's negatives are the
    local bank (K = 32 rows) followed by exactly the 16 remote rows the task carried, partition ids included."""
    features, partitions = remote_rows()
    ex = FCLExecutor(data_root=data, negative_sampling=False, **ARGS)
    neg, neg_part = negatives_of_the_next_step(monkeypatch, ex, tmp_path, task(0, (features, partitions)))
    assert neg.shape == (48, 8)
    assert (torch.equal(neg[32:], torch.from_numpy(features))
            and torch.equal(neg_part[32:], torch.from_numpy(partitions)))


def test_local_cl_exchanges_and_uploads_nothing(data, tmp_path, monkeypatch):
    """Issue 13 item 6: federated=false switches feature exchange off (a remote bank in the task is not used) and the
    result carries no weight and no bank, only counts; the site's own encoder stays in its checkpoint."""
    features, partitions = remote_rows()
    ex = FCLExecutor(data_root=data, federated=False, negative_sampling=False, **ARGS)
    assert ex.feature_exchange is True  # stored verbatim; Local CL overrides it
    neg, _ = negatives_of_the_next_step(monkeypatch, ex, tmp_path, task(0, (features, partitions)))
    assert neg.shape == (32, 8) and not ex.trainer.feature_exchange  # the local bank only
    out = from_shareable(run(ex, tmp_path, task(1, (features, partitions))))
    assert (out.data == {} and out.get_meta_prop("bank_features") is None
            and out.get_meta_prop("bank_partitions") is None)
    assert out.get_meta_prop("num_samples") == 16 and out.get_meta_prop(SITE_RECORD_META)["bank_filled"] == 32
    state = torch.load(tmp_path / "fcl_client_state.pt", weights_only=True)  # what fedssl fcl export-unet reads
    own = ex.trainer.model.state_dict()
    assert state["round"] == 1 and all(torch.equal(state["trainer"]["model"][k], own[k]) for k in own)
    unet = torch.load(export_unet_init(str(tmp_path / "fcl_client_state.pt"), str(tmp_path / "unet.pt"), TINY_FEATURES),
                      weights_only=True)["model"]  # `fedssl fcl export-unet <site>/fcl_client_state.pt unet.pt`
    encoder = {k[len("main.encoder."):]: v for k, v in own.items() if k.startswith("main.encoder.")}
    assert all(torch.equal(unet[k], v) for k, v in encoder.items())


def test_plain_moco_is_an_executor_switch(data, tmp_path):
    ex = FCLExecutor(data_root=data, plain_moco=True, feature_exchange=False, **ARGS)
    run(ex, tmp_path, task(0))
    assert ex.trainer.settings.plain_moco and ex.plain_moco is True
    with pytest.raises(ValueError, match="plain_moco"):
        FCLExecutor(data_root=data, plain_moco="yes", **ARGS)


def test_loader_workers_reach_the_trainer(data, tmp_path, loader_workers):
    out = from_shareable(run(FCLExecutor(data_root=data, workers=1, **ARGS), tmp_path, task(0)))
    assert np.isfinite(out.get_meta_prop("loss")) and loader_workers == [1]  # one DataLoader for the round


def test_the_arguments_are_the_settings_declared_once():
    """The executor's arguments are FCLSettings' fields (what FLARE, the job checks and the profiles see), stored
    verbatim and handed to the trainer as one FCLSettings; a misspelt name is refused with the accepted ones."""
    import dataclasses
    import inspect

    params = inspect.signature(FCLExecutor).parameters
    fields = {f.name: f.default for f in dataclasses.fields(FCLSettings)}
    assert {k: p.default for k, p in params.items()} == fields and len(fields) == 26
    ex = FCLExecutor(lr=0.1, features=[4, 4, 8, 8, 16, 4])
    assert ex.lr == 0.1 and ex.features == [4, 4, 8, 8, 16, 4]
    assert ex.settings == FCLSettings(lr=0.1, features=[4, 4, 8, 8, 16, 4])
    with pytest.raises(TypeError, match=r"FCLExecutor: unknown arguments bank, lrr; it accepts .*bank_size"):
        FCLExecutor(lrr=0.1, bank=5)


@pytest.mark.parametrize("method, trainer, chance", [("FedRotation", "FedRotationTrainer", math.log(4)),
                                                     ("FedSimCLR", "FedSimCLRTrainer", math.log(15))])
def test_fedrotation_and_fedsimclr_are_switches_of_the_job(data, tmp_path, method, trainer, chance):
    """FCL sec. 5 "Baselines": the table runner's overrides of jobs/fcl_acdc (shape.objective, no feature exchange,
    no bank collector), built as the simulator builds them, reach the server's model and the sites' trainer; a round
    trains the objective's trainer and uploads its whole model (the server's keys), no bank, and the summary record
    carries the loss's chance level (ln 4; ln(2B - 1), B = 8 slices) but no bank counts."""
    from fedssl.experiments.fcl_tables import PRETRAINED, JOBS
    from fedssl.ops.jobs import build_job, component_specs, job_configs

    job, sets = PRETRAINED[method]
    tiny = ["shape.features=[4, 4, 8, 8, 16, 4]", "shape.proj_dim=8", "shape.image_size=32",
            "client.fcl_trainer.batch_size=8", "client.fcl_trainer.max_steps_per_round=2",
            "client.fcl_trainer.target_spacing=4.0", "client.fcl_trainer.device=\"cpu\""]
    out = build_job(os.path.join(JOBS, job), str(tmp_path / "job"), sets=list(sets) + tiny)
    comps = {c["id"]: c for _, cfg in job_configs(out) for c in component_specs(cfg)}
    assert comps["aggregator"]["args"]["collectors"] == []
    server = MoCoUNetEncoder(**comps["model"]["args"])
    ex = FCLExecutor(**dict(comps["fcl_trainer"]["args"], data_root=data))
    weights = {k: v.numpy() for k, v in server.state_dict().items()}
    s = DXO(DataKind.WEIGHTS, data=weights).to_shareable()
    s.set_header("current_round", 0)
    s.set_header("num_rounds", 2)
    (tmp_path / "site").mkdir()
    out = from_shareable(run(ex, tmp_path / "site", s))
    assert type(ex.trainer).__name__ == trainer and ex.trainer.settings.objective == server.objective
    assert set(out.data) == set(weights) and out.get_meta_prop("bank_features") is None
    record = out.get_meta_prop(SITE_RECORD_META)
    assert record["chance_loss"] == pytest.approx(chance) and record["steps_per_round"] == 2
    assert not {"bank_filled", "bank_size", "chance_loss_local"} & set(record)


def test_a_baseline_objective_with_feature_exchange_is_refused(data):
    with pytest.raises(ValueError, match="FCLExecutor: argument feature_exchange=True is invalid; "
                                         "objective='rotation' exchanges no feature"):
        FCLExecutor(data_root=data, objective="rotation", **ARGS)
    with pytest.raises(ValueError, match="argument objective='rot' is invalid"):
        FCLExecutor(data_root=data, objective="rot", feature_exchange=False, **ARGS)
