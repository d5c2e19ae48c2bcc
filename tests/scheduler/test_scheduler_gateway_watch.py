"""GatewayWatch on a fake clock: a peer is timed from its first message (beat or not),
every message renews it, and one silent past GATEWAY_LOST_AFTER_S is reported once;
the scan runs at most every CHECK_EVERY_S."""

from services.scheduler.gateway_watch import CHECK_EVERY_S, GATEWAY_LOST_AFTER_S, GatewayWatch


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_silent_peer_is_lost_once_after_the_timeout_and_a_talking_one_never():
    clock = Clock()
    watch = GatewayWatch(clock=clock)
    assert GATEWAY_LOST_AFTER_S == 5.0
    watch.heard([b"gateway-a", b"gateway-b"])  # first messages: requests, no beat yet
    reports = []
    for _ in range(20):  # 6 s: b keeps talking, a says nothing
        clock.now += 0.3
        watch.heard([b"gateway-b"])
        reports += [(round(clock.now - 100.0, 1), peer) for peer in watch.expired()]
    assert reports == [(5.1, b"gateway-a")]  # once, the first look past 5 s of silence
    assert b"gateway-a" not in watch and b"gateway-b" in watch
    assert watch.expired() == []  # reported once
    watch.heard([b"gateway-a"])  # back: timed anew
    assert b"gateway-a" in watch and watch.expired() == []


def test_the_scan_is_due_at_most_every_check_interval():
    clock = Clock()
    watch = GatewayWatch(clock=clock)
    assert watch.due() and not watch.due()
    clock.now += CHECK_EVERY_S / 2
    assert not watch.due()
    clock.now += CHECK_EVERY_S / 2
    assert watch.due()
