"""BackboneBNExclusion: the batch-norm tensors follow the run's backbone strategy (no filter edits per strategy)."""

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.shareable import make_reply

from fedssl.flare.backbone_exclusion import BackboneBNExclusion
from fedssl.flare.constants import BACKBONE_HEADER, EXCLUDED_META
from fedssl.flare.surgical_registration import REGISTRY_PROP, build_registry
from fedssl.models.densenet import is_bn_key
from tests.unit.flare.fakes import FakeEngine, context

BN = ["features.norm0.weight", "features.norm0.running_mean", "features.denseblock1.denselayer1.norm1.bias",
      "features.transition1.norm.num_batches_tracked"]
OTHER = ["features.conv0.weight", "classifier.weight", "classifier.bias"]


def payload(header=None):
    s = DXO(DataKind.WEIGHTS, data={k: np.ones(2, np.float32) for k in BN + OTHER}).to_shareable()
    if header is not None:
        s.set_header(BACKBONE_HEADER, header)
    return s


def server_ctx(tmp_path, backbone):
    reg = build_registry("surgical", backbone, {"site-1": ["A"], "site-2": ["A", "B"]})
    return context(peer_site="site-1", engine=FakeEngine(tmp_path), props={REGISTRY_PROP: reg})


@pytest.mark.parametrize("backbone,kept", [("fedavg", BN + OTHER), ("fedbn", OTHER), ("fedbn_plus", OTHER)])
def test_download_follows_the_registry_and_announces_it(tmp_path, backbone, kept):
    out = BackboneBNExclusion(direction="download").process(payload(), server_ctx(tmp_path, backbone))
    assert sorted(from_shareable(out).data) == sorted(kept)
    assert out.get_header(BACKBONE_HEADER) == backbone
    if backbone != "fedavg":
        assert sorted(from_shareable(out).get_meta_prop(EXCLUDED_META)) == sorted(BN)


@pytest.mark.parametrize("backbone,kept", [("fedavg", BN + OTHER), ("fedbn", OTHER), ("fedbn_plus", OTHER)])
def test_upload_follows_the_result_header(tmp_path, backbone, kept):
    out = BackboneBNExclusion(direction="upload").process(payload(backbone), context(engine=FakeEngine(tmp_path)))
    assert sorted(from_shareable(out).data) == sorted(kept)


def test_upload_never_sends_batchnorm_on_the_last_round(tmp_path):
    from nvflare.app_common.app_constant import AppConstants

    s = payload("fedbn")
    s.set_header(AppConstants.CURRENT_ROUND, 4)
    s.set_header(AppConstants.NUM_ROUNDS, 5)
    out = BackboneBNExclusion(direction="upload").process(s, context(engine=FakeEngine(tmp_path)))
    assert sorted(from_shareable(out).data) == sorted(OTHER)


@pytest.mark.parametrize("header", [None, "fedprox", ""])
def test_upload_refuses_a_missing_or_unknown_strategy(tmp_path, header):
    with pytest.raises(ValueError, match="backbone strategy"):
        BackboneBNExclusion(direction="upload").process(payload(header), context(engine=FakeEngine(tmp_path)))


def test_download_without_registry_refuses(tmp_path):
    with pytest.raises(ValueError, match="ClassRegistration"):
        BackboneBNExclusion(direction="download").process(payload(), context(engine=FakeEngine(tmp_path)))


def test_error_reply_passes_untouched(tmp_path):
    reply = make_reply(ReturnCode.EXECUTION_EXCEPTION)
    assert BackboneBNExclusion(direction="upload").process(reply, context(engine=FakeEngine(tmp_path))) is reply


def test_bad_direction_is_rejected():
    with pytest.raises(ValueError, match="direction"):
        BackboneBNExclusion(direction="sideways")


# -------------------------------------------------------------------------------------------- round 0 (issue 13 item 1)
def stand_in_state():
    """A non-default stand-in for the ImageNet checkpoint: every BN running mean 0.5, running var 4 (torch's
    defaults are 0 / 1, so a site that never received them is told apart)."""
    from fedssl.models.densenet import MultiLabelDenseNet

    sd = MultiLabelDenseNet(["A", "B"], 8, (2, 2, 2, 2), 16, hidden_features=4).state_dict()
    for k, v in sd.items():
        if k.endswith("running_mean"):
            v.fill_(0.5)
        elif k.endswith("running_var"):
            v.fill_(4.0)
    return {k: v.numpy() for k, v in sd.items()}


def task(state, round_idx):
    from nvflare.app_common.app_constant import AppConstants

    s = DXO(DataKind.WEIGHTS, data=dict(state)).to_shareable()
    if round_idx is not None:
        s.set_header(AppConstants.CURRENT_ROUND, round_idx)
    return s


@pytest.mark.parametrize("backbone", ["fedbn", "fedbn_plus"])
def test_round_zero_delivers_the_initial_batchnorm_later_rounds_hold_it_back(tmp_path, backbone):
    """FedBN+ (paper sec. 2.5: 'pre-trained batch normalization statistics'): round 0 carries the whole initial model,
    BN statistics included, verbatim; round 1 and a task without a round (the final test task) carry no BN tensor."""
    state = stand_in_state()
    bn = sorted(k for k in state if is_bn_key(k))
    ctx = server_ctx(tmp_path, backbone)
    r0 = from_shareable(BackboneBNExclusion(direction="download").process(task(state, 0), ctx))
    assert sorted(r0.data) == sorted(state) and r0.get_meta_prop(EXCLUDED_META) is None
    assert float(r0.data["features.norm0.running_mean"].mean()) == 0.5
    assert float(r0.data["features.norm0.running_var"].mean()) == 4.0
    for later in (1, None):
        out = from_shareable(BackboneBNExclusion(direction="download").process(task(state, later), ctx))
        assert sorted(out.data) == sorted(set(state) - set(bn))
        assert sorted(out.get_meta_prop(EXCLUDED_META)) == bn


def test_a_fedbn_plus_site_runs_round_zero_at_the_servers_batchnorm_statistics(tmp_path):
    """End to end on the site: download filter -> head slicer -> MultiLabelExecutor round 0.  Before the fix the site
    froze torch's defaults (running mean 0, var 1) under the server's convolutions; now every BN layer of the site
    holds the server's 0.5 / 4 after its round-0 training (frozen: FedBN+), and round 1 leaves them as they are."""
    import torch
    from nvflare.apis.signal import Signal
    from nvflare.app_common.app_constant import AppConstants

    from fedssl.data.cxr_synthetic import write_synthetic_nih
    from fedssl.flare.head_slicer import HeadSlicer
    from fedssl.flare.multilabel_executor import MultiLabelExecutor

    torch.set_num_threads(1)
    root = tmp_path / "site-1"
    write_synthetic_nih(root, 12, seed=0, image_size=32)
    reg = build_registry("surgical", "fedbn_plus", {"site-1": ["Atelectasis", "Cardiomegaly"]})
    ctx = context(peer_site="site-1", engine=FakeEngine(tmp_path), props={REGISTRY_PROP: reg})
    state = stand_in_state()
    ex = MultiLabelExecutor(data_root=str(root), dataset="nih", classes=["Atelectasis", "Cardiomegaly"], image_size=32,
                            batch_size=4, warmup_epochs=1, local_epochs=1, max_steps_per_epoch=1, n_bootstrap=0,
                            device="cpu", growth_rate=8, block_config=[2, 2, 2, 2], num_init_features=16,
                            hidden_features=4)
    for r in (0, 1):
        t = HeadSlicer().process(BackboneBNExclusion(direction="download").process(task(state, r), ctx), ctx)
        t.set_header(AppConstants.NUM_ROUNDS, 2)
        ex.execute("train", t, context(site="site-1", engine=FakeEngine(tmp_path)), Signal())
        site = ex.trainer.model.state_dict()
        means = [v for k, v in site.items() if k.endswith("running_mean")]
        variances = [v for k, v in site.items() if k.endswith("running_var")]
        assert len(means) == 21 and all(torch.all(v == 0.5) for v in means), r
        assert all(torch.all(v == 4.0) for v in variances), r
