from __future__ import annotations

import pytest

from tessera_ray.errors import InvalidContextError
from tessera_ray.layout import format_bytes, format_context, parse_context, parse_contexts


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("8k", 8192),
        ("128K", 131072),
        ("1m", 1 << 20),
        ("131072", 131072),
        ("1.5k", 1536),
        (" 2g ", 1 << 31),
    ],
)
def test_parse_context(text: str, tokens: int) -> None:
    assert parse_context(text) == tokens


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0", "'0' must be a positive"),
        ("-5", "'-5' must be a positive"),
        ("12q", "cannot parse context '12q'"),
        ("", "cannot parse context ''"),
        ("1.0001k", "not a whole number"),
    ],
)
def test_bad_context(text: str, message: str) -> None:
    with pytest.raises(InvalidContextError, match=message):
        parse_context(text)


def test_context_lists() -> None:
    assert parse_contexts("8k,32k") == [8192, 32768]
    with pytest.raises(InvalidContextError, match="empty entry"):
        parse_contexts("8k,,1m")


def test_format_bytes_rounds_half_up_to_four_digits() -> None:
    assert format_bytes(523_986_010_112) == "488.0 GiB"
    assert format_bytes(9_210_691_584) == "8.578 GiB"
    assert format_bytes(73_687_810_048) == "68.63 GiB"  # exactly 68.625
    assert format_bytes(512) == "512 B"
    assert format_bytes(1024) == "1.000 KiB"
    assert format_context(131072) == "128k" and format_context(1000) == "1000"
