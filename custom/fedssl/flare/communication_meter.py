"""Filter that counts the bytes FLARE serialises for each exchange, per site, round and direction.

Put it LAST in the server's task-data filters (what each site downloads, after per-site tailoring) and
FIRST in the server's task-result filters (what each site uploaded, as received).  Sizes are those of
the real FOBS serialisation (``Shareable.to_bytes``) that FLARE sends; the split by content
(weights / features / scalars / other) serialises each part of the DXO on its own.  Records are
appended as JSON lines to ``<run dir>/communication.jsonl``.

The meter sees every payload a site sends before any check: it never raises on one (odd meta keys or values,
a DXO that does not parse, an unserialisable part); what it cannot measure is recorded as ``unmeasured``
and the payload passes on unchanged, for the aggregator to judge.
"""

from __future__ import annotations

import json
import os
import threading

import numpy as np
from nvflare.apis.dxo import DataKind, from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.app_constant import AppConstants
from nvflare.fuel.utils import fobs

from fedssl.core.checks import require_choice

COMM_FILE = "communication.jsonl"


def register_decomposers() -> None:
    """Register FLARE's own decomposers (Shareable, DXO, FLContext ...) and its common ones (numpy arrays), as a
    FLARE process does at start.  Code that serialises a Shareable outside FLARE (a benchmark, a test) must call it
    first: otherwise fobs registers Shareable on the fly as a plain dataclass, which measures other bytes than FLARE
    sends and leaves the process unable to open a FLARE admin session afterwards (the login never completes:
    "'None' is not an instance of 'bytes'")."""
    from nvflare.apis.utils.decomposers import flare_decomposers
    from nvflare.app_common.decomposers import common_decomposers

    flare_decomposers.register()
    common_decomposers.register()


def category_of(meta_key: object, value: object) -> str:
    name = meta_key if isinstance(meta_key, str) else ""
    if "bank" in name or "feature" in name:
        return "features"
    if np.isscalar(value) or (isinstance(value, np.ndarray) and value.size == 1):
        return "scalars"
    return "other"


def payload_breakdown(shareable: Shareable) -> dict:
    """Total serialised bytes of the shareable and the serialised size of each DXO part."""
    out = {"total": len(shareable.to_bytes())}
    try:
        dxo = from_shareable(shareable)
    except ValueError:
        return out
    if dxo.data_kind == DataKind.METRICS:
        out["scalars"] = len(fobs.dumps(dxo.data)) if dxo.data else 0
    elif isinstance(dxo.data, dict) and dxo.data:
        target = {k: v for k, v in dxo.data.items() if isinstance(k, str) and k.startswith("target.")}
        rest = {k: v for k, v in dxo.data.items() if k not in target}
        out["weights"] = len(fobs.dumps(rest)) if rest else 0
        if target:
            out["target_network"] = len(fobs.dumps(target))
    for k, v in dxo.get_meta_props().items():
        cat = category_of(k, v)
        out[cat] = out.get(cat, 0) + len(fobs.dumps({k: v}))
    return out


class CommunicationMeter(Filter):
    def __init__(self, direction: str = "download"):
        """direction: "download" (use as a task-data filter) or "upload" (as a task-result filter)."""
        super().__init__()
        require_choice(type(self).__name__, "direction", direction, ("download", "upload"))
        self.direction = direction
        self._lock = threading.Lock()

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        try:
            self._record(shareable, fl_ctx)
        except Exception as e:  # noqa: BLE001 -- metering never stops an exchange, whatever the payload
            self.log_warning(fl_ctx, f"{self.direction} not measured: {type(e).__name__}: {e}")
        return shareable

    def _record(self, shareable: Shareable, fl_ctx: FLContext) -> None:
        peer = fl_ctx.get_peer_context()
        site = peer.get_identity_name() if peer else fl_ctx.get_identity_name()
        round_idx = shareable.get_header(AppConstants.CURRENT_ROUND)
        if round_idx is None:
            round_idx = shareable.get_cookie(AppConstants.CONTRIBUTION_ROUND)
        task = fl_ctx.get_prop(ReservedKey.TASK_NAME)
        if not isinstance(round_idx, int) or isinstance(round_idx, bool):
            round_idx = None  # a cookie is the site's to write: only an int is a round
        record = {"round": round_idx, "site": site, "direction": self.direction, "task": task}
        try:
            record.update(payload_breakdown(shareable))
        except Exception as e:  # noqa: BLE001 -- an unserialisable part: counted as unmeasured, passed on
            record["unmeasured"] = f"{type(e).__name__}: {e}"[:200]
        engine = fl_ctx.get_engine()
        path = os.path.join(engine.get_workspace().get_run_dir(fl_ctx.get_job_id()), COMM_FILE)
        with self._lock, open(path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
