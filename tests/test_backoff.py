"""The delay before a down tier is probed again (core/tiers/backoff.py), with explicit
times: doubling on failed probes and early falls, starting over after long service."""

from __future__ import annotations

from hybridkv.core.tiers.backoff import RESET_AFTER, Backoff


def test_failed_probes_double_the_delay_up_to_the_maximum():
    b = Backoff(0.5, 4.0)
    assert [b.delay(None) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_a_fall_soon_after_coming_up_keeps_doubling():
    b = Backoff(0.5, 30.0)
    assert b.delay(100.0) == 0.5  # the first fall
    assert b.delay(None) == 1.0  # its probe failed
    assert b.delay(RESET_AFTER * 1.0) == 2.0  # up no longer than 4 x the last delay
    assert b.delay(0.1) == 4.0


def test_a_fall_after_long_enough_service_starts_over():
    b = Backoff(0.5, 30.0)
    for _ in range(4):
        b.delay(None)  # 0.5, 1, 2, 4
    assert b.delay(RESET_AFTER * 4.0 + 0.01) == 0.5
    assert b.delay(RESET_AFTER * 0.5 + 0.01) == 0.5  # a stall every few seconds: first again


def test_after_the_maximum_delay_service_of_the_maximum_is_enough():
    b = Backoff(0.5, 8.0)
    for _ in range(6):
        b.delay(None)  # reaches 8 s
    assert b.delay(8.0) == 8.0  # not longer than the maximum
    assert b.delay(8.01) == 0.5  # longer: first again, not only after 4 x 8 s
