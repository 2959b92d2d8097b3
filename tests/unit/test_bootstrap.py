"""Runtime bootstrap documents (sandboxer.core.bootstrap): every rule has a case breaking it alone.

Each invalid case starts from a complete valid document and changes exactly one thing: a field's
value, a key, or the raw bytes (duplicates, trailing data, NaN and size are written as raw JSON
text). Every error is checked for its class and its field path, never its wording; and no error
may carry a submitted value (a seeded random corpus of mutated documents, each with a distinctive
credential, checks that). `load` adds the file rules: absolute path, a regular file that is not
a symlink, owner-only permissions.
"""

from __future__ import annotations

import json
import os
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sandboxer.core.bootstrap import MAX_BYTES, BootstrapError, load, parse
from sandboxer.errors import UsageError

FILE = "/home/runtime/runtime-bootstrap.json"
CREDENTIAL = "dcred_7Hq2ZkP9wXv4Lm8NbR3sTy6U"
DEVICE = "0f6e8a3c-5b1d-4c2e-9a7f-1e2d3c4b5a69"
ENVIRONMENT = "8c1d2e3f-4a5b-4c6d-8e7f-90a1b2c3d4e5"
SESSION = "b2c3d4e5-f6a7-4b8c-9d0e-1f2a3b4c5d6e"
CORE_URL = "https://core.example.com/api/v1"
ZERO_UUID = "00000000-0000-0000-0000-000000000000"
KEYS = (
    "version",
    "core_url",
    "device_id",
    "credential",
    "environment_id",
    "session_id",
    "workspace",
    "suspend_control",
)


def valid_doc(credential: str = CREDENTIAL) -> dict[str, Any]:
    """A complete valid bootstrap document (a new dict each time)."""
    return {
        "version": "1",
        "core_url": CORE_URL,
        "device_id": DEVICE,
        "credential": credential,
        "environment_id": ENVIRONMENT,
        "session_id": SESSION,
        "workspace": "/workspace",
        "suspend_control": False,
    }


def render(doc: dict[str, Any]) -> bytes:
    """The document as compact JSON text (non-ASCII kept as UTF-8)."""
    return json.dumps(doc, ensure_ascii=False).encode()


def body(doc: dict[str, Any]) -> str:
    """The members of the object without its braces: `"version": "1", ...`."""
    return render(doc).decode()[1:-1]


def padded_to(size: int, doc: dict[str, Any] | None = None) -> bytes:
    """A valid document of exactly `size` bytes: spaces after the opening brace."""
    text = render(doc or valid_doc())
    assert len(text) <= size
    return b"{" + b" " * (size - len(text)) + text[1:]


def with_value(key: str, value: Any) -> bytes:
    doc = valid_doc()
    doc[key] = value
    return render(doc)


def without(key: str) -> bytes:
    doc = valid_doc()
    del doc[key]
    return render(doc)


def renamed(key: str, alias: str) -> bytes:
    """The document with `key` written as `alias` (same value, same place)."""
    doc = valid_doc()
    return render({alias if k == key else k: v for k, v in doc.items()})


def plus(member: str) -> bytes:
    """The valid document with one raw member appended inside the object."""
    return ("{" + body(valid_doc()) + ", " + member + "}").encode()


def raw_value(key: str, raw: str) -> bytes:
    """The document with `key`'s value written as raw JSON text."""
    doc = valid_doc()
    del doc[key]
    return ("{" + body(doc) + f', "{key}": {raw}' + "}").encode()


# --------------------------------------------------------------------------------------------
# Valid variants.

VALID: dict[str, bytes] = {
    "the base document": render(valid_doc()),
    "core_url http": with_value("core_url", "http://core.example.com/api/v1"),
    "core_url https": with_value("core_url", "https://core.example.com/api/v1"),
    "core_url with a port": with_value("core_url", "https://core.example.com:8443/api/v1"),
    "core_url with an IP and port": with_value("core_url", "http://127.0.0.1:8080/api/v1"),
    "core_url with a prefix path": with_value("core_url", "https://core.example.com/prefix/api/v1"),
    "workspace /": with_value("workspace", "/"),
    "workspace deeper": with_value("workspace", "/home/runtime/workspace"),
    "suspend_control true": with_value("suspend_control", True),
    "keys in another order": render(dict(reversed(list(valid_doc().items())))),
    "pretty-printed with a final newline": json.dumps(valid_doc(), indent=2).encode() + b"\n",
    "credential with punctuation": with_value("credential", "a.b-c_d~e+f/g=h:i%j"),
    "non-ASCII credential": with_value("credential", "clé-ключ-鍵"),
    "escaped slashes in core_url": raw_value("core_url", '"https:\\/\\/core.example.com\\/api\\/v1"'),
    "exactly MAX_BYTES, padded with spaces": padded_to(MAX_BYTES),
    "exactly MAX_BYTES, a long credential": with_value(
        "credential",
        "k" * (MAX_BYTES - len(render(valid_doc("")))),
    ),
}


def test_max_bytes_is_16_kib() -> None:
    assert MAX_BYTES == 16384


def test_size_fixtures_are_exact() -> None:
    assert len(VALID["exactly MAX_BYTES, padded with spaces"]) == MAX_BYTES
    assert len(VALID["exactly MAX_BYTES, a long credential"]) == MAX_BYTES
    assert len(padded_to(MAX_BYTES + 1)) == MAX_BYTES + 1


@pytest.mark.parametrize("name", list(VALID))
def test_valid(name: str) -> None:
    data = VALID[name]
    parsed = parse(data, file=FILE)
    expected = json.loads(data)
    assert parsed.version == "1"
    assert parsed.core_url == expected["core_url"]
    assert parsed.device_id == DEVICE
    assert parsed.environment_id == ENVIRONMENT
    assert parsed.session_id == SESSION
    assert parsed.workspace == expected["workspace"]
    assert parsed.suspend_control is expected["suspend_control"]


# --------------------------------------------------------------------------------------------
# Invalid documents: (bytes, field path of the error).

INVALID: dict[str, tuple[bytes, str]] = {}


def case(name: str, data: bytes, field: str) -> None:
    assert name not in INVALID, name
    INVALID[name] = (data, field)


# Whole-document problems: field "".
case("16385 bytes, otherwise valid", padded_to(MAX_BYTES + 1), "")
case(
    "16385 bytes with a long credential",
    with_value("credential", "k" * (MAX_BYTES + 1 - len(render(valid_doc(""))))),
    "",
)
case("16385 bytes with an unknown key: size is checked first", padded_to(MAX_BYTES + 1, {**valid_doc(), "x": 1}), "")
case("far too large", b"{" + b" " * (4 * MAX_BYTES) + render(valid_doc())[1:], "")
case("empty file", b"", "")
case("only whitespace", b"  \n", "")
case("not JSON", b"version=1\n", "")
case("truncated object", render(valid_doc())[:-1], "")
case("invalid UTF-8 in the credential", render(valid_doc()).replace(b"dcred_", b"dcred\xff"), "")
case("invalid UTF-8 outside strings", b"\xff" + render(valid_doc()), "")
case("UTF-16 encoded", json.dumps(valid_doc()).encode("utf-16"), "")
case("top-level array", b"[" + render(valid_doc()) + b"]", "")
case("top-level string", b'"version"', "")
case("top-level number", b"1", "")
case("top-level null", b"null", "")
case("trailing object", render(valid_doc()) + b"{}", "")
case("trailing text", render(valid_doc()) + b" x", "")
case("trailing second copy", render(valid_doc()) + b"\n" + render(valid_doc()), "")
case("trailing comma inside", render(valid_doc())[:-1] + b",}", "")
case("NaN value", raw_value("suspend_control", "NaN"), "")
case("Infinity value", raw_value("suspend_control", "Infinity"), "")
case("-Infinity value", raw_value("suspend_control", "-Infinity"), "")
case("NaN under an unknown key", plus('"extra": NaN'), "")

# Keys: duplicates written as raw JSON text, unknown, case aliases, missing.
case("duplicate version", plus('"version": "1"'), "version")
case("duplicate credential", plus(f'"credential": "{CREDENTIAL}"'), "credential")
case("duplicate suspend_control with another value", plus('"suspend_control": true'), "suspend_control")
case("duplicate workspace", plus('"workspace": "/workspace"'), "workspace")
case("duplicate written with an escape", plus('"vers\\u0069on": "1"'), "version")
case("unknown key", plus('"extra": true'), "extra")
case("unknown key null", plus('"token": null'), "token")
case("empty key", plus('"": 1'), "")
for _key, _alias in (
    ("version", "Version"),
    ("core_url", "CORE_URL"),
    ("credential", "Credential"),
    ("device_id", "Device_ID"),
    ("environment_id", "environment_ID"),
    ("session_id", "SESSION_ID"),
    ("workspace", "WorkSpace"),
    ("suspend_control", "Suspend_Control"),
):
    case(f"alias {_alias} alone", renamed(_key, _alias), _alias)
case("alias Version next to version", plus('"Version": "1"'), "Version")
case("alias CORE_URL next to core_url", plus(f'"CORE_URL": "{CORE_URL}"'), "CORE_URL")
case("alias Credential next to credential", plus(f'"Credential": "{CREDENTIAL}"'), "Credential")
for _key in KEYS:
    case(f"missing {_key}", without(_key), _key)

# version
for _name, _value in {
    "number 1": 1,
    "number 1.0": 1.0,
    "string 2": "2",
    "string 1.0": "1.0",
    "string v1": "v1",
    "string with a space": "1 ",
    "empty": "",
    "null": None,
    "true": True,
    "list": ["1"],
}.items():
    case(f"version {_name}", with_value("version", _value), "version")

# core_url
for _name, _value in {
    "ftp scheme": "ftp://core.example.com/api/v1",
    "ws scheme": "ws://core.example.com/api/v1",
    "uppercase scheme": "HTTPS://core.example.com/api/v1",
    "no scheme": "core.example.com/api/v1",
    "scheme-relative": "//core.example.com/api/v1",
    "no host": "https:///api/v1",
    "no path": "https://core.example.com",
    "path /": "https://core.example.com/",
    "path /api": "https://core.example.com/api",
    "path /api/v2": "https://core.example.com/api/v2",
    "path /api/v1/": "https://core.example.com/api/v1/",
    "path /api/v1/x": "https://core.example.com/api/v1/x",
    "path /api/v10": "https://core.example.com/api/v10",
    "path /API/V1": "https://core.example.com/API/V1",
    "userinfo user:pw": "https://user:pw@core.example.com/api/v1",
    "userinfo user only": "https://user@core.example.com/api/v1",
    "query": "https://core.example.com/api/v1?x",
    "query key=value": "https://core.example.com/api/v1?token=abc",
    "fragment": "https://core.example.com/api/v1#x",
    "space in the path": "https://core.example.com/a b/api/v1",
    "leading space": " https://core.example.com/api/v1",
    "trailing newline": "https://core.example.com/api/v1\n",
    "tab in the host": "https://core.\texample.com/api/v1",
    "empty": "",
    "number": 443,
    "null": None,
    "object": {"url": CORE_URL},
}.items():
    case(f"core_url {_name}", with_value("core_url", _value), "core_url")

# device_id, environment_id, session_id
_BAD_UUIDS: dict[str, Any] = {
    "uppercase": DEVICE.upper(),
    "one uppercase letter": DEVICE.replace("f", "F", 1),
    "no hyphens": DEVICE.replace("-", ""),
    "braces": "{" + DEVICE + "}",
    "urn prefix": "urn:uuid:" + DEVICE,
    "hyphens misplaced": "0f6e8a3c5-b1d-4c2e-9a7f-1e2d3c4b5a69",
    "too short": DEVICE[:-1],
    "too long": DEVICE + "0",
    "non-hex letter": DEVICE[:-1] + "g",
    "surrounding spaces": f" {DEVICE} ",
    "all zero": ZERO_UUID,
    "empty": "",
    "number": 12345,
    "null": None,
}
for _name, _value in _BAD_UUIDS.items():
    case(f"device_id {_name}", with_value("device_id", _value), "device_id")
for _key in ("environment_id", "session_id"):
    for _name in ("uppercase", "no hyphens", "braces", "urn prefix", "all zero", "number"):
        case(f"{_key} {_name}", with_value(_key, _BAD_UUIDS[_name]), _key)

# credential
for _name, _value in {
    "empty": "",
    "a space": "abc def",
    "leading space": " abcdef",
    "trailing newline": "abcdef\n",
    "a tab": "abc\tdef",
    "a carriage return": "abc\rdef",
    "a vertical tab": "abc\vdef",
    "a form feed": "abc\fdef",
    "NEL U+0085": "abc\u0085def",
    "no-break space U+00A0": "abc\u00a0def",
    "em space U+2003": "abc\u2003def",
    "line separator U+2028": "abc\u2028def",
    "ideographic space U+3000": "abc\u3000def",
    "ogham space U+1680": "abc\u1680def",
    "en quad U+2000": "abc\u2000def",
    "hair space U+200A": "abc\u200adef",
    "paragraph separator U+2029": "abc\u2029def",
    "narrow no-break space U+202F": "abc\u202fdef",
    "medium mathematical space U+205F": "abc\u205fdef",
    "NUL": "abc\x00def",
    "only NUL": "\x00",
    "number": 12345,
    "null": None,
    "true": True,
    "list": [CREDENTIAL],
}.items():
    case(f"credential {_name}", with_value("credential", _value), "credential")

# workspace
for _name, _value in {
    "relative": "workspace",
    "relative ./": "./workspace",
    "trailing slash": "/workspace/",
    "double slash at the start": "//workspace",
    "double slash inside": "/home//workspace",
    "dot segment": "/home/./workspace",
    "dot-dot segment": "/home/../workspace",
    "ends with /.": "/workspace/.",
    "ends with /..": "/workspace/..",
    "/.": "/.",
    "/..": "/..",
    "//": "//",
    "empty": "",
    "number": 1,
    "null": None,
}.items():
    case(f"workspace {_name}", with_value("workspace", _value), "workspace")

# suspend_control
for _name, _value in {
    "0": 0,
    "1": 1,
    'string "true"': "true",
    'string "false"': "false",
    "null": None,
    "list": [True],
}.items():
    case(f"suspend_control {_name}", with_value("suspend_control", _value), "suspend_control")


# Valid JSON of the wrong type, however large or deep, is the field's problem, not the document's.
# Numbers over the decoder's 4300 digits and nesting past its depth are refused for the whole
# document (field ""), before any field is looked at: a decision, documented in docs/bootstrap.md.
case("suspend_control a 5000-digit number", raw_value("suspend_control", "1" * 5000), "")
case("version a 5000-digit number", raw_value("version", "1" * 5000), "")
case("suspend_control nested 2000 deep", raw_value("suspend_control", "[" * 2000 + "]" * 2000), "")
case("credential nested objects 1500 deep", raw_value("credential", '{"a":' * 1500 + "1" + "}" * 1500), "")


def test_corpus_is_large() -> None:
    assert len(INVALID) >= 30
    assert len(VALID) >= 10


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid(name: str) -> None:
    data, field = INVALID[name]
    with pytest.raises(BootstrapError) as caught:
        parse(data, file=FILE)
    error = caught.value
    assert isinstance(error, UsageError)
    assert error.exit_status == 2
    assert error.field == field, (name, error.field, str(error))
    assert error.file == FILE
    assert isinstance(error.rule, str)
    assert error.rule
    assert CREDENTIAL not in str(error)
    assert CREDENTIAL not in error.rule


def test_one_change_only() -> None:
    """Sanity: the field-level cases are a valid document with one key's value changed."""
    base = valid_doc()
    for name, (data, field) in INVALID.items():
        if field not in KEYS or name.startswith(("duplicate", "missing", "NaN")):
            continue
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            continue
        if not isinstance(doc, dict) or set(doc) != set(KEYS):
            continue
        changed = [key for key in KEYS if doc[key] != base[key] or type(doc[key]) is not type(base[key])]
        assert changed == [field], name


# --------------------------------------------------------------------------------------------
# No error carries a submitted value: a seeded random corpus of mutated documents.

SEED = 20240611
ROUNDS = 600


def random_credential(rng: random.Random) -> str:
    """A distinctive credential no error text could contain by chance."""
    alphabet = string.ascii_letters + string.digits
    return "zq" + "".join(rng.choice(alphabet) for _ in range(30)) + "Xj"


Mutation = Callable[[random.Random, dict[str, Any], str], "bytes"]


def _set(key: str, value: Callable[[random.Random, str], Any]) -> Mutation:
    def mutate(rng: random.Random, doc: dict[str, Any], cred: str) -> bytes:
        doc[key] = value(rng, cred)
        return render(doc)

    return mutate


def _credential_with(rng: random.Random, cred: str) -> str:
    bad = rng.choice([" ", "\t", "\n", "\r", "\x00", "\u00a0", "\u2003", "\u3000", "\u2028", "\v"])
    at = rng.randrange(len(cred) + 1)
    return cred[:at] + bad + cred[at:]


def _oversize(rng: random.Random, doc: dict[str, Any], cred: str) -> bytes:
    doc["credential"] = cred * (MAX_BYTES // len(cred) + rng.randrange(1, 4))
    return render(doc)


def _trailing(rng: random.Random, doc: dict[str, Any], cred: str) -> bytes:
    return render(doc) + rng.choice([f'"{cred}"', f'{{"credential": "{cred}"}}', cred]).encode()


def _duplicate(rng: random.Random, doc: dict[str, Any], cred: str) -> bytes:
    return ("{" + body(doc) + f', "credential": "{cred}"' + "}").encode()


def _truncated(rng: random.Random, doc: dict[str, Any], cred: str) -> bytes:
    text = render(doc)
    end = text.index(cred.encode()) + rng.randrange(1, len(cred))
    return text[:end]


def _bad_utf8(rng: random.Random, doc: dict[str, Any], cred: str) -> bytes:
    text = render(doc)
    at = text.index(cred.encode()) + rng.randrange(len(cred))
    return text[:at] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf"]) + text[at:]


def _alias_credential(rng: random.Random, doc: dict[str, Any], cred: str) -> bytes:
    alias = rng.choice(["Credential", "CREDENTIAL", "credentiaL", "cRedential"])
    if rng.random() < 0.5:
        doc = {alias if k == "credential" else k: v for k, v in doc.items()}
    else:
        doc[alias] = cred
    return render(doc)


def _unknown_with_value(rng: random.Random, doc: dict[str, Any], cred: str) -> bytes:
    doc[rng.choice(["token", "secret", "extra", "api_key"])] = cred
    return render(doc)


def _nan_next_to(rng: random.Random, doc: dict[str, Any], cred: str) -> bytes:
    return (
        "{" + body(doc) + f', "{rng.choice(["suspend_control", "x"])}": {rng.choice(["NaN", "-Infinity"])}' + "}"
    ).encode()


def _array(rng: random.Random, doc: dict[str, Any], cred: str) -> bytes:
    return rng.choice([b"[" + render(doc) + b"]", json.dumps([cred]).encode(), json.dumps(cred).encode()])


def _missing(rng: random.Random, doc: dict[str, Any], cred: str) -> bytes:
    del doc[rng.choice([k for k in KEYS if k != "credential"])]
    return render(doc)


MUTATIONS: list[Mutation] = [
    _set("credential", _credential_with),
    _set("credential", lambda rng, cred: cred + "\x00"),
    _set("version", lambda rng, cred: cred),
    _set("version", lambda rng, cred: rng.choice([2, "2", 1])),
    _set("core_url", lambda rng, cred: f"https://{cred}:pw@core.example.com/api/v1"),
    _set("core_url", lambda rng, cred: f"https://core.example.com/api/v1?token={cred}"),
    _set("core_url", lambda rng, cred: f"https://core.example.com/api/v1#{cred}"),
    _set("core_url", lambda rng, cred: f"https://core.example.com/{cred}"),
    _set("core_url", lambda rng, cred: f"ftp://{cred}.example.com/api/v1"),
    _set("core_url", lambda rng, cred: f"https://core.example.com/ {cred}/api/v1"),
    _set("device_id", lambda rng, cred: cred),
    _set("environment_id", lambda rng, cred: cred[:36]),
    _set("session_id", lambda rng, cred: "{" + cred + "}"),
    _set("device_id", lambda rng, cred: ZERO_UUID),
    _set("workspace", lambda rng, cred: cred),
    _set("workspace", lambda rng, cred: f"/{cred}/"),
    _set("workspace", lambda rng, cred: f"/{cred}/../x"),
    _set("workspace", lambda rng, cred: f"//{cred}"),
    _set("suspend_control", lambda rng, cred: cred),
    _set("suspend_control", lambda rng, cred: rng.choice([0, 1, "true", None])),
    _set("credential", lambda rng, cred: [cred]),
    _set("credential", lambda rng, cred: {"value": cred}),
    _oversize,
    _trailing,
    _duplicate,
    _truncated,
    _bad_utf8,
    _alias_credential,
    _unknown_with_value,
    _nan_next_to,
    _array,
    _missing,
]


@dataclass
class Mutated:
    credential: str
    data: bytes
    mutation: str


def mutated_corpus() -> list[Mutated]:
    rng = random.Random(SEED)  # noqa: S311 (a reproducible corpus, not a secret)
    corpus = []
    for round_ in range(ROUNDS):
        cred = random_credential(rng)
        index = round_ if round_ < len(MUTATIONS) else rng.randrange(len(MUTATIONS))
        doc = valid_doc(cred)
        if rng.random() < 0.3:
            doc = dict(rng.sample(list(doc.items()), len(doc)))
        corpus.append(Mutated(cred, MUTATIONS[index](rng, doc, cred), f"MUTATIONS[{index}]"))
    return corpus


def test_the_unmutated_documents_are_valid() -> None:
    rng = random.Random(SEED)  # noqa: S311 (a reproducible corpus, not a secret)
    for _ in range(50):
        cred = random_credential(rng)
        parse(render(valid_doc(cred)), file=FILE)


def test_no_error_carries_the_credential() -> None:
    corpus = mutated_corpus()
    assert len(corpus) == ROUNDS
    accepted = []
    for item in corpus:
        try:
            parse(item.data, file=FILE)
        except BootstrapError as error:
            texts = {"str": str(error), "repr": repr(error), "rule": error.rule, "field": error.field}
            for part, text in texts.items():
                assert item.credential not in text, (item.mutation, part, text)
                # no recognisable fragment of it either
                assert item.credential[2:18] not in text, (item.mutation, part, text)
        else:
            accepted.append((item.mutation, item.data[:200]))
    assert accepted == [], accepted


# --------------------------------------------------------------------------------------------
# load: the file rules, then parse.


def write(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_load_returns_the_exact_bytes(tmp_path: Path) -> None:
    data = json.dumps(valid_doc(), indent=3).encode() + b"\n\n"
    path = write(tmp_path / "b.json", data)
    parsed, raw = load(str(path))
    assert raw == data
    assert parsed.device_id == DEVICE
    assert parsed.workspace == "/workspace"


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o700, 0o200])
def test_load_accepts_owner_only_modes(tmp_path: Path, mode: int) -> None:
    path = write(tmp_path / "b.json", render(valid_doc()), mode)
    parsed, raw = load(str(path))
    assert raw == render(valid_doc())
    assert parsed.session_id == SESSION


def test_load_makes_a_relative_path_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "b.json", render(valid_doc()))
    monkeypatch.chdir(tmp_path)
    parsed, raw = load("b.json")
    assert raw == render(valid_doc())
    assert parsed.environment_id == ENVIRONMENT
    (tmp_path / "sub").mkdir()
    parsed, raw = load("sub/../b.json")
    assert raw == render(valid_doc())


def expect_load_refused(path: str) -> BootstrapError:
    with pytest.raises(BootstrapError) as caught:
        load(path)
    error = caught.value
    assert isinstance(error, UsageError)
    assert error.exit_status == 2
    assert CREDENTIAL not in str(error)
    assert CREDENTIAL not in error.rule
    assert CREDENTIAL not in error.field
    return error


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o606, 0o666, 0o610, 0o601])
def test_load_refuses_group_or_other_bits(tmp_path: Path, mode: int) -> None:
    path = write(tmp_path / "b.json", render(valid_doc()), mode)
    expect_load_refused(str(path))


def test_load_refuses_a_symlink(tmp_path: Path) -> None:
    target = write(tmp_path / "real.json", render(valid_doc()))
    link = tmp_path / "link.json"
    link.symlink_to(target)
    expect_load_refused(str(link))


def test_load_refuses_a_relative_symlink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "real.json", render(valid_doc()))
    (tmp_path / "link.json").symlink_to("real.json")
    monkeypatch.chdir(tmp_path)
    expect_load_refused("link.json")


def test_load_refuses_a_dangling_symlink(tmp_path: Path) -> None:
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "nowhere.json")
    expect_load_refused(str(link))


def test_load_refuses_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "b.json"
    os.mkfifo(fifo, 0o600)
    expect_load_refused(str(fifo))


def test_load_names_the_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path / "b.json", render(valid_doc()), 0o644)
    monkeypatch.chdir(tmp_path)
    error = expect_load_refused("b.json")
    assert error.file == str(tmp_path / "b.json")
    write(tmp_path / "c.json", plus('"extra": 1'))
    error = expect_load_refused("c.json")
    assert error.file == str(tmp_path / "c.json")
    assert error.field == "extra"


def test_load_refuses_a_directory(tmp_path: Path) -> None:
    directory = tmp_path / "b.json"
    directory.mkdir(mode=0o700)
    expect_load_refused(str(directory))


def test_load_refuses_a_missing_file(tmp_path: Path) -> None:
    expect_load_refused(str(tmp_path / "missing.json"))


def test_load_refuses_an_empty_path() -> None:
    expect_load_refused("")


@pytest.mark.parametrize(
    "name", ["unknown key", "alias Credential alone", "credential a space", "16385 bytes, otherwise valid"]
)
def test_load_applies_parse(tmp_path: Path, name: str) -> None:
    data, field = INVALID[name]
    path = write(tmp_path / "b.json", data)
    error = expect_load_refused(str(path))
    assert error.field == field


def test_load_refuses_a_large_file_on_disk(tmp_path: Path) -> None:
    path = write(tmp_path / "b.json", padded_to(MAX_BYTES + 1))
    error = expect_load_refused(str(path))
    assert error.field == ""
    path = write(tmp_path / "ok.json", padded_to(MAX_BYTES))
    parsed, raw = load(str(path))
    assert len(raw) == MAX_BYTES
    assert parsed.version == "1"


def test_errors_do_not_name_values_of_any_field() -> None:
    """An invalid non-secret value is not echoed either (errors never contain a submitted value)."""
    marker = "mkvalueqhzrtwpxlnbcg"
    for key, value in {
        "core_url": f"https://{marker}.example.com/api/v2",
        "workspace": f"/{marker}/",
        "device_id": marker,
        "version": marker,
        "suspend_control": marker,
    }.items():
        with pytest.raises(BootstrapError) as caught:
            parse(with_value(key, value), file=FILE)
        assert marker not in str(caught.value), key
        assert marker not in caught.value.rule, key
