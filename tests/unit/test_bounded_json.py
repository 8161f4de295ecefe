"""JSON from nodes and peers parsed with its nesting bounded: deep documents are a ValueError,
never a RecursionError; brackets inside strings do not count."""
import struct

import pytest

from dml_app import bounded_json, weights


@pytest.mark.parametrize("text,depth", [("1", 0), ("[]", 1), ('{"a": [1, {"b": []}]}', 4),
                                        ('{"s": "[[[[{{{{"}', 1), ('["\\"[[["]', 1), (b"[[]]", 2)])
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
