"""A CLI client's control bytes while its exec runs: signal numbers, and window sizes (exec -t)
that may arrive split across reads."""

from __future__ import annotations

import os
import signal

from sandboxer.execio.stdio import Control
from sandboxer.execio.terminal import winch_message


def test_signals_and_window_sizes_however_they_arrive() -> None:
    read_end, write_end = os.pipe()
    try:
        control = Control(read_end, (24, 80))
        message = winch_message((40, 120))
        os.write(write_end, bytes([signal.SIGINT]) + message[:3])
        assert control.signals() == [signal.SIGINT]
        assert control.size == (24, 80)  # half a message: not yet
        os.write(write_end, message[3:] + bytes([signal.SIGKILL, signal.SIGTERM]))
        assert control.signals() == [signal.SIGTERM]  # SIGKILL is not the client's to send
        assert control.size == (40, 120)
        os.write(write_end, winch_message((0, 0)))  # no size at all: the last one stays
        assert control.signals() == []
        assert control.size == (40, 120)
        os.close(write_end)
        write_end = -1
        assert control.signals() == []
        assert control.gone
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
