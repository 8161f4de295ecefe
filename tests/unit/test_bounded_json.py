"""JSON from nodes and peers parsed with its nesting bounded: deep documents are a ValueError,
never a RecursionError; brackets inside strings do not count."""
import struct

import pytest

from dml_app.wire import bounded_json, weights


@pytest.mark.parametrize("text,depth", [("1", 0), ("[]", 1), ('{"a": [1, {"b": []}]}', 4),
                                        ('{"s": "[[[[{{{{"}', 1), ('["\\"[[["]', 1), (b"[[]]", 2),
                                        ('["\\\\", [["\\\\\\"["]]]', 3), ('"\\u005b["', 0), ('"[[[', 0),
                                        ('[["\\', 2), ('[[]]]]]', 2)])
def test_depth(text, depth):
    assert bounded_json.depth(text) == depth


def test_deep_documents_are_refused_as_malformed_json():
    for data in ("[" * 5000, b"[" * 5000, "[" * 65 + "]" * 65, '{"a":' * 5000):
        with pytest.raises(ValueError, match="nested deeper than 64"):
            bounded_json.loads(data)
    assert bounded_json.loads("[" * 64 + "]" * 64) is not None
    assert bounded_json.loads('{"s": "' + "[" * 5000 + '"}') == {"s": "[" * 5000}  # a string, not nesting
    with pytest.raises(TypeError):
        bounded_json.loads(5)


def test_a_weights_header_of_deep_brackets_is_a_format_error():
    header = b"[" * 5000
    with pytest.raises(weights.WeightsFormatError, match="nested deeper"):
        weights.decode(struct.pack("<Q", len(header)) + header)


def _reference_depth(text: str) -> int:
    """The nesting of a JSON text, read one character at a time (what ``depth`` must agree with)."""
    deepest = level = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            in_string = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            level += 1
            deepest = max(deepest, level)
        elif ch in "]}":
            level -= 1
    return deepest


def test_depth_agrees_with_a_character_reader_on_random_documents():
    import json
    import random

    rng = random.Random(7)

    def value(d: int):
        pick = rng.random()
        if d > 6 or pick < 0.3:
            return "".join(rng.choice('ab[]{}"\\/') for _ in range(rng.randrange(6)))
        if pick < 0.65:
            return [value(d + 1) for _ in range(rng.randrange(4))]
        return {f"k{k}[\\\"": value(d + 1) for k in range(rng.randrange(4))}

    for _ in range(500):
        text = json.dumps(value(0))
        assert bounded_json.depth(text) == _reference_depth(text), text


def test_a_line_longer_than_its_cap_is_refused():
    assert bounded_json.loads_line('{"a": 1}', 8) == {"a": 1}
    with pytest.raises(ValueError, match="a line of 9 bytes"):
        bounded_json.loads_line('{"a": 10}', 8)
