"""Fewer bytes on the wire: FLARE's own model quantisation filters, fitted to the bundle's models, and half-precision
feature banks.

:class:`Quantizer` / :class:`Dequantizer` are FLARE 2.9's ``nvflare.app_opt.pt.quantization`` ``ModelQuantizer`` /
``ModelDequantizer`` (float16, blockwise8, float4, normfloat4 via bitsandbytes, adaquant) with two changes:

- integer and boolean tensors (BatchNorm ``num_batches_tracked``, index buffers) travel as they are: FLARE's
  quantiser refuses any tensor that is not float32 / float16 / bfloat16, so a U-Net or DenseNet could not use it;
- under adaquant, a float tensor whose range is so small that FLARE's level count rounds to 0 travels as it is:
  FLARE 2.9 turns it into NaN on dequantisation (measured: FCL pre-training, every site's contribution refused
  in round 0 because of momentum-encoder batch-norm biases);
- what arrives is checked before FLARE's dequantiser reads it (it comes from a site, or from the server): the
  quantisation type is one the job configured, every quantised key names a tensor of the payload with a float
  source type, and the quantisation state is a dict of arrays per key; a payload that fails the check, or makes
  FLARE's dequantiser raise, becomes one line naming its sender and an error reply that the round leaves out.
  A payload that was not quantised passes unchanged (the receiving aggregator casts and bounds every tensor
  anyway).

blockwise8 / float4 / normfloat4 run on CUDA in FLARE 2.9 (its quantiser moves every tensor to the GPU); on a
machine without one they are refused when the filter is built, naming the types that run on a CPU.

:class:`BankPrecision` sends feature banks (FCL / FedCLF feature exchange: ``bank_features`` up,
``remote_bank_features`` down) as float16; the receivers cast them back to float32 (FeatureBankCollector,
the site trainers).

Placement (``fedssl job --set wire.weights=float16`` / ``wire.banks=float16`` does it for every job): on the
sending side the quantiser runs after every other filter and before the communication meter, on the receiving
side the dequantiser runs right after the meter, before anything else reads the weights; so the meter counts the
bytes that travel.
"""

from __future__ import annotations

import numpy as np
import torch
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_context import FLContext
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.app_opt.pt.quantization.ada_quant import AdaQuantizer
from nvflare.app_opt.pt.quantization.dequantizer import ModelDequantizer
from nvflare.app_opt.pt.quantization.quantizer import ModelQuantizer

from fedssl.core.checks import require_choice
from fedssl.flare.constants import BANK_FEATURES, REMOTE_FEATURES

QUANTIZATION_TYPES = ("float16", "blockwise8", "float4", "normfloat4", "adaquant")
GPU_ONLY = ("blockwise8", "float4", "normfloat4")
FLOAT_SOURCES = ("float32", "float16", "bfloat16")


def _is_float(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point()
    return isinstance(value, np.ndarray) and value.dtype.kind == "f"


class Quantizer(ModelQuantizer):
    def __init__(self, quantization_type: str = "float16"):
        """quantization_type: "float16" or "adaquant" (any machine); "blockwise8", "float4", "normfloat4" (CUDA)."""
        require_choice(type(self).__name__, "quantization_type", quantization_type, QUANTIZATION_TYPES)
        if quantization_type in GPU_ONLY and not torch.cuda.is_available():
            raise ValueError(f"{type(self).__name__}: quantization_type={quantization_type!r} runs on CUDA in FLARE "
                             "2.9 (ModelQuantizer moves each tensor to the GPU) and this machine has none; use "
                             "\"float16\" or \"adaquant\" here")
        super().__init__(quantization_type=quantization_type)

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO | None:
        """A new DXO for every message.  FLARE's ModelQuantizer hands concurrent requests whose DXOs share one
        data dict the first request's quantised DXO, meta included, and writes the quantised tensors into that
        shared dict; here a per-site meta (a remote feature bank, a DRO weight) set by an earlier filter stays
        with its site and the broadcast the server holds is never edited."""
        if dxo.get_meta_prop("quantized_flag"):
            return None
        params, quant_state, source_datatype = self.quantization(dict(dxo.data), fl_ctx)
        out = DXO(data_kind=dxo.data_kind, data=params, meta=dict(dxo.meta))
        out.set_meta_prop(MetaKey.PROCESSED_ALGORITHM, self.quantization_type)
        out.set_meta_prop("quant_state", quant_state)
        out.set_meta_prop("source_datatype", source_datatype)
        out.set_meta_prop("quantized_flag", True)
        return out

    def quantization(self, params: dict, fl_ctx: FLContext):
        floats = {k: v for k, v in params.items() if _is_float(v) and not self.degenerate(v)}
        quantized, quant_state, source_datatype = super().quantization(floats, fl_ctx)
        out = {k: v for k, v in params.items() if k not in floats}  # integer / bool tensors as they are
        out.update(quantized)
        return out, quant_state, source_datatype


    def degenerate(self, value) -> bool:
        """True for a tensor FLARE 2.9's adaquant cannot round-trip: a range (max - min) so small that its level
        count rounds to 0, and dequantisation divides 0 by 0 (NaN).  Such tensors (e.g. batch-norm biases a few
        momentum steps from zero) travel unquantised; they are tiny."""
        if self.quantization_type != "adaquant":
            return False
        t = torch.as_tensor(value).detach().to(torch.float64).reshape(-1).cpu()
        if t.numel() == 0:
            return True
        shifted = t - t.min()
        levels = AdaQuantizer().get_number_of_quantization_levels(element_size=torch.as_tensor(value).element_size(),
                                                                   values_tensor=shifted)
        return levels is not None and levels[0] != 0.0 and levels[1] == 0


class Dequantizer(ModelDequantizer):
    def __init__(self, quantization_type: str = "float16"):
        """quantization_type: the sender's (the only one accepted from it)."""
        require_choice(type(self).__name__, "quantization_type", quantization_type, QUANTIZATION_TYPES)
        super().__init__()
        self.quantization_type = quantization_type

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        """The restored payload; one that cannot be restored (malformed quantisation meta from a site, or anything
        FLARE's dequantiser raises on it) is answered with one line naming its sender and an error reply, which the
        round leaves out (every job's ScatterAndGather runs with ``ignore_result_error``), never a traceback."""
        try:
            return super().process(shareable, fl_ctx)
        except Exception as e:  # whatever a malformed payload makes FLARE's dequantiser raise
            peer = fl_ctx.get_peer_context()
            sender = (peer.get_identity_name() if peer else None) or "the sender"
            self.log_error(fl_ctx, f"refused a quantised payload from {sender}: {type(e).__name__}: {str(e)[:200]}; "
                                   "it is left out")
            reply = make_reply(ReturnCode.BAD_TASK_DATA)
            reply.set_peer_props(shareable.get_peer_props() or {})
            return reply

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO | None:
        if dxo.get_meta_prop("quantized_flag") is None and dxo.get_meta_prop(MetaKey.PROCESSED_ALGORITHM) is None:
            return None  # not quantised: passes unchanged
        self.check(dxo)
        return super().process_dxo(dxo, shareable, fl_ctx)

    def check(self, dxo: DXO) -> None:
        """ValueError unless the payload's quantisation meta is what this job's sender can produce."""
        kind = dxo.get_meta_prop(MetaKey.PROCESSED_ALGORITHM)
        if kind != self.quantization_type:
            raise ValueError(f"quantised payload of type {str(kind)[:32]!r}; this job quantises with "
                             f"{self.quantization_type!r}")
        sources, state, data = dxo.get_meta_prop("source_datatype"), dxo.get_meta_prop("quant_state"), dxo.data or {}
        if not isinstance(sources, dict) or not isinstance(state, dict):
            raise ValueError("quantised payload without a source_datatype / quant_state dict")
        for key, source in sources.items():
            if key not in data or source not in FLOAT_SOURCES:
                raise ValueError(f"quantised payload names tensor {str(key)[:64]!r} of source type "
                                 f"{str(source)[:16]!r}; expected a tensor of the payload from {list(FLOAT_SOURCES)}")
            entry = state.get(key, {})
            if not isinstance(entry, dict) or not all(isinstance(v, (np.ndarray, torch.Tensor, int, float, str, list,
                                                                     tuple))
                                                     for v in entry.values()):
                raise ValueError(f"quantised payload has a malformed quantisation state for {str(key)[:64]!r}")

    def dequantization(self, params: dict, quant_state: dict, quantization_type: str, source_datatype: dict,
                       fl_ctx: FLContext):
        listed = {k: v for k, v in params.items() if k in source_datatype}
        restored = super().dequantization(listed, quant_state, quantization_type, source_datatype, fl_ctx)
        out = {k: v for k, v in params.items() if k not in listed}  # integer / bool tensors as they came
        out.update(restored)
        return out


class BankPrecision(Filter):
    def __init__(self, precision: str = "float16"):
        """precision: "float16" sends the feature banks of FCL / FedCLF feature exchange in half precision."""
        super().__init__()
        require_choice(type(self).__name__, "precision", precision, ("float16",))
        self.precision = precision

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        try:
            dxo = from_shareable(shareable)
        except ValueError:
            return shareable  # not a DXO (e.g. an error reply): nothing to shrink
        if dxo.data_kind not in (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF):
            return shareable
        meta = dict(dxo.get_meta_props())
        changed = False
        for key in (BANK_FEATURES, REMOTE_FEATURES):
            value = meta.get(key)
            if isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.dtype != np.float16:
                with np.errstate(over="ignore"):
                    meta[key] = np.clip(value, -65504, 65504).astype(np.float16)  # features are unit vectors
                changed = True
        if not changed:
            return shareable
        return DXO(data_kind=dxo.data_kind, data=dxo.data, meta=meta).update_shareable(shareable)
