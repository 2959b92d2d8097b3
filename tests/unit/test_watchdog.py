"""The exec's timeout watchdog (sandboxer.execio.stdio.Watchdog): it kills at the deadline, never
after stop(), and says whether it did."""

from __future__ import annotations

import threading
import time

from sandboxer.execio.stdio import Watchdog


def test_it_kills_at_the_deadline() -> None:
    killed = threading.Event()
    with Watchdog(0.05, killed.set) as watchdog:
        assert killed.wait(5)
    assert watchdog.fired


def test_it_never_kills_after_stop() -> None:
    kills: list[float] = []
    with Watchdog(0.5, lambda: kills.append(time.monotonic())) as watchdog:
        watchdog.stop()  # the exec loop saw the command end (well before the deadline, even on a loaded machine)
        time.sleep(0.8)  # past the deadline
    assert (kills, watchdog.fired) == ([], False)


def test_stop_waits_for_a_kill_under_way() -> None:
    started, release = threading.Event(), threading.Event()

    def slow_kill() -> None:
        started.set()
        release.wait(5)

    with Watchdog(0.01, slow_kill) as watchdog:
        assert started.wait(5)
        stopper = threading.Thread(target=watchdog.stop)
        stopper.start()
        stopper.join(0.1)
        assert stopper.is_alive()  # it waits for the kill
        release.set()
        stopper.join(5)
        assert watchdog.fired


def test_no_timeout_no_timer() -> None:
    with Watchdog(None, lambda: None) as watchdog:
        time.sleep(0.01)
    assert not watchdog.fired
