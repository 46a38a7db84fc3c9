"""What a reconciliation run reads of the topics (spark/sources.plan_topics), from the
last run's watermark, the window's op records and the partitions' ends."""

from __future__ import annotations

from outbox.spark.kafka_source import OffsetRange
from outbox.spark.sources import plan_topics


def test_a_run_reads_from_the_last_runs_end_and_the_windows_first_op_record() -> None:
    plan = plan_topics({("t", 0): 50, ("t", 1): 30}, {("t", 0): 35}, {"t": {"0": 40, "1": 30}},
                       from_beginning=False)
    assert plan.ranges == [OffsetRange("t", 0, 35, 50)]
    assert plan.fresh_from == {("t", 0): 40, ("t", 1): 30}
    assert plan.read_to == {"t": {"0": 50, "1": 30}}
    assert plan.rewound == []


def test_a_partition_that_ends_before_the_last_runs_end_is_read_from_its_start() -> None:
    """The topic was deleted and recreated (or the broker lost records): its offsets start
    again below where the last run stopped. The run read nothing new of it (fresh from the
    old end), so stray records on the new log were missed, and the watermark dropped
    silently. Now all of it is new, and the plan names it."""
    plan = plan_topics({("t", 0): 12, ("t", 1): 90}, {("t", 0): 5},
                       {"t": {"0": 40, "1": 80}}, from_beginning=False)
    assert plan.ranges == [OffsetRange("t", 0, 0, 12), OffsetRange("t", 1, 80, 90)]
    assert plan.fresh_from == {("t", 0): 0, ("t", 1): 80}
    assert plan.rewound == [("t", 0, 40, 12)]
    assert plan.read_to == {"t": {"0": 12, "1": 90}}


def test_records_left_to_a_tables_only_run_are_read_again_and_only_checked() -> None:
    """After tables-only runs the plan reads again from where the last topic run's records
    of later windows begin (``recheck``); they stay not fresh (their strays were reported),
    and a position at or after the last run's end changes nothing."""
    plan = plan_topics({("t", 0): 50, ("t", 1): 30, ("t", 2): 9}, {},
                       {"t": {"0": 40, "1": 30, "2": 9}}, from_beginning=False,
                       recheck={("t", 0): 33, ("t", 1): 31})
    assert plan.ranges == [OffsetRange("t", 0, 33, 50)]
    assert plan.fresh_from == {("t", 0): 40, ("t", 1): 30, ("t", 2): 9}
    assert plan.recheck_from == {("t", 0): 33, ("t", 1): 30, ("t", 2): 9}
    assert plan.read_from() == {("t", 0): 33, ("t", 1): 30, ("t", 2): 9}


def test_a_partition_that_begins_with_another_record_is_read_from_its_start() -> None:
    """Deleted and recreated, and written again past where the last run stopped: its end
    alone does not show it. Its first record does: an earlier offset (partition 0), or the
    same offset written at another time (1). One that begins later lost its first records
    to retention (2); one asked about for the first time (3) has nothing to compare with.
    The heads handed on are the ones found, and the last run's of partitions not asked
    about (u)."""
    before = {("t", 0): (7, 1000), ("t", 1): (0, 1000), ("t", 2): (0, 1000), ("u", 0): (0, 5)}
    now = {("t", 0): (0, 2000), ("t", 1): (0, 2000), ("t", 2): (30, 3000), ("t", 3): (0, 9)}
    plan = plan_topics({("t", p): 60 for p in range(4)}, {},
                       {"t": {"0": 50, "1": 50, "2": 50, "3": 50}}, from_beginning=False,
                       heads=now, heads_before=before)
    assert plan.rewound == [("t", 0, 50, 60), ("t", 1, 50, 60)]
    assert plan.ranges == [OffsetRange("t", 0, 0, 60), OffsetRange("t", 1, 0, 60),
                           OffsetRange("t", 2, 50, 60), OffsetRange("t", 3, 50, 60)]
    assert plan.fresh_from == {("t", 0): 0, ("t", 1): 0, ("t", 2): 50, ("t", 3): 50}
    assert plan.heads == {**now, ("u", 0): (0, 5)}
    same = plan_topics({("t", 0): 60}, {}, {"t": {"0": 50}}, from_beginning=False,
                       heads={("t", 0): (7, 1000)}, heads_before=before)
    assert same.rewound == [] and same.fresh_from == {("t", 0): 50}
