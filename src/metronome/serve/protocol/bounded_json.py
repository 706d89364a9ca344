"""Reading one client message as JSON at a cost bounded by its size, never by what it holds.

`json.loads` and validation cost per value, not per byte: a 1 MiB message of `[],` is 350k
lists (~140 ms to build), one of 200k wrong strings in a list 200k validation errors (~1 s).
So the values a message may hold are counted *before* it is parsed, from its text: outside
its strings, a message of `v` values has at least `v - 1` of `,` `[` `{`, and it has at most
four quotes per value (a key and a string value). Strings are skipped by splitting on the
quotes left once escaped backslashes and escaped quotes are gone, so text with commas in it
costs nothing. Both scans run in C over the text, ~1 ms per MiB, and a message shorter than
the limit cannot hold more values than it has characters, so it is not scanned at all.

After parsing, one walk over the (now bounded) values checks the nesting and that every
string, keys included, is valid Unicode: JSON's `\\ud83d` escapes can spell a lone UTF-16
surrogate, which no UTF-8 reply can carry (I-JSON, RFC 7493, forbids them for that reason).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

DEFAULT_MAX_VALUES = 512  # a full conversation.item.create (64 text parts) holds ~200
DEFAULT_MAX_DEPTH = 8  # the deepest event, session.update's audio.input.format, is 5 deep
_SURROGATE = re.compile("[\ud800-\udfff]")
_SHOWN_KEY_CHARS = 32  # of each client key in an error's `param`


class JsonRefused(ValueError):
    """The message is not JSON this server reads: bad syntax, over a bound, or a lone
    surrogate. `param` names where, when it is known."""

    def __init__(self, message: str, param: str | None = None,
                 parsed: object = None) -> None:
        super().__init__(message)
        self.param = param
        self.parsed = parsed  # the message as parsed, when refused after parsing (nesting,
        # a lone surrogate): what can still be read of it, e.g. its event_id


def loads_bounded(text: str, max_values: int = DEFAULT_MAX_VALUES,
                  max_depth: int = DEFAULT_MAX_DEPTH) -> object:
    """`json.loads(text)`, or `JsonRefused` before any costly work when the text holds more
    than `max_values` values, and after it when the nesting or a string is refused."""
    _check_values(text, max_values)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise JsonRefused(f"message is not valid JSON: {err}") from None
    try:
        _check_depth_and_strings(value, max_depth)
    except JsonRefused as err:
        raise JsonRefused(str(err), err.param, parsed=value) from None
    return value


def _check_values(text: str, max_values: int) -> None:
    if len(text) <= max_values:
        return  # every value takes at least one character
    if (text.count('"') <= 4 * max_values + 4 and 1 + sum(
            text.count(c) for c in ",[{") <= max_values):
        return  # within both bounds counting strings' insides too: four passes in C (base64
        # audio: ~1.2 ms per MiB, where the split below costs ~2.3 ms)
    plain = text.replace("\\\\", "").replace('\\"', "")  # now every quote opens or closes
    num_quotes = plain.count('"')
    if num_quotes > 4 * max_values + 4:
        raise JsonRefused(f"message holds {num_quotes // 2} strings (at most {max_values} "
                          "JSON values are read per message)")
    outside = "".join(plain.split('"')[::2])  # everything outside the strings
    upper_bound = 1 + sum(outside.count(c) for c in ",[{")
    if upper_bound > max_values:
        raise JsonRefused(f"message holds up to {upper_bound} values (at most {max_values} "
                          "JSON values are read per message)")


def _check_depth_and_strings(value: object, max_depth: int) -> None:
    stack: list[tuple[object, int, tuple]] = [(value, 0, ())]  # (value, depth, its path)
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            _check_string(node, path)
            continue
        if not isinstance(node, dict | list):
            continue
        if depth >= max_depth:
            raise JsonRefused(f"message nests deeper than {max_depth} levels",
                              param_of(path) or None)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(key, str):
                _check_string(key, path, is_key=True)
            stack.append((child, depth + 1, (*path, key)))


def _check_string(text: str, path: tuple, is_key: bool = False) -> None:
    if text.isascii():  # O(1) in CPython
        return
    found = _SURROGATE.search(text)
    if found is not None:
        where = f"a key in {param_of(path) or 'the event'}" if is_key else (
            param_of(path) or "the message")
        raise JsonRefused(f"{where} holds a lone UTF-16 surrogate ({ascii(found.group())[1:-1]}) "
                          f"at character {found.start()}; strings must be valid Unicode",
                          param_of(path) or None)


def param_of(path: Sequence[object]) -> str:
    """A value's path as an error's `param` (`item.content.0.text`), each key shortened so
    that a client's megabyte of key is not echoed; keys that reach it are valid Unicode."""
    return ".".join(str(part)[:_SHOWN_KEY_CHARS] for part in path)
