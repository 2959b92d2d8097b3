"""What `list`, `inspect`, `usage`, `work` and `extend` print without --json: readable lines a
person (or an agent reading a terminal) takes in at a glance, never a Python repr."""

from __future__ import annotations

import json
import re

from tests.integration.conftest import SandboxBroker

REPR = re.compile(r"None|True|False|\{'|\[\{|MappingProxy|\(\)")


def test_the_watching_commands_print_readable_text(sb_root: SandboxBroker) -> None:
    broker = sb_root
    sandbox = broker.create()
    committed = broker.sh(sandbox, "echo x > x && git add x && git commit -qm x && echo y > y")
    assert committed.status == 0, committed.stderr

    listed = broker.run("list")
    assert listed.status == 0, listed.stderr
    header, line = listed.stdout.splitlines()
    assert header.split() == ["ID", "PROFILE", "BACKEND", "STATUS", "CALLER", "AGE", "LEFT", "WORK"]
    assert re.fullmatch(rf"{sandbox}\s+{broker.profile}\s+bwrap\s+running\s+root\s+\d+s\s+-\s+\+1 commit, dirty", line)
    quiet = json.loads(broker.run("list", "--no-work", "--json").stdout)["sandboxes"]
    assert [(entry["id"], entry["work"]) for entry in quiet] == [(sandbox, None)]

    work = broker.run("work", sandbox)
    assert work.status == 0, work.stderr
    assert work.stdout.splitlines()[0].endswith(" on main: +1 commit, dirty")
    assert "not exported: changes not committed" in work.stdout

    usage = broker.run("usage", sandbox)
    assert usage.status == 0, usage.stderr
    keys = [line.split(":", 1)[0] for line in usage.stdout.splitlines()]
    assert keys == ["memory", "processes", "cpu time", "workspace", "state", "tmp", "counted from"]
    first = usage.stdout.splitlines()[0]
    assert re.fullmatch(r"memory: [\d.]+ (B|KiB|MiB) now, [\d.]+ (KiB|MiB) at most, of 2\.0 GiB", first)

    inspected = broker.run("inspect", sandbox)
    assert inspected.status == 0, inspected.stderr
    lines = inspected.stdout.splitlines()
    assert lines[0] == f"{sandbox}: profile {broker.profile}, bwrap, running; matches its plan"
    assert lines[1] == "usage:"
    assert any(re.fullmatch(r"mounts\[\d+\]\.target: /workspace", line) for line in lines), lines
    assert "limits.cpus: -" in lines
    assert not [line for line in lines if REPR.search(line)]

    endless = broker.run("extend", sandbox, "60")
    assert (endless.status, endless.stdout) == (2, "")
    assert endless.stderr == f"sandboxer: extend: sandbox {sandbox} has no end to its lifetime (made without --ttl)\n"
    assert broker.run("teardown", "--discard", sandbox).status == 0
    broker.created.remove(sandbox)


def test_list_asks_several_sandboxes_git_at_once_and_keeps_each_ones_work(sb_root: SandboxBroker) -> None:
    """list asks up to four sandboxes' git at a time: each line still has its own sandbox's work."""
    broker = sb_root
    made = [broker.create() for _ in range(5)]
    for commits, sandbox in enumerate(made):
        script = "".join(f"echo {n} > f{n} && git add f{n} && git commit -qm c{n} && " for n in range(commits))
        worked = broker.sh(sandbox, script + "true")
        assert worked.status == 0, worked.stderr
    listed = json.loads(broker.run("list", "--json").stdout)["sandboxes"]
    quiet = json.loads(broker.run("list", "--no-work", "--json").stdout)["sandboxes"]
    assert [entry["id"] for entry in listed] == [entry["id"] for entry in quiet]  # the same order
    commits_of = {entry["id"]: entry["work"]["commits"] for entry in listed}
    assert [commits_of[sandbox] for sandbox in made] == [0, 1, 2, 3, 4]
    for sandbox in made:
        assert broker.run("teardown", "--discard", sandbox).status == 0
        broker.created.remove(sandbox)
