import json

import numpy as np
import pytest
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.shareable import Shareable

from fedssl.flare.communication_meter import COMM_FILE, CommunicationMeter, register_decomposers
from fedssl.flare.constants import BANK_FEATURES, REMOTE_FEATURES
from fedssl.flare.quantization import BankPrecision, Dequantizer, Quantizer
from tests.unit.flare.fakes import FakeEngine, context

register_decomposers()  # as a FLARE process at start: numpy arrays and FLARE's Shareable encoding


def weights():
    return {"conv.weight": np.array([[0.1, -2.5], [3.0e-5, 7.0]], np.float32),
            "bn.num_batches_tracked": np.array(12, np.int64)}


def shareable(data=None, meta=None):
    return DXO(DataKind.WEIGHTS, data=data if data is not None else weights(),
               meta=meta or {"num_samples": 4}).to_shareable()


def roundtrip(kind, s, tmp_path):
    ctx = context(peer_site="site-1", engine=FakeEngine(tmp_path))
    sent = Quantizer(kind).process(s, ctx)
    wire = Shareable.from_bytes(sent.to_bytes())  # what the receiver deserialises
    return sent, Dequantizer(kind).process(wire, ctx)


def test_float16_leaves_integer_buffers_and_restores_float32(tmp_path):
    sent, back = roundtrip("float16", shareable(), tmp_path)
    q = from_shareable(sent)
    assert q.data["conv.weight"].dtype == np.float16 and q.data["bn.num_batches_tracked"].dtype == np.int64
    assert q.get_meta_prop("source_datatype") == {"conv.weight": "float32"}  # the int buffer is not FLARE's business
    out = from_shareable(back)
    assert out.data["conv.weight"].dtype == np.float32 and int(out.data["bn.num_batches_tracked"]) == 12
    np.testing.assert_array_equal(out.data["conv.weight"],
                                  weights()["conv.weight"].astype(np.float16).astype(np.float32))
    assert out.get_meta_prop("num_samples") == 4 and out.get_meta_prop("quant_state") is None


def test_adaquant_roundtrip_is_close(tmp_path):
    rng = np.random.default_rng(0)
    data = {"w": rng.normal(size=(64, 64)).astype(np.float32), "n": np.array(3, np.int64)}
    _, back = roundtrip("adaquant", shareable(dict(data)), tmp_path)
    out = from_shareable(back).data
    assert out["w"].dtype == np.float32 and out["w"].shape == (64, 64) and int(out["n"]) == 3
    assert np.abs(out["w"] - data["w"]).max() < 0.1 * np.abs(data["w"]).max()


def test_adaquant_keeps_tensors_it_cannot_roundtrip_finite(tmp_path):
    # range 2e-5: FLARE 2.9's adaquant computes 0 levels and dequantises to NaN (0 / 0)
    tiny = np.array([0.0, 1e-5, 2e-5, 0.0] * 4, np.float32)
    _, back = roundtrip("adaquant", shareable({"bn.bias": tiny.copy(), "w": np.linspace(-1, 1, 64, dtype=np.float32)}),
                        tmp_path)
    out = from_shareable(back).data
    np.testing.assert_array_equal(out["bn.bias"], tiny)  # sent as it was
    assert np.isfinite(out["w"]).all() and np.abs(out["w"] - np.linspace(-1, 1, 64)).max() < 0.05


def test_a_shared_broadcast_is_never_edited_and_each_site_keeps_its_meta(tmp_path):
    shared = weights()  # the server's broadcast: several sites' DXOs hold this one dict
    q, ctx = Quantizer("float16"), context(peer_site="site-1", engine=FakeEngine(tmp_path))
    a = from_shareable(q.process(shareable(shared, {"dro_weight": 0.3}), ctx))
    b = from_shareable(q.process(shareable(shared, {"dro_weight": 0.7}), ctx))
    assert shared["conv.weight"].dtype == np.float32  # FLARE's ModelQuantizer writes float16 into the shared dict
    assert (a.get_meta_prop("dro_weight"), b.get_meta_prop("dro_weight")) == (0.3, 0.7)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU FLARE's 8- and 4-bit quantisers run")
def test_gpu_only_types_are_refused_without_a_gpu():
    with pytest.raises(ValueError, match="blockwise8.*runs on CUDA.*use \"float16\" or \"adaquant\""):
        Quantizer("blockwise8")
    with pytest.raises(ValueError, match="quantization_type"):
        Quantizer("int3")


def test_dequantizer_refuses_what_its_sender_cannot_produce(tmp_path):
    ctx = context(peer_site="site-1", engine=FakeEngine(tmp_path))
    sent = from_shareable(Quantizer("float16").process(shareable(), ctx))

    def tampered(**meta):
        d = DXO(DataKind.WEIGHTS, data=dict(sent.data), meta={**sent.meta, **meta})
        return d

    dq = Dequantizer("float16")
    with pytest.raises(ValueError, match="of type 'adaquant'; this job quantises with 'float16'"):
        dq.check(tampered(**{MetaKey.PROCESSED_ALGORITHM: "adaquant"}))
    with pytest.raises(ValueError, match="'bn.num_batches_tracked' of source type 'int64'"):
        dq.check(tampered(source_datatype={"conv.weight": "float32", "bn.num_batches_tracked": "int64"}))
    with pytest.raises(ValueError, match="'ghost'"):
        dq.check(tampered(source_datatype={"ghost": "float32"}))
    with pytest.raises(ValueError, match="malformed quantisation state"):
        dq.check(tampered(quant_state={"conv.weight": ["not", "a", "dict"]}))
    dq.check(sent)  # the genuine payload passes
    plain = shareable()  # a payload that was not quantised passes unchanged
    assert from_shareable(dq.process(plain, ctx)).data["conv.weight"].dtype == np.float32


@pytest.mark.parametrize("attack", ["wrong type", "state not a dict", "names an integer tensor", "tensor is text",
                                    "tensor is a nested dict", "adaquant state of the wrong shape"])
def test_a_malformed_quantised_upload_is_one_line_and_an_error_reply_never_a_traceback(attack, tmp_path, caplog):
    """Issue 45 (not tried before): malformed quantisation meta on the wire switch.  The server's dequantiser answers
    every case with one line naming the site and an error reply (ScatterAndGather, with the jobs'
    ignore_result_error, leaves it out of the round); an honest payload after it is restored as usual."""
    kind = "adaquant" if attack.startswith("adaquant") else "float16"
    ctx = context(peer_site="site-3", engine=FakeEngine(tmp_path))
    sent = from_shareable(Quantizer(kind).process(shareable(), ctx))
    data, meta = dict(sent.data), dict(sent.meta)
    if attack == "wrong type":
        meta[MetaKey.PROCESSED_ALGORITHM] = "blockwise8"
    elif attack == "state not a dict":
        meta["quant_state"] = [1, 2, 3]
    elif attack == "names an integer tensor":
        meta["source_datatype"] = {**meta["source_datatype"], "bn.num_batches_tracked": "int64"}
    elif attack == "tensor is text":
        data["conv.weight"] = "not a tensor"
    elif attack == "tensor is a nested dict":
        data["conv.weight"] = {"a": np.ones(3)}
    else:
        meta["quant_state"] = {k: {kk: np.ones(7) for kk in v} for k, v in meta["quant_state"].items()}
    bad = DXO(DataKind.WEIGHTS, data=data, meta=meta).to_shareable()
    bad.set_peer_props({"__identity_name__": "site-3"})
    out = Dequantizer(kind).process(Shareable.from_bytes(bad.to_bytes()), ctx)
    assert out.get_return_code() == "BAD_TASK_DATA" and out.get_peer_props() == {"__identity_name__": "site-3"}
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "site-3" in errors[0].getMessage() and not errors[0].exc_info
    assert "Traceback" not in caplog.text
    honest = Shareable.from_bytes(Quantizer(kind).process(shareable(), ctx).to_bytes())
    assert from_shareable(Dequantizer(kind).process(honest, ctx)).data["conv.weight"].dtype == np.float32


def test_banks_travel_in_float16_and_the_meter_counts_the_smaller_payload(tmp_path):
    bank = np.random.default_rng(0).normal(size=(256, 32)).astype(np.float32)
    ctx = context(peer_site="site-1", engine=FakeEngine(tmp_path))
    meter = CommunicationMeter("upload")
    big = {"w": np.zeros((64, 64), np.float32)}
    meter.process(shareable(dict(big), {BANK_FEATURES: bank, "num_samples": 4}), ctx)
    small = Quantizer("float16").process(BankPrecision().process(shareable(dict(big), {BANK_FEATURES: bank,
                                                                                       "num_samples": 4}), ctx), ctx)
    meter.process(small, ctx)
    plain, wired = (json.loads(line) for line in (tmp_path / COMM_FILE).read_text().splitlines())
    # 256 x 32 bank values and 64 x 64 weights: 2 bytes fewer each
    assert plain["features"] - wired["features"] == 256 * 32 * 2
    assert plain["weights"] - wired["weights"] == 64 * 64 * 2
    assert from_shareable(small).get_meta_prop(BANK_FEATURES).dtype == np.float16
    down = BankPrecision().process(shareable(dict(big), {REMOTE_FEATURES: bank}), ctx)
    assert from_shareable(down).get_meta_prop(REMOTE_FEATURES).dtype == np.float16
