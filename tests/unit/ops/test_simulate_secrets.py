"""run_simulation keeps the simulated parties' secrets beside the workspace, which the simulator clears: a rerun into
the same workspace repeats the server's remote-bank order, a run into another workspace draws a new one."""

import io
import os
import shutil
from unittest import mock

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, from_shareable

from fedssl.flare.constants import COLLECTED, REMOTE_FEATURES
from fedssl.flare.feature_bank_shuttle import FeatureBankShuttle
from fedssl.flare.party_folder import SECRETS_DIR_ENV
from fedssl.ops import simulate
from fedssl.ops.jobs import REPO_ROOT
from tests.unit.flare.fakes import FakeEngine, context

JOB = os.path.join(REPO_ROOT, "jobs", "fcl_acdc")


class _ShuttleSimulator:
    """``nvflare simulator -w WS``: clears WS but its top-level ``local`` and ``startup`` (as FLARE's
    ``_cleanup_workspace``), rebuilds ``WS/server/local`` and filters one round-1 task for site-1 with the server's
    FeatureBankShuttle, in the environment run_simulation passed."""

    orders = []

    def __init__(self, cmd, env, **kwargs):
        ws = cmd[cmd.index("-w") + 1]
        for name in os.listdir(ws):
            if name not in ("local", "startup"):
                shutil.rmtree(os.path.join(ws, name))
        os.makedirs(os.path.join(ws, "server", "local"))
        banks = {s: {"bank_features": np.eye(24, dtype=np.float32)[8 * i: 8 * i + 8], "bank_partitions": np.full(8, i)}
                 for i, s in enumerate(["site-1", "site-2", "site-3"])}  # distinct rows: 16! orders for site-1
        task = DXO(DataKind.WEIGHTS, data={"w": np.zeros(2)}, meta={COLLECTED: banks}).to_shareable()
        task.set_header("current_round", 1)
        ctx = context(peer_site="site-1", engine=FakeEngine(os.path.join(ws, "server", "local")), site="server")
        with mock.patch.dict(os.environ, env, clear=True):
            out = FeatureBankShuttle(bank_size=16).process(task, ctx)
        self.orders.append((env[SECRETS_DIR_ENV],
                            from_shareable(out).get_meta_prop(REMOTE_FEATURES).argmax(1).tolist()))
        self.stdout = io.StringIO("")

    def wait(self, timeout=None):
        return 0


def simulate_into(ws, tmp_path):
    with pytest.raises(simulate.SimulationError, match="no run summary"):  # the stand-in writes no results
        simulate.run_simulation(JOB, str(ws), n_sites=1, data_root=str(tmp_path), echo=False)
    return _ShuttleSimulator.orders[-1]


def test_a_rerun_into_the_same_workspace_repeats_the_secret_another_workspace_draws_anew(tmp_path, monkeypatch):
    monkeypatch.setattr(simulate.subprocess, "Popen", _ShuttleSimulator)
    monkeypatch.setenv(SECRETS_DIR_ENV, str(tmp_path / "someone_elses"))  # the run's own folder wins
    folder, first = simulate_into(tmp_path / "out" / "ws", tmp_path)
    assert folder == str(tmp_path / "out" / "ws_secrets") == simulate.secrets_dir(str(tmp_path / "out" / "ws"))
    secret = tmp_path / "out" / "ws_secrets" / "server" / "feature_bank_shuttle.secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    assert not list((tmp_path / "out" / "ws").rglob("*.secret"))  # nothing in the cleared workspace
    assert simulate_into(tmp_path / "out" / "ws", tmp_path) == (folder, first)  # rerun: the same order
    orders = {tuple(simulate_into(tmp_path / "out" / f"ws{k}", tmp_path)[1]) for k in range(3)}
    assert tuple(first) not in orders and len(orders) == 3  # new workspaces: new secrets
    assert not (tmp_path / "someone_elses").exists()
