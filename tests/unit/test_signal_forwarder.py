"""An in-process exec's signal forwarding: a signal that arrives while the command starts waits
for it, instead of ending the CLI and leaving the command running with the caller's stdout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from sandboxer.backends.bwrap.enter import _SignalForwarder


def test_a_signal_before_the_command_starts_reaches_it_once_it_has() -> None:
    previous = signal.getsignal(signal.SIGINT)
    forwarder = _SignalForwarder()
    # A command in a session of its own, as the joiner starts it; it reports the signal it gets.
    # Short sleeps: a signal caught just before one long sleep began would wait for its end (the
    # interpreter runs the handler between bytecodes, and the sleep was never interrupted).
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, lambda *_: sys.exit(7))\n"
        "print('ready', flush=True)\n"
        "for _ in range(300):\n"
        "    time.sleep(0.1)"
    )
    command = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert command.stdout is not None
        assert command.stdout.readline() == b"ready\n"
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt here: it waits for the pid
        assert forwarder.pending == [signal.SIGINT]
        assert command.poll() is None
        forwarder.found(command.pid)
        assert command.wait(timeout=10) == 7
        assert forwarder.pending == []
    finally:
        forwarder.restore()
        if command.poll() is None:
            command.kill()
            command.wait()
        assert command.stdout is not None
        command.stdout.close()
    assert signal.getsignal(signal.SIGINT) is previous
