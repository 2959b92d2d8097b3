"""The exports directory's accounting (sandboxer.commands.export_space): one budget per caller
across its quarantines and kept exports, and quarantines whose exporter died."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxer.commands.export_space import MIB, Budget, Quarantine, reclaim_abandoned, usage_of
from sandboxer.errors import PolicyError


def test_a_callers_quarantines_and_kept_exports_share_its_budget(tmp_path: Path) -> None:
    budget = Budget(1001, 48, "max_exports_mib")
    first = Quarantine(str(tmp_path), budget)
    first.need(20 * MIB)  # 24 MiB reserved
    kept = tmp_path / "exports" / ("a" * 24)
    kept.mkdir()
    (kept / "summary.json").write_text(json.dumps({"uid": 1001, "bytes": 10 * MIB, "files": []}))
    second = Quarantine(str(tmp_path), budget)  # 8 more: 40 of 48
    with pytest.raises(PolicyError) as refused:
        second.need(9 * MIB)
    assert refused.value.message == (
        "export: uid 1001's export budget of 48 MiB (max_exports_mib) has no room: "
        "32 MiB held by exports under way, 10 MiB by kept exports"
    )
    assert refused.value.status == 3
    other = Quarantine(str(tmp_path), Budget(1002, 16, "the default"))  # another caller's is its own
    other.need(8 * MIB)
    second.remove()
    first.remove()
    other.remove()
    assert usage_of(str(tmp_path / "exports"), 1001).in_flight == 0
    assert sorted(os.listdir(tmp_path / "exports")) == [".lock", "a" * 24]


def test_a_quarantine_is_abandoned_once_its_exporter_is_killed(tmp_path: Path) -> None:
    mine = Quarantine(str(tmp_path), Budget(os.geteuid(), 64, "the default"))
    code = (
        "import sys, time\n"
        "from sandboxer.commands.export_space import Budget, Quarantine\n"
        "held = Quarantine(sys.argv[1], Budget(0, 64, 'the default'))\n"
        "print(held.path, flush=True)\n"
        "time.sleep(600)\n"
    )
    exporter = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert exporter.stdout is not None
    theirs = exporter.stdout.readline().strip()
    assert reclaim_abandoned(str(tmp_path)) == []  # both exporters live
    exporter.send_signal(signal.SIGKILL)
    exporter.communicate()
    assert reclaim_abandoned(str(tmp_path)) == [os.path.basename(theirs)]
    assert not os.path.exists(theirs)
    assert os.path.isdir(mine.path)  # this process still holds its own
    mine.remove()
