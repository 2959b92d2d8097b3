"""A bwrap the program started (the Python API's create) whose sandbox another process tore
down is still this program's child: it is reaped at the program's exit, never left for Popen's
"still running" warning (stop.keep)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROGRAM = """
import subprocess, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from sandboxer.backends.bwrap import stop
child = subprocess.Popen(["true"])
if sys.argv[2] == "kept":
    stop.keep(child)
else:
    kept_elsewhere = [child]  # held to the end, never waited for
deadline = time.monotonic() + 10
while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
    assert time.monotonic() < deadline
    time.sleep(0.01)
del child
"""


def _run(mode: str) -> str:
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error::ResourceWarning", "-c", PROGRAM, str(REPO), mode],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stderr


def test_a_bwrap_kept_by_stop_is_reaped_when_the_program_exits() -> None:
    assert "is still running" in _run("unkept")  # what the program would say without it
    assert _run("kept") == ""
