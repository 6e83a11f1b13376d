"""run_check: the run's first line (sites against min_clients, device, profile), the simulator stop with its fix,
the paper-scale-on-CPU hint and the first round's pace."""

import json
import sys

from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import ReservedKey
from nvflare.app_common.app_constant import AppConstants

from fedssl.flare.run_check import (SIMULATOR_JOB_ID, announce_pace, announce_start, pace_report, quick_profile_command,
                                    read_meta, start_report)
from fedssl.flare.run_summary import RunSummary
from fedssl.flare.simulator_site_names import SIMULATOR_MODULE
from fedssl.ops.jobs import configured_job
from tests.unit.flare.fakes import FakeEngine, context

META = {"name": "fcl_acdc", "min_clients": 10}
QUICK_2 = "fedssl job jobs/fcl_acdc runs/fcl_acdc_quick --profile quick --sites 2"


def test_too_few_simulated_sites_stop_with_the_quick_profile_command():
    line, stop = start_report(META, 2, simulated=True, device="cpu")
    assert line.startswith("fcl_acdc: 2 site(s) connected, the job needs 10 (min_clients); device cpu; profile paper")
    assert stop.startswith("fcl_acdc was written for 10 sites and the simulator runs 2: it would wait for ever.")
    assert QUICK_2 in stop and "--profile paper --sites 2" in stop
    assert "\n" not in stop  # one line


def test_enough_sites_or_a_deployment_never_stop():
    assert start_report(META, 10, simulated=True, device="cuda")[1] is None
    assert start_report(META, 2, simulated=False, device="cpu")[1] is None  # a deployment: a site may come back
    assert start_report({"name": "j"}, 1, simulated=True, device="cpu")[1] is None  # no min_clients: FLARE's default


def test_paper_scale_on_a_cpu_names_the_quick_profile_and_a_profile_or_a_gpu_does_not():
    line, _ = start_report(META, 10, simulated=True, device="cpu")
    assert line.endswith("written for a GPU: on a CPU use the quick profile, fedssl job jobs/fcl_acdc "
                         "runs/fcl_acdc_quick --profile quick --sites 10")
    assert "quick profile" not in start_report(META, 10, simulated=True, device="cuda")[0]
    assert "quick profile" not in start_report({**META, "profile": "quick"}, 10, simulated=True, device="cpu")[0]
    assert start_report({**META, "profile": "bench"}, 10, simulated=True, device="cpu")[0].endswith("profile bench")


def test_careless_meta_values_do_not_break_the_line():
    line, stop = start_report({"name": "../x; rm", "min_clients": True, "profile": 3}, 0, simulated=True,
                              device="cpu")
    assert line.startswith("<job>: 0 site(s) connected, the job needs any number (min_clients); device cpu; "
                           "profile paper") and stop is None
    assert quick_profile_command({"name": "fcl_acdc"}, 0).endswith("--sites 1")


def test_pace_hand_computed():
    assert pace_report(48.4, 200) == "first round took 48 s; 200 rounds at this pace: about 2.7 h"  # 9,680 s
    assert pace_report(130.0, 20) == "first round took 2 min; 20 rounds at this pace: about 43 min"  # 2,600 s
    assert pace_report(5.0, None) == "first round took 5 s"
    assert pace_report(5.0, True) == "first round took 5 s"


def test_read_meta_is_bounded(tmp_path):
    assert read_meta(str(tmp_path)) == {}
    (tmp_path / "meta.json").write_text("[1, 2]")
    assert read_meta(str(tmp_path)) == {}
    (tmp_path / "meta.json").write_text(json.dumps(META))
    assert read_meta(str(tmp_path)) == META
    (tmp_path / "meta.json").write_text(json.dumps({**META, "pad": "x" * (1 << 20)}))
    assert read_meta(str(tmp_path)) == {}


class Recorder(RunSummary):
    def __init__(self):
        super().__init__(title="t")
        self.infos, self.panics = [], []

    def log_info(self, fl_ctx, msg, fire_event=False):
        self.infos.append(msg)

    def system_panic(self, reason, fl_ctx):
        self.panics.append(reason)


def _ctx(tmp_path, job_id, n_sites, props=None):
    (tmp_path / "meta.json").write_text(json.dumps(META))
    ctx = context(engine=FakeEngine(tmp_path, n_clients=n_sites), props=props)
    ctx.set_prop(ReservedKey.RUN_NUM, job_id, private=False, sticky=False)
    return ctx


def test_run_summary_stops_a_simulator_run_with_too_few_sites(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, SIMULATOR_MODULE, raising=False)  # its own line is not under test here
    rs = Recorder()
    rs.handle_event(EventType.START_RUN, _ctx(tmp_path, SIMULATOR_JOB_ID, 2))
    assert rs.infos[0].startswith("fcl_acdc: 2 site(s) connected, the job needs 10")
    assert len(rs.panics) == 1 and QUICK_2 in rs.panics[0]


def test_run_summary_does_not_stop_a_deployed_run(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, SIMULATOR_MODULE, raising=False)  # a deployed server has no simulator loaded
    rs = Recorder()
    rs.handle_event(EventType.START_RUN, _ctx(tmp_path, "3f2a-job-id", 2))
    assert rs.panics == [] and rs.infos[0].startswith("fcl_acdc: 2 site(s) connected")


def test_announce_pace_reads_the_workflow_round_count(tmp_path):
    rs = Recorder()
    announce_pace(rs, _ctx(tmp_path, SIMULATOR_JOB_ID, 2, {AppConstants.NUM_ROUNDS: 200}), 48.4)
    assert rs.infos == ["first round took 48 s; 200 rounds at this pace: about 2.7 h"]
    announce_start(rs, _ctx(tmp_path, SIMULATOR_JOB_ID, 10))
    assert rs.panics == []


def test_fedssl_job_records_the_profile_for_the_first_line():
    assert configured_job("jobs/fcl_acdc", profile="quick", n_sites=2)["meta.json"]["profile"] == "quick"
    assert "profile" not in configured_job("jobs/fcl_acdc", n_sites=2)["meta.json"]  # the paper's settings
