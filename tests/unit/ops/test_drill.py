"""The fault drill's pieces that need no deployment: scenarios, kit rewiring, secrets, model comparison, CLI."""

import json
import os

import pytest
import torch

from fedssl.ops.deploy import DeploymentError, copy_secrets, point_site_at
from fedssl.ops.drill import SCENARIOS, model_difference, parse_scenarios, planned_rounds, table


def test_scenarios_parse_and_unknown_ones_are_named():
    assert parse_scenarios("latency,kill-site") == ["latency", "kill-site"]
    assert parse_scenarios("all") == list(SCENARIOS)
    with pytest.raises(ValueError, match="unknown scenario 'kill-sites'"):
        parse_scenarios("latency,kill-sites")


def test_the_site_kit_is_pointed_at_the_proxy_on_loopback(tmp_path):
    startup = tmp_path / "startup"
    startup.mkdir()
    conf = {"format_version": 2, "servers": [{"name": "fedssl", "service": {"target": "localhost:18102",
                                                                             "scheme": "http"},
                                              "identity": "localhost"}], "client": {"fqsn": "site-1"}}
    (startup / "fed_client.json").write_text(json.dumps(conf))
    assert point_site_at(str(tmp_path), 40001) == "localhost:40001"
    new = json.loads((startup / "fed_client.json").read_text())
    assert new["servers"][0]["service"] == {"target": "localhost:40001", "scheme": "http"}
    assert new["servers"][0]["identity"] == "localhost" and new["client"] == conf["client"]
    conf["servers"][0]["service"]["target"] = "fl.example.org:18102"
    (startup / "fed_client.json").write_text(json.dumps(conf))
    with pytest.raises(DeploymentError, match="not on localhost"):
        point_site_at(str(tmp_path), 40001)


def test_secrets_are_copied_private(tmp_path):
    (tmp_path / "a" / "local").mkdir(parents=True)
    (tmp_path / "b" / "local").mkdir(parents=True)
    (tmp_path / "a" / "local" / "x.secret").write_text("0" * 32 + "\n")
    (tmp_path / "a" / "local" / "resources.json").write_text("{}")
    assert copy_secrets(str(tmp_path / "a"), str(tmp_path / "b")) == ["x.secret"]
    assert os.stat(tmp_path / "b" / "local" / "x.secret").st_mode & 0o777 == 0o600
    assert not (tmp_path / "b" / "local" / "resources.json").exists()


def test_model_difference_bit_identity_and_largest_gap(tmp_path):
    a = {"model": {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}}
    b = {"model": {"w": torch.tensor([1.0, 2.5]), "n": torch.tensor(3)}}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    assert model_difference(str(tmp_path / "a.pt"), str(tmp_path / "a.pt")) == {"identical": True,
                                                                              "max_abs_diff": 0.0}
    assert model_difference(str(tmp_path / "a.pt"), str(tmp_path / "b.pt")) == {"identical": False,
                                                                              "max_abs_diff": 0.5}


def test_planned_rounds_and_table(tmp_path):
    cfg = tmp_path / "app" / "config"
    cfg.mkdir(parents=True)
    (cfg / "config_fed_server.json").write_text(json.dumps(
        {"workflows": [{"id": "sag", "args": {"num_rounds": 4, "min_clients": 3}}]}))
    assert planned_rounds(str(tmp_path)) == 4
    report = {"scenarios": [{"scenario": "latency", "completed": True, "status": "FINISHED:COMPLETED",
                             "rounds_lost": 0, "rounds_planned": 4, "extra_wall_s": 6.1,
                             "final_model": {"identical": False, "max_abs_diff": 1e-7}, "leftover_processes": []}]}
    assert table(report).splitlines()[-1] == "| latency | yes | 0 of 4 | +6 s / - | no (max abs diff 1e-07) | 0 |"


@pytest.mark.parametrize("argv, message", [
    (["deploy-local", "-w", "ws", "--data-root", "d", "--sites", "2", "--faults", "latency"],
     "--faults: got 0 job folders"),
    (["deploy-local", "jobs/fcl_acdc", "-w", "ws", "--data-root", "d", "--sites", "2", "--faults", "lag"],
     "unknown scenario 'lag'"),
    (["deploy-local", "jobs/fcl_acdc", "-w", "ws", "--data-root", "d", "--sites", "2", "--faults", "none",
      "--hold"], "--hold with --faults"),
    (["deploy-local", "jobs/fcl_acdc", "-w", "ws", "--data-root", "d", "--sites", "1", "--faults", "kill-site"],
     "--faults kill-site: acts on site-2, but --sites is 1; use --sites 2 or more"),
])
def test_cli_refuses_a_bad_drill_at_once(argv, message, tmp_path, capsys, monkeypatch):
    from fedssl.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "ws").exists()


def test_training_seconds_run_from_round_0_to_the_last_finished_round(tmp_path):
    from fedssl.ops.drill import training_seconds

    log = tmp_path / "log.txt"
    log.write_text("2026-11-29 06:05:34,721 - ScatterAndGather - INFO - [x] - Round 0 started.\n"
                   "2026-11-29 06:05:42,822 - ScatterAndGather - INFO - [x] - Round 0 finished.\n"
                   "2026-11-29 06:05:43,300 - ScatterAndGather - INFO - [x] - Round 1 started.\n"
                   "2026-11-29 06:05:50,021 - ScatterAndGather - INFO - [x] - Round 1 finished.\n")
    assert training_seconds(str(log)) == 15.3
    log.write_text("2026-11-29 06:05:34,721 - ScatterAndGather - INFO - [x] - Round 0 started.\n")
    assert training_seconds(str(log)) is None and training_seconds(str(tmp_path / "absent.txt")) is None


def test_nothing_starts_after_the_deployment_stopped(tmp_path):
    from fedssl.ops.deploy import LoopbackDeployment

    d = LoopbackDeployment(str(tmp_path / "ws"), n_sites=1, data_root=str(tmp_path))
    d.stop()  # what the drill's main thread does on Ctrl-C while the fault driver waits to restart a site
    with pytest.raises(DeploymentError, match="site-1 not started: the deployment in .* is stopping"):
        d.start_participant("site-1")
    assert d.procs == {}


@pytest.mark.parametrize("kwargs, message", [
    ({"latency_s": -0.1}, "latency_s=-0.1 is not a finite number >= 0"),
    ({"resets": 2.5}, "resets=2.5 is not a whole number"),
    ({"victim_site": "hospital"}, "victim_site='hospital' is not a site name"),
])
def test_drill_settings_are_checked_by_name(kwargs, message):
    from fedssl.ops.drill import DrillSettings

    with pytest.raises(ValueError, match=message):
        DrillSettings(**kwargs)


def test_close_sessions_closes_every_one_even_after_a_broken_one_and_empties_the_box():
    from fedssl.ops.drill import _close_sessions

    closed = []

    class Broken:
        def close(self):
            raise ConnectionError("the server was killed")

    class Fine:
        def close(self):
            closed.append(self)

    box = [Broken(), Fine()]
    _close_sessions(box)
    assert len(closed) == 1 and box == []
