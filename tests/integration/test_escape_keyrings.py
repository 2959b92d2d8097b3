"""Escape probes: the kernel keyrings. Keyrings are not namespaced, so a key the caller (or the
creator of the sandbox) holds in its session keyring must stay out of the sandbox's reach.

Before the CLI runs, a small wrapper joins a new session keyring, adds a `user` key with a secret
payload to it and only then executes the CLI, which inherits that keyring: the caller's (for an
`exec`) or the creator's (for a `create`). Inside, every keyring call is refused by the syscall
policy, and every exec starts in a fresh session keyring besides; /proc/keys, which lists the
keys a process may view without any syscall of the keyring family, must not show the planted
key either.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import Result
from tests.integration.conftest import SandboxBroker
from tests.integration.test_escape_support import PRELUDE, SYSTEM_PYTHON, Box, answer, box_fixture, variant_of

box = box_fixture()

CALLER_KEY = "sandboxer-escape-caller-key"
CREATOR_KEY = "sandboxer-escape-creator-key"
KEY_SECRET = "keyring-secret-0c4e71"
KEY_MARK = "@KEY@"  # replaced in the CLI's argv by the planted key's serial
SESSION_MARK = "@SESSION@"  # … and by the serial of the session keyring holding it

# Join a new session keyring, plant a key, put the serials into argv, execute the CLI.
PLANT = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
KEYCTL_GET_KEYRING_ID, KEYCTL_JOIN_SESSION_KEYRING, KEY_SPEC_SESSION_KEYRING = 0, 1, -3
if libc.syscall(250, KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
    raise OSError(ctypes.get_errno(), "keyctl(JOIN_SESSION_KEYRING)")
description, secret = sys.argv[1].encode(), sys.argv[2].encode()
key = libc.syscall(248, b"user", description, secret, len(secret), ctypes.c_long(KEY_SPEC_SESSION_KEYRING))
if key < 0:
    raise OSError(ctypes.get_errno(), "add_key")
session = libc.syscall(250, KEYCTL_GET_KEYRING_ID, ctypes.c_long(KEY_SPEC_SESSION_KEYRING), 0)
argv = [a.replace("@KEY@", str(key)).replace("@SESSION@", str(session)) for a in sys.argv[3:]]
sys.stderr.write(f"planted {key} {session}\n")
sys.stderr.flush()
os.execv(argv[0], argv)
"""


def planted_run(broker: SandboxBroker, description: str, *args: str) -> tuple[Result, int, int]:
    """Run the CLI with a key planted in its session keyring: (result, key serial, keyring serial)."""
    argv = broker.argv(*args)
    at = argv.index(sys.executable)
    argv[at:at] = [sys.executable, "-c", PLANT, description, KEY_SECRET]
    proc = subprocess.run(argv, capture_output=True, env=broker.env(), check=False, timeout=120)
    stderr = proc.stderr.decode(errors="replace")
    first, _, rest = stderr.partition("\n")
    words = first.split()
    assert words[:1] == ["planted"], stderr
    return Result(proc.returncode, proc.stdout.decode(errors="replace"), rest), int(words[1]), int(words[2])


def planted_probe(box: Box, code: str) -> Result:
    """A Python probe run by an exec whose caller holds CALLER_KEY (@KEY@, @SESSION@ in argv)."""
    result, _, _ = planted_run(
        box.broker,
        CALLER_KEY,
        "exec",
        box.sandbox_id,
        "--",
        SYSTEM_PYTHON,
        "-c",
        PRELUDE + code,
        KEY_MARK,
        SESSION_MARK,
    )
    return result


KEY = "int(sys.argv[1])"
SESSION = "int(sys.argv[2])"
BUFFER = "ctypes.create_string_buffer(256)"

# (probe id, expression, refusal): keyctl(2) is 250, add_key(2) 248, request_key(2) 249.
KEYRING_CALLS = [
    ("read-caller-key", f"syscall(250, 11, {KEY}, {BUFFER}, 256)", "EPERM"),
    ("describe-caller-key", f"syscall(250, 6, {KEY}, {BUFFER}, 256)", "EPERM"),
    ("link-caller-key", f"syscall(250, 8, {KEY}, -3)", "EPERM"),
    ("read-caller-session-keyring", f"syscall(250, 11, {SESSION}, {BUFFER}, 256)", "EPERM"),
    ("join-caller-session-keyring", "syscall(250, 1, b'_ses')", "EPERM"),
    ("session-keyring-id", "syscall(250, 0, -3, 0)", "EPERM"),
    ("user-keyring-id", "syscall(250, 0, -4, 0)", "EPERM"),
    ("user-session-keyring-id", "syscall(250, 0, -5, 0)", "EPERM"),
    ("search-session", f"syscall(250, 10, -3, b'user', b'{CALLER_KEY}', 0)", "EPERM"),
    ("search-user", f"syscall(250, 10, -4, b'user', b'{CALLER_KEY}', 0)", "EPERM"),
    ("add-key", "syscall(248, b'user', b'planted-inside', b'x', 1, -3)", "EPERM"),
    ("request-key", f"syscall(249, b'user', b'{CALLER_KEY}', 0, 0)", "EPERM"),
]


@pytest.mark.parametrize(("expression", "refusal"), [pytest.param(e, r, id=p) for p, e, r in KEYRING_CALLS])
def test_keyring_call_is_refused(box: Box, expression: str, refusal: str) -> None:
    assert answer(planted_probe(box, f"print({expression})")) == refusal


# What /proc/keys shows the exec of the keys above: it lists every key the reader may view,
# whoever's keyring holds it, with no syscall of the keyring family.
PROC_KEYS = """
try:
    listing = open("/proc/keys").read()
except OSError as exc:
    listing = ""
serials = {f"{int(value):08x}" for value in sys.argv[1:3]}
seen = [line.split()[0] for line in listing.splitlines() if line.split()[0] in serials]
named = [word for word in sys.argv[3:] if word in listing]
print("visible:", sorted(seen), "named:", named)
"""


def test_proc_keys_does_not_show_the_callers_keys(box: Box) -> None:
    assert answer(planted_probe(box, PROC_KEYS.replace("sys.argv[3:]", f"[{CALLER_KEY!r}]"))) == "visible: [] named: []"


def test_creators_session_keyring_stays_out_of_the_sandbox(sbx: SandboxBroker) -> None:
    """The create command's session keyring holds a key: bwrap, its init and the holder start in
    a fresh session keyring, so nothing an exec inherits (or can search) leads to it."""
    created, key, session = planted_run(sbx, CREATOR_KEY, "create", "--profile", sbx.profile)
    assert created.status == 0, created.stderr
    own = Box(broker=sbx, variant=variant_of(sbx), sandbox_id=created.stdout.strip())
    sbx.created.append(own.sandbox_id)
    calls = f"""
buffer = ctypes.create_string_buffer(256)
print(syscall(250, 11, {key}, buffer, 256), syscall(250, 11, {session}, buffer, 256),
      syscall(250, 10, -3, b"user", b"{CREATOR_KEY}", 0), syscall(249, b"user", b"{CREATOR_KEY}", 0, 0),
      {KEY_SECRET!r}.encode() in buffer.raw)
"""
    assert answer(own.py(calls)) == "EPERM EPERM EPERM EPERM False"
    listing = PROC_KEYS.replace("sys.argv[1:3]", f"[{key}, {session}]").replace("sys.argv[3:]", f"[{CREATOR_KEY!r}]")
    assert answer(own.py(listing)) == "visible: [] named: []"
