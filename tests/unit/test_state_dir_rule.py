"""The state dir rule (sandboxer.dirs.state_dir_problem): the broker keeps sandboxes only in a
directory of the running account's own, owner-only, below directories nobody else may change —
its records say what teardown and gc remove and signal. Real directories, owners and modes (the
test runs as root and hands them to other uids with chown)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandboxer.dirs import require_state_dir, state_dir_problem
from sandboxer.errors import PolicyError

USER = 54321  # an account the test only names: ownership is the kernel's, no login needed
OTHER = 54322

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="hands directories to other uids (CI runs as root)")


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A directory above the state dirs: root's, 0755, as a home's parent is."""
    tmp_path.chmod(0o755)
    for parent in tmp_path.parents:  # pytest's own directories above are root's 0700: open them to the uids
        if parent == Path("/tmp"):
            break
        parent.chmod(0o755)
    return tmp_path


def _dir(path: Path, *, owner: int, mode: int) -> Path:
    path.mkdir()
    os.chown(path, owner, owner)
    path.chmod(mode)
    return path


def test_an_own_owner_only_state_dir_is_taken(base: Path) -> None:
    home = _dir(base / "home", owner=USER, mode=0o755)
    state = _dir(home / "state", owner=USER, mode=0o700)
    assert state_dir_problem(str(state), euid=USER) is None


def test_roots_state_dir_may_be_passable(base: Path) -> None:
    state = _dir(base / "state", owner=0, mode=0o711)
    assert state_dir_problem(str(state), euid=0) is None
    state.chmod(0o755)
    assert (
        state_dir_problem(str(state), euid=0)
        == f"state dir {state}: mode 0755, must be 0711 (no access for group or others)"
    )


def test_another_accounts_state_dir_is_refused(base: Path) -> None:
    state = _dir(base / "state", owner=OTHER, mode=0o700)
    problem = state_dir_problem(str(state), euid=USER)
    assert problem == f"state dir {state}: owned by uid {OTHER}, must be this account's (uid {USER})"
    # Root too: a directory another account made is never root's state.
    assert (
        state_dir_problem(str(state), euid=0)
        == f"state dir {state}: owned by uid {OTHER}, must be this account's (uid 0)"
    )


@pytest.mark.parametrize("mode", [0o710, 0o701, 0o750, 0o770, 0o777, 0o711])
def test_a_state_dir_open_to_others_is_refused(base: Path, mode: int) -> None:
    state = _dir(base / "state", owner=USER, mode=mode)
    problem = state_dir_problem(str(state), euid=USER)
    assert problem == f"state dir {state}: mode {mode:04o}, must be 0700 (no access for group or others)"


def test_a_symlink_or_file_is_no_state_dir(base: Path) -> None:
    real = _dir(base / "real", owner=USER, mode=0o700)
    link = base / "link"
    link.symlink_to(real)
    os.lchown(link, USER, USER)
    assert state_dir_problem(str(link), euid=USER) == f"state dir {link}: is a symlink, must be a directory"
    file = base / "file"
    file.write_bytes(b"")
    os.chown(file, USER, USER)
    assert state_dir_problem(str(file), euid=USER) == f"state dir {file}: is a file, must be a directory"


def test_a_directory_above_of_another_account_is_refused(base: Path) -> None:
    theirs = _dir(base / "theirs", owner=OTHER, mode=0o755)
    state = _dir(theirs / "state", owner=USER, mode=0o700)
    problem = state_dir_problem(str(state), euid=USER)
    assert (
        problem
        == f"state dir {state}: the directory {theirs} above it is owned by uid {OTHER}, not by root or this account"
    )


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777])
def test_a_directory_above_writable_by_others_is_refused(base: Path, mode: int) -> None:
    shared = _dir(base / "shared", owner=0, mode=mode)
    state = _dir(shared / "state", owner=USER, mode=0o700)
    problem = state_dir_problem(str(state), euid=USER)
    assert problem == (
        f"state dir {state}: the directory {shared} above it is writable by others (mode {mode:04o}, not sticky)"
    )


def test_a_sticky_directory_above_is_taken(base: Path) -> None:
    """As /tmp: others may make names there, never rename or remove this account's."""
    sticky = _dir(base / "sticky", owner=0, mode=0o1777)
    state = _dir(sticky / "state", owner=USER, mode=0o700)
    assert state_dir_problem(str(state), euid=USER) is None
    # ... but a directory another account made there is theirs.
    planted = _dir(sticky / "planted", owner=OTHER, mode=0o755)
    assert state_dir_problem(str(planted / "state"), euid=USER) == (
        f"state dir {planted / 'state'}: the directory {planted} above it is owned by uid {OTHER}, "
        "not by root or this account"
    )


def test_a_state_dir_not_made_yet_is_judged_by_what_is_above(base: Path) -> None:
    home = _dir(base / "home", owner=USER, mode=0o755)
    assert state_dir_problem(str(home / "a" / "b" / "state"), euid=USER) is None
    theirs = _dir(base / "theirs", owner=OTHER, mode=0o755)
    assert state_dir_problem(str(theirs / "a" / "state"), euid=USER) == (
        f"state dir {theirs / 'a' / 'state'}: the directory {theirs} above it is owned by uid {OTHER}, "
        "not by root or this account"
    )


def test_a_symlink_on_the_way_must_be_root_or_the_accounts(base: Path) -> None:
    """Whoever owns a link can point it elsewhere later: another account's link in a sticky
    directory (as /tmp) is refused; root's or the account's own is followed and what it points to
    judged."""
    sticky = _dir(base / "sticky", owner=0, mode=0o1777)
    home = _dir(base / "home", owner=USER, mode=0o755)
    _dir(home / "state", owner=USER, mode=0o700)
    theirs = sticky / "theirs"
    theirs.symlink_to(home)
    os.lchown(theirs, OTHER, OTHER)
    assert state_dir_problem(str(theirs / "state"), euid=USER) == (
        f"state dir {theirs / 'state'}: the symlink {theirs} on its way is owned by uid {OTHER}"
    )
    own = sticky / "own"
    own.symlink_to(home)
    os.lchown(own, USER, USER)
    assert state_dir_problem(str(own / "state"), euid=USER) is None
    # A link to another account's directory: judged where it leads.
    elsewhere = _dir(base / "elsewhere", owner=OTHER, mode=0o755)
    _dir(elsewhere / "state", owner=USER, mode=0o700)
    roots = base / "roots"
    roots.symlink_to(elsewhere)
    assert state_dir_problem(str(roots / "state"), euid=USER) == (
        f"state dir {roots / 'state'}: the directory {elsewhere} above it is owned by uid {OTHER}, "
        "not by root or this account"
    )


def test_the_refusal_names_the_rule(base: Path) -> None:
    state = _dir(base / "state", owner=OTHER, mode=0o700)
    with pytest.raises(PolicyError) as raised:
        require_state_dir(str(state))
    assert raised.value.status == 3
    assert str(raised.value) == (
        f"state dir {state}: owned by uid {OTHER}, must be this account's (uid 0) (hint: a state dir must be this "
        "account's own directory, mode 0700 (root's may be 0711), below directories owned by root or this account "
        "that nobody else may write to (unless sticky, as /tmp); docs/security.md)"
    )
