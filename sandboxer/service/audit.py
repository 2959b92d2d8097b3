"""The service's audit log: `<state-dir>/audit.log`, one JSON object per line, owner-only.

Each request the service answers is one line: the time, the caller's uid and pid (as the kernel
reported them), the verb, the sandbox id when there is one, the outcome ("ok" or the error's
class) and the status (the CLI's exit status; an exec's own exit status). Never an argv, an
environment value, a file's content, a message or a credential: what a caller sends stays out.

No one account can wipe what others wrote (docs/service.md, "The audit log"):

- Refusals (every outcome but "ok") of an account other than root and the service's own are
  rate-limited per uid: REFUSAL_BURST at once, then REFUSALS_PER_SECOND. Those past it are not
  written one by one but counted, and one line per uid, verb and outcome says how many were
  suppressed (`"suppressed": N`, `"since"`: the first one's time) once SUMMARY_SECONDS have
  passed since the first, or when the service stops.
- Successful requests are written, every one, whoever asked: what was made must stay visible.
- When the log passes `MAX_BYTES` it is rotated (audit.log.1 … audit.log.KEEP). The oldest file
  is not simply dropped: the new audit.log begins with a line (`"verb": "dropped"`) saying how
  many requests of each account it recorded, of which verbs and outcomes, from when to when, and which
  sandboxes those accounts created; a summary line in a dropped file is carried into the next.
  Every line ever written is in the log, or counted in a summary line that names its account.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

MAX_BYTES = 8 * 1024 * 1024
KEEP = 3
REFUSAL_BURST = 60  # refusals of one account written at once, before the rate applies
REFUSALS_PER_SECOND = 1.0  # then this many a second, on average
SUMMARY_SECONDS = 60.0  # suppressed refusals are counted in one line per uid, verb and outcome this often
CREATED_KEPT = 1000  # sandbox ids of one account a dropped file's summary names (the newest); more are counted
CREATE_VERBS = ("create", "cli create")
_IDLE_BUCKETS = 4096  # past this many accounts' buckets, full (idle) ones are forgotten


def _now_text() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class RefusalLimiter:
    """A token bucket per uid: `burst` refusals at once, refilled at `rate` a second."""

    def __init__(self, *, burst: int, rate: float, clock: Callable[[], float]) -> None:
        self.burst = burst
        self.rate = rate
        self.clock = clock
        self._buckets: dict[int, tuple[float, float]] = {}  # uid -> (tokens, when counted)

    def allow(self, uid: int) -> bool:
        now = self.clock()
        tokens, then = self._buckets.get(uid, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[uid] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._buckets) > _IDLE_BUCKETS:
            self._forget_idle(now)
        return allowed

    def _forget_idle(self, now: float) -> None:
        for uid, (tokens, then) in list(self._buckets.items()):
            if tokens + (now - then) * self.rate >= self.burst:
                del self._buckets[uid]


class AuditLog:
    """Appends lines to the state dir's audit.log (0600), rotating it by size; refusals of
    accounts not in `exempt` are rate-limited per uid (the module's docstring)."""

    def __init__(
        self,
        state_dir: str,
        *,
        max_bytes: int = MAX_BYTES,
        keep: int = KEEP,
        exempt: Iterable[int] = (),
        burst: int = REFUSAL_BURST,
        rate: float = REFUSALS_PER_SECOND,
        summary_seconds: float = SUMMARY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = os.path.join(state_dir, "audit.log")
        self.max_bytes = max_bytes
        self.keep = keep
        self.exempt = frozenset(exempt)
        self.summary_seconds = summary_seconds
        self.clock = clock
        self._limiter = RefusalLimiter(burst=burst, rate=rate, clock=clock)
        # (uid, verb, outcome, status) -> [suppressed, the first one's time (text), its clock]
        self._suppressed: dict[tuple[int, str, str, int | None], list[Any]] = {}
        self._lock = threading.Lock()

    def record(
        self,
        *,
        uid: int,
        pid: int,
        verb: str,
        sandbox: str | None,
        outcome: str,
        status: int | None,
        kept: str | None = None,
        fetch: str | None = None,
    ) -> None:
        """One line; `kept`: where the reaper kept a sandbox's work it exported before teardown,
        `fetch`: the command its caller takes it out with. A refusal past its account's rate is
        counted instead (flush writes the count)."""
        entry: dict[str, Any] = {
            "time": _now_text(),
            "uid": uid,
            "pid": pid,
            "verb": verb,
            "sandbox": sandbox,
            "outcome": outcome,
            "status": status,
        }
        if kept is not None:
            entry["kept"] = kept
        if fetch is not None:
            entry["fetch"] = fetch
        with self._lock:
            if outcome != "ok" and uid not in self.exempt and not self._limiter.allow(uid):
                counted = self._suppressed.setdefault((uid, verb, outcome, status), [0, entry["time"], self.clock()])
                counted[0] += 1
                self._flush(everything=False)
                return
            self._flush(everything=False)
            self._write(entry)

    def flush(self, *, everything: bool = False) -> None:
        """Write the summary lines of suppressed refusals whose interval is over (all of them
        with `everything`: the service stops)."""
        with self._lock:
            self._flush(everything=everything)

    def _flush(self, *, everything: bool) -> None:
        now = self.clock()
        for key, (count, since, first) in list(self._suppressed.items()):
            if everything or now - first >= self.summary_seconds:
                del self._suppressed[key]
                uid, verb, outcome, status = key
                line = {"time": _now_text(), "uid": uid, "pid": None, "verb": verb, "sandbox": None}
                self._write({**line, "outcome": outcome, "status": status, "suppressed": count, "since": since})

    def _write(self, entry: dict[str, Any]) -> None:
        self._rotate_if_full()
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(self.path, flags, 0o600)
        try:
            os.write(fd, json.dumps(entry, sort_keys=True).encode() + b"\n")
        finally:
            os.close(fd)

    def _rotate_if_full(self) -> None:
        try:
            if os.lstat(self.path).st_size < self.max_bytes:
                return
        except FileNotFoundError:
            return
        oldest = f"{self.path}.{self.keep}"
        dropped = summary_of(oldest) if os.path.lexists(oldest) else None
        for index in range(self.keep - 1, 0, -1):
            older = f"{self.path}.{index}"
            if os.path.lexists(older):
                os.replace(older, f"{self.path}.{index + 1}")  # the oldest goes here, once summarized
        os.replace(self.path, f"{self.path}.1")
        if dropped:
            self._write(
                {
                    "time": _now_text(),
                    "uid": None,
                    "pid": None,
                    "verb": "dropped",
                    "sandbox": None,
                    "outcome": "rotated",
                    "status": None,
                    "dropped": dropped,
                }
            )


def summary_of(path: str) -> dict[str, dict[str, Any]]:
    """What the log file at `path` holds, by account (uid as text; "service" for lines of no
    account): how many requests its lines record (a line of suppressed refusals: its count), from
    when to when, how many of each "verb outcome", the sandboxes it created (the newest
    CREATED_KEPT; `created_more` counts the rest). A summary line of an earlier dropped file in it
    is added in, so nothing is counted twice or lost."""
    accounts: dict[str, dict[str, Any]] = {}
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    with open(os.open(path, flags), "rb") as log:
        for raw in log:
            try:
                entry = json.loads(raw)
            except ValueError:
                continue  # a line cut short (a full disk, a crash): nothing to count it by
            if not isinstance(entry, dict):
                continue
            if entry.get("verb") == "dropped" and isinstance(entry.get("dropped"), dict):
                for who, earlier in entry["dropped"].items():
                    _add(accounts, str(who), earlier)
                continue
            who = "service" if entry.get("uid") is None else str(entry.get("uid"))
            suppressed = entry.get("suppressed")
            requests = suppressed if isinstance(suppressed, int) else 1  # a summary line: the requests it counts
            created = [entry["sandbox"]] if _created(entry) else []
            verbs = {f"{entry.get('verb')} {entry.get('outcome')}": requests}
            since = entry.get("since") or entry.get("time")
            _add(
                accounts,
                who,
                {"requests": requests, "from": since, "to": entry.get("time"), "verbs": verbs, "created": created},
            )
    return accounts


def _created(entry: dict[str, Any]) -> bool:
    return entry.get("verb") in CREATE_VERBS and entry.get("outcome") == "ok" and isinstance(entry.get("sandbox"), str)


def _add(accounts: dict[str, dict[str, Any]], who: str, part: dict[str, Any]) -> None:
    """Add `part` (one line's count, or an earlier summary's account) into `accounts[who]`."""
    empty: dict[str, Any] = {"requests": 0, "from": None, "to": None, "verbs": {}, "created": [], "created_more": 0}
    total = accounts.setdefault(who, empty)
    total["requests"] += int(part.get("requests", 0))
    if part.get("from") and (total["from"] is None or part["from"] < total["from"]):
        total["from"] = part["from"]
    if part.get("to") and (total["to"] is None or part["to"] > total["to"]):
        total["to"] = part["to"]
    for verb, count in (part.get("verbs") or {}).items():
        total["verbs"][verb] = total["verbs"].get(verb, 0) + int(count)
    total["created"].extend(part.get("created") or [])
    total["created_more"] += int(part.get("created_more", 0))
    if len(total["created"]) > CREATED_KEPT:
        total["created_more"] += len(total["created"]) - CREATED_KEPT
        del total["created"][:-CREATED_KEPT]
