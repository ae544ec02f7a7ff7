"""runtime/access.py: the host names charrun's ports answer to, the origins whose requests may
change state, the flags that widen both, how a session id is compared, and the gate on
uploads in flight."""

import pytest

from charengine.runtime.access import Access, AccessError, UploadGate, same_token
from charengine.runtime.formats import MAX_SHOWN


@pytest.mark.parametrize("host", ["127.0.0.1:8080", "127.0.0.1", "[::1]:8080", "10.0.0.7:80",
                                  "localhost:8080", "LOCALHOST", "app.localhost:8080",
                                  "localhost.:8080"])
def test_addresses_and_localhost_are_served_by_default(host):
    assert Access().host_refusal(host) is None


@pytest.mark.parametrize("host", ["evil.example:8080", "evil.example", "127.0.0.1.nip.io",
                                  "localhost.evil.example", "", None, "a b", "x@127.0.0.1"])
def test_other_names_are_refused_by_default(host):
    why = Access().host_refusal(host)
    assert why is not None
    if host and "." in host and " " not in host and "@" not in host:
        assert "--allow-host" in why


def test_allow_host_adds_names_and_star_any():
    a = Access(allow_hosts=("Chars.Example.com",))
    assert a.host_refusal("chars.example.com:443") is None
    assert a.host_refusal("other.example.com") is not None
    assert Access(allow_hosts=("*",)).host_refusal("anything.example") is None


@pytest.mark.parametrize("bad", ["https://chars.example.com", "chars.example.com:80", "a/b", ""])
def test_allow_host_takes_bare_names(bad):
    with pytest.raises(AccessError, match="--allow-host"):
        Access(allow_hosts=(bad,))


def test_the_pages_own_origin_and_no_origin_may_change_state():
    a = Access()
    assert a.origin_refusal("http://127.0.0.1:8080", "127.0.0.1:8080") is None
    assert a.origin_refusal("http://localhost", "localhost:80") is None
    assert a.origin_refusal(None, "127.0.0.1:8080") is None  # not from a web page


@pytest.mark.parametrize("origin,host", [
    ("http://evil.example", "127.0.0.1:8080"),
    ("http://127.0.0.1:9999", "127.0.0.1:8080"),  # another port is another origin
    ("https://127.0.0.1:8080", "127.0.0.1:8080"),  # and another scheme
    ("null", "127.0.0.1:8080"),  # a sandboxed frame, a file
    ("http://127.0.0.1:8080/path", "127.0.0.1:8080"),
    ("http://localhost:8080", "127.0.0.1:8080"),
])
def test_other_origins_may_not(origin, host):
    why = Access().origin_refusal(origin, host)
    assert why is not None and "--allow-origin" in why


def test_a_long_origin_is_shown_cut():
    origin = "http://" + "a" * 5000 + ".example"
    why = Access().origin_refusal(origin, "127.0.0.1:8080")
    assert f"'{origin[:MAX_SHOWN]}...'" in why and len(why) < MAX_SHOWN + 200


def test_allow_origin_adds_a_front_end_with_its_scheme_and_port():
    a = Access(allow_origins=("https://Chars.Example.com",))
    assert a.origin_refusal("https://chars.example.com", "10.0.0.7:8080") is None
    assert a.origin_refusal("https://chars.example.com:443", "10.0.0.7:8080") is None
    assert a.origin_refusal("http://chars.example.com", "10.0.0.7:8080") is not None
    with pytest.raises(AccessError, match="--allow-origin"):
        Access(allow_origins=("chars.example.com",))
    with pytest.raises(AccessError, match="--allow-origin"):
        Access(allow_origins=("*",))


def test_the_upload_gate_caps_count_and_bytes_and_counts_an_undeclared_body_as_the_largest():
    gate = UploadGate(largest=64, max_count=3, max_bytes=100)
    a = gate.admit(60)
    assert a == 60 and gate.admit(50) is None  # 110 bytes would be in flight
    b = gate.admit(None)
    assert b is None  # an undeclared body counts as the largest: 124
    c, d = gate.admit(20), gate.admit(10)
    assert (c, d) == (20, 10) and gate.admit(1) is None  # three in flight
    for size in (a, c, d):
        gate.release(size)
    assert (gate.count, gate.bytes) == (0, 0)
    assert gate.admit(10**9) == 64  # a declared length past the largest is cut off there


@pytest.mark.parametrize("given", ["", "abc", "\u00e9" * 22, "\ud800", "x" * 10_000])
def test_a_session_id_of_any_characters_is_compared_and_names_no_other_session(given):
    token = "Zm9vYmFyYmF6cXV4cXV1eA"
    assert same_token(token, token) and not same_token(given, token)
    assert same_token("\u00e9t\u00e9", "\u00e9t\u00e9")
