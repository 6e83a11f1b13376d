"""The simulator log reader: real failures count, a duplicate result FLARE re-sent does not."""

from fedssl.ops.simulate import FailureLog

LOG = """\
2026-11-23 14:00:07,311 - INFO - Contribution from site-1 ACCEPTED by the aggregator at round 0.
2026-11-23 14:00:15,462 - WARNING - site-3 already contributed to round 0; duplicate discarded
2026-11-23 14:00:15,463 - INFO - Contribution from site-3 REJECTED by the aggregator at round 0.
2026-11-23 14:00:16,000 - INFO - Contribution from site-2 REJECTED by the aggregator at round 0.
2026-11-23 14:00:17,000 - ERROR - site-2: task train failed: site-2: no Info.cfg in /data/patient001
2026-11-23 14:00:18,000 - INFO - Contribution from site-3 REJECTED by the aggregator at round 1.
"""


def test_duplicates_are_not_failures_but_rejections_and_task_errors_are():
    log = FailureLog()
    for line in LOG.splitlines():
        log.read(line)
    assert log.duplicates == 1
    assert log.failures == ["REJECTED by the aggregator at round 0.",
                            "task train failed: site-2: no Info.cfg in /data/patient001",
                            "REJECTED by the aggregator at round 1."]  # site-3's round 1: no duplicate announced
