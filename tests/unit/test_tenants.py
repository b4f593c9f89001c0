"""``router.tenants``: the keys file's rules (each refusal names the file and the fix), a key's tenant, and each
tenant's bounds: requests in flight, tokens per minute (with the seconds to wait), and a reload that keeps the
old table when the new file is refused."""

from __future__ import annotations

import pytest

from router.tenants import ANONYMOUS, Refused, Tenants, hash_key, load_keys_file

KEY_A, KEY_B = "key-of-acme-0123456789", "key-of-bravo-0123456789"


def write(path, text: str, mode: int = 0o600):
    path.write_text(text)
    path.chmod(mode)
    return path


def keys_file(path, extra: str = "", mode: int = 0o600):
    return write(path, f"""
[tenants.acme]
key_sha256 = ["{hash_key(KEY_A)}"]
max_concurrency = 2
tokens_per_minute = 600
weight = 3

[tenants.bravo]
key_sha256 = ["{hash_key(KEY_B)}"]
{extra}
""", mode)


def test_a_key_names_its_tenant_and_nothing_else_does(tmp_path):
    tenants = Tenants(str(keys_file(tmp_path / "keys.toml")), api_key="the-single-key")
    acme = tenants.identify(f"Bearer {KEY_A}")
    assert (acme.name, acme.max_concurrency, acme.tokens_per_minute, acme.weight) == ("acme", 2, 600, 3.0)
    assert tenants.identify(f"bearer {KEY_B}".encode()).name == "bravo"
    assert tenants.identify("Bearer the-single-key").name == "default"  # --api-key: one more tenant
    for wrong in (None, "", f"Basic {KEY_A}", "Bearer ", "Bearer nope", KEY_A):
        assert tenants.identify(wrong) is None
    assert Tenants().identify(None) is ANONYMOUS and Tenants().open


@pytest.mark.parametrize(
    ("text", "mode", "message"),
    [
        ("", 0o644, "lets other users read it; chmod o-rwx"),
        ("[tenants.acme]\nkey_sha256 = ['x']\n", 0o600, "'x' is not a SHA-256 hex digest"),
        (f"[tenants.acme]\nkey_sha256 = ['{hash_key('k')}']\nmax_concurrency = -1\n", 0o600,
         "max_concurrency must be an integer >= 0"),
        (f"[tenants.acme]\nkey_sha256 = ['{hash_key('k')}']\ntokens_per_minute = 1.5\n", 0o600,
         "tokens_per_minute must be an integer >= 0"),
        (f"[tenants.acme]\nkey_sha256 = ['{hash_key('k')}']\nweight = 0\n", 0o600, r"weight must be a number in \(0"),
        (f"[tenants.acme]\nkey_sha256 = ['{hash_key('k')}']\nburst = 3\n", 0o600, r"unknown fields \['burst'\]"),
        (f"[tenants.acme]\nkey_sha256 = ['{hash_key('k')}']\n[tenants.bravo]\nkey_sha256 = ['{hash_key('k')}']\n",
         0o600, "is also tenant acme's; a key belongs to one tenant"),
        ("[tenants.acme]\nkey_sha256 = []\n", 0o600, "key_sha256 must be a non-empty list"),
        (f"[tenants.'a b']\nkey_sha256 = ['{hash_key('k')}']\n", 0o600, "a tenant's name is 1-64 letters"),
        ("[tenants.acme\n", 0o600, "not TOML"),
        ("[other]\n", 0o600, r"expected \[tenants.NAME\] tables only"),
    ],
)
def test_a_bad_keys_file_is_refused_naming_the_fix(tmp_path, text, mode, message):
    path = write(tmp_path / "keys.toml", text, mode)
    with pytest.raises(ValueError, match=message) as err:
        load_keys_file(path)
    assert str(path) in str(err.value)


def test_requests_in_flight_are_bounded_per_tenant(tmp_path):
    tenants = Tenants(str(keys_file(tmp_path / "keys.toml")))
    acme, bravo = tenants.identify(f"Bearer {KEY_A}"), tenants.identify(f"Bearer {KEY_B}")
    tenants.enter(acme)
    tenants.enter(acme)
    with pytest.raises(Refused, match="tenant acme has its limit of 2 requests in flight") as err:
        tenants.enter(acme)
    assert err.value.retry_after_s == 1
    for _ in range(10):
        tenants.enter(bravo)  # no bound: another tenant's use is its own
    tenants.leave(acme, 1, 1)
    tenants.enter(acme)


def test_tokens_per_minute_refill_and_say_when_to_retry(tmp_path):
    tenants = Tenants(str(keys_file(tmp_path / "keys.toml")))
    acme = tenants.identify(f"Bearer {KEY_A}")
    tenants.enter(acme)
    tenants.leave(acme, 500, 400)  # 900 of its 600 a minute: 300 in debt, 10 tokens a second back
    with pytest.raises(Refused, match="tenant acme used its 600 tokens per minute; retry in") as err:
        tenants.enter(acme)
    assert 29 <= err.value.retry_after_s <= 30
    tenants._usage["acme"].at -= 31  # (as if 31 s passed)
    tenants.enter(acme)


def test_a_reload_takes_a_good_file_and_keeps_the_table_through_a_bad_one(tmp_path):
    path = keys_file(tmp_path / "keys.toml")
    tenants = Tenants(str(path))
    keys_file(path, extra="weight = -1")
    assert not tenants.reload()
    assert tenants.identify(f"Bearer {KEY_A}").name == "acme"  # the old table
    write(path, f"[tenants.bravo]\nkey_sha256 = ['{hash_key(KEY_B)}']\n")  # acme's key revoked
    assert tenants.reload()
    assert tenants.identify(f"Bearer {KEY_A}") is None and tenants.identify(f"Bearer {KEY_B}").name == "bravo"
    write(path, "")
    path.chmod(0o604)
    assert not tenants.reload() and tenants.identify(f"Bearer {KEY_B}").name == "bravo"
