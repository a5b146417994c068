"""Parsing context lengths and printing byte counts.

Context suffixes are binary, as model cards use them: ``8k`` is 8,192 tokens, ``1m`` is
1,048,576. Byte counts print in binary units (KiB, MiB, GiB, TiB) with four significant digits.
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal

from tessera_ray.errors import InvalidContextError

__all__ = ["parse_context", "parse_contexts", "format_bytes", "format_context"]

_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_CONTEXT = re.compile(r"^\s*([+-]?\d+(?:\.\d+)?)\s*([a-z]?)\s*$", re.IGNORECASE)


def parse_context(text: str) -> int:
    """Tokens in ``text`` (``"32768"``, ``"32k"``, ``"1m"``, ``"1.5k"``); positive and whole."""
    match = _CONTEXT.match(text)
    if not match or match.group(2).lower() not in _SUFFIX:
        raise InvalidContextError(
            f"cannot parse context {text!r}: use a token count with an optional k, m or g "
            f"suffix, e.g. 8k or 131072"
        )
    number, suffix = match.group(1), match.group(2).lower()
    scale = _SUFFIX[suffix]
    if "." in number:
        whole, frac = number.split(".")
        tokens_num = int(whole + frac) * scale
        denominator = int(10 ** len(frac))
        if tokens_num % denominator:
            raise InvalidContextError(f"context {text!r} is not a whole number of tokens")
        tokens = tokens_num // denominator
    else:
        tokens = int(number) * scale
    if tokens <= 0:
        raise InvalidContextError(f"context {text!r} must be a positive number of tokens")
    return tokens


def parse_contexts(text: str) -> list[int]:
    """A comma-separated list of contexts, e.g. ``"8k,32k,128k"``."""
    parts = text.split(",")
    if not text.strip() or any(not p.strip() for p in parts):
        raise InvalidContextError(f"empty entry in context list {text!r}")
    return [parse_context(p) for p in parts]


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit keeping the value at or above 1, to 4 significant
    digits rounded half up (68.625 GiB prints as 68.63, as tables in papers round it)."""
    unit = 0
    while unit < len(_UNITS) - 1 and abs(nbytes) >= 1024 ** (unit + 1):
        unit += 1
    if unit == 0:
        return f"{int(nbytes)} B"
    value = Decimal(nbytes) / Decimal(1024**unit)
    places = max(0, 3 - value.adjusted())
    return f"{value.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)} {_UNITS[unit]}"


def format_context(tokens: int) -> str:
    """``131072`` -> ``"128k"``; counts that are not a whole k or m print as they are."""
    for suffix, scale in (("m", 1 << 20), ("k", 1 << 10)):
        if tokens % scale == 0:
            return f"{tokens // scale}{suffix}"
    return str(tokens)
