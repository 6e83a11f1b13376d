import os

import pytest

from fedssl.experiments.overhead import PHASES, format_overhead, round_phases, run_overhead

PREFIX = "[identity=simulator_server, run=simulate_job, wf=scatter_and_gather] - "
LOG = [
    ("10:00:00,000", "ScatterAndGather", "Round 0 started."),
    ("10:00:03,000", "ServerRunner", "sent task assignment to client. client_name:site-1 task_id:a"),
    ("10:00:08,500", "ScatterAndGather", "Contribution from site-1 ACCEPTED by the aggregator at round 0."),
    ("10:00:08,750", "ScatterAndGather", "Start aggregation."),
    ("10:00:08,760", "ScatterAndGather", "Round 0 finished."),
    ("10:00:09,060", "ScatterAndGather", "Round 1 started."),
    ("10:00:10,460", "ServerRunner", "sent task assignment to client. client_name:site-1 task_id:b"),
    ("10:00:15,460", "ScatterAndGather", "Contribution from site-1 ACCEPTED by the aggregator at round 1."),
    ("10:00:15,700", "ScatterAndGather", "Start aggregation."),
    ("10:00:15,720", "ScatterAndGather", "Round 1 finished."),
]


def test_round_phases_from_the_server_log_by_hand(tmp_path):
    log = tmp_path / "log.txt"
    lines = [f"2026-11-26 {t} - {who} - INFO - {PREFIX}{msg}" for t, who, msg in LOG]
    lines.insert(3, "a line without a timestamp")
    log.write_text("\n".join(lines) + "\n")
    r0, r1 = round_phases(str(log))
    assert r0["waiting_for_task_request"] == pytest.approx(3.0) and r0["site_round_trip"] == pytest.approx(5.5)
    assert r0["result_to_aggregation"] == pytest.approx(0.25) and r0["aggregation_and_persist"] == pytest.approx(0.01)
    assert r0["round_transition"] == pytest.approx(0.3)  # round 0 finished -> round 1 started
    assert r1["waiting_for_task_request"] == pytest.approx(1.4) and r1["site_round_trip"] == pytest.approx(5.0)
    assert r1["round_transition"] is None  # no round 2


def test_the_printed_table_names_every_phase():
    r = {"job": "j", "profile": "quick", "device": "cpu", "parameters": 490000, "message_mb": 1.9, "rounds": 5,
         "bare_round_s": 3.9, "flare_round_s": 6.5, "ratio_flare_to_bare": 1.67, "training_throughput_vs_bare": 0.987,
         "site_train_round_s_in_flare": 3.95,
         "site_other_s": 0.4, "phases_s": dict.fromkeys(PHASES, 0.5), "startup_and_shutdown_s": 20.0,
         "in_process_s": {"serialise_both_directions": 0.02, "meters": 0.01, "aggregate_one_site": 0.003,
                          "site_validation_and_checkpoint": 0.12}}
    text = format_overhead(r)
    assert ("1.67x bare" in text and "98.7 % of the bare loop" in text and "site waits to ask for the task" in text
            and "of which train_round" in text)


@pytest.mark.parametrize("job, why", [("surgical_cxr", "registration round"), ("feddra_mimic", "federated vocabulary")])
def test_jobs_whose_sites_need_a_handshake_are_refused_with_the_reason_before_any_work(job, why, tmp_path):
    with pytest.raises(ValueError, match=f"{job} is not supported: .*{why}"):
        run_overhead(str(tmp_path / "out"), job=job)
    assert not os.path.exists(tmp_path / "out" / "data")
