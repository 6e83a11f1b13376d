"""Test-only FCL executors for the simulator run with a misbehaving site (never on a site's allow-list).

``RecordingFCLExecutor`` is an honest site that also writes what it uploads (``upload_round<r>.npz``: the
tensors and ``num_samples``) into its run folder, so the test can recompute the honest average bit for bit;
``PoisonedFCLExecutor`` trains like an honest site and then, in round 0, sends its float weights as float64 times 1e300
(which overflows float32: the global model would become inf if accepted); from round 1 on it answers with an
error return code, as a site that fails (or claims to) does; FLARE's ScatterAndGather stopped the run on that
unless the job says ``ignore_result_error``.
"""

from __future__ import annotations

import os

import numpy as np
from nvflare.apis.dxo import DXO, from_shareable
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.shareable import make_reply

from fedssl.flare.fcl_executor import FCLExecutor


class RecordingFCLExecutor(FCLExecutor):
    def train(self, shareable, fl_ctx, abort_signal):
        reply = super().train(shareable, fl_ctx, abort_signal)
        dxo = from_shareable(reply)
        round_idx = int(shareable.get_header("current_round", 0) or 0)
        np.savez(os.path.join(self.run_dir(fl_ctx), f"upload_round{round_idx}.npz"),
                 __num_samples__=np.array(dxo.get_meta_prop("num_samples")), **dxo.data)
        return reply


class PoisonedFCLExecutor(FCLExecutor):
    def train(self, shareable, fl_ctx, abort_signal):
        dxo = from_shareable(super().train(shareable, fl_ctx, abort_signal))
        if int(shareable.get_header("current_round", 0) or 0) >= 1:
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        # every float tensor as float64 1e300 (integer buffers as they are: the attack is the values)
        poisoned = {k: np.asarray(v, np.float64) * 1e300 + 1e300 if np.asarray(v).dtype.kind == "f" else v
                    for k, v in dxo.data.items()}
        return DXO(data_kind=dxo.data_kind, data=poisoned, meta=dxo.get_meta_props()).to_shareable()
