"""GCPolicy: full collections off the hot path, run when idle, every pause timed."""

import gc

from tokenmill.serve.gc_policy import OUT_OF_REACH, GCPolicy


class Node:
    def __init__(self):
        self.other = self  # a reference cycle: only the collector frees it


def test_no_automatic_full_collection_then_one_when_idle():
    policy = GCPolicy(min_interval_s=0.0)
    before = gc.get_threshold()
    policy.start()
    try:
        assert gc.get_threshold()[2] == OUT_OF_REACH and gc.get_freeze_count() > 0
        full_before = gc.get_stats()[2]["collections"]
        for _ in range(200):  # many young collections promote objects, yet no full one runs
            [Node() for _ in range(2000)]
        assert gc.get_stats()[2]["collections"] == full_before
        policy.take_pauses()
        policy.on_idle()  # due: objects reached the old generation
        assert gc.get_stats()[2]["collections"] == full_before + 1 and policy.num_full == 1
        pauses = policy.take_pauses()
        assert any(g == 2 and s >= 0 for g, s in pauses)
        assert policy.take_pauses() == []
    finally:
        policy.stop()
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_a_long_busy_stretch_still_collects():
    policy = GCPolicy(min_interval_s=0.0, max_interval_s=0.0)
    policy.start()
    try:
        policy.on_busy()
        assert policy.num_full == 1
    finally:
        policy.stop()
