"""Metadata rules (SPEC §5): the open-time checks against a byte-at-a-time reference, the 64-bit
integer rule, JSON parsed on first use, and metadata at the 64 MiB cap in bounded memory."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kdtr_format
from kdtr_format import metadata as md
from kdtr_testlib import METADATA_TOKENS, RULE_MESSAGES, metadata_text, reference_metadata_rule, small_file, with_metadata


def _python_rule(text: bytes) -> str | None:
    try:
        md.check_text(text, 0)
    except kdtr_format.FormatError as e:
        return next(rule for rule, words in RULE_MESSAGES.items() if words in str(e))
    return None


@pytest.mark.parametrize("chunk", [3, 1 << 20])
def test_open_time_checks_agree_with_the_byte_at_a_time_reference(monkeypatch, chunk):
    """Chunks of 3 bytes cut through characters, strings, escapes and tokens; the verdict must not change."""
    monkeypatch.setattr(md, "_CHUNK", chunk)
    rng = np.random.default_rng(chunk)
    texts = [metadata_text(rng) for _ in range(1000)]
    texts += [b'{"a": [' + b"[" * 62 + b"]" * 62 + b"]}", b'{"a": ' + b"[" * 64 + b"]" * 64 + b"}",
              b'{"\\\\": "\\\\\\"[[[", "n": -9223372036854775808, "u": 18446744073709551615}',
              b'{"a": "\xe2\x82"}', b'{\xf0\x9f\x8c\xb2', b'{"a": "\xed\xa0\x80"}', b'{"a": 1}\0', b'\xef\xbb\xbf{"a": 1}']
    seen = set()
    for text in texts:
        expected = reference_metadata_rule(text)
        assert _python_rule(text) == expected, text
        seen.add(expected)
    assert seen == {None, *RULE_MESSAGES}, "the random texts must exercise every rule"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(METADATA_TOKENS), max_size=60), st.integers(3, 40))
def test_open_time_checks_agree_with_the_reference_property(tokens, chunk):
    text = b"{" + b"".join(tokens)
    original = md._CHUNK
    md._CHUNK = chunk
    try:
        assert _python_rule(text) == reference_metadata_rule(text)
    finally:
        md._CHUNK = original


@pytest.mark.parametrize("value", [2**64 - 1, -(2**63), 0, -0, 2**63, [2**64 - 1, -(2**63)]])
def test_integers_at_the_64_bit_bounds_round_trip(tmp_path, value):
    path = tmp_path / "i.kdtr"
    kdtr_format.write(path, {}, metadata={"v": value})
    assert kdtr_format.open(path).metadata == {"v": value}


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 10**4300, -(10**5000)], ids=["2**64", "-2**63-1", "10**4300", "-10**5000"])
def test_writer_refuses_integers_beyond_64_bits_naming_the_field(tmp_path, value):
    with pytest.raises(kdtr_format.WriterError, match=r"metadata\['k'\]\[1\]: an integer outside"):
        kdtr_format.write(tmp_path / "i.kdtr", {}, metadata={"k": [0, value]})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text", [b'{"a": 1.8446744073709551616e19}', b'{"a": 18446744073709551616.0}',
                                  b'{"a": "18446744073709551616"}', b'{"a": 1e-400}', b'{"a": -1.7976931348623157e308}',
                                  b'{"a": "\\"\\\\", "b": 18446744073709551615}'])
def test_floats_and_strings_that_look_like_big_integers_are_accepted(tmp_path, text):
    blob = with_metadata(small_file(tmp_path / "s.kdtr").read_bytes(), text)
    with kdtr_format.Reader.from_bytes(blob) as f:
        f.verify()


def test_a_number_overflowing_binary64_is_refused_when_parsed(tmp_path):
    """`1e400` would read back as infinity, which the writer refuses to write: the reader refuses it."""
    blob = with_metadata(small_file(tmp_path / "s.kdtr").read_bytes(), b'{"a": [1, -1e400]}')
    with kdtr_format.Reader.from_bytes(blob) as f:
        with pytest.raises(kdtr_format.FormatError, match="number -1e400 overflows binary64"):
            f.metadata
        with pytest.raises(kdtr_format.FormatError, match="overflows binary64"):
            f.verify()


def test_json_grammar_is_checked_on_first_use_and_by_verify(tmp_path):
    blob = with_metadata(small_file(tmp_path / "s.kdtr").read_bytes(), b'{"a": [1, 2,]}')
    f = kdtr_format.Reader.from_bytes(blob)           # the open-time rules hold: it opens
    assert f["a"].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(kdtr_format.FormatError, match="metadata is not valid JSON"):
        f.verify()
    with pytest.raises(kdtr_format.FormatError, match=r"not valid JSON.*offset \d+"):
        f.metadata


def test_metadata_is_readable_after_close(tmp_path):
    path = small_file(tmp_path / "s.kdtr")
    with kdtr_format.open(path) as f:
        pass
    assert f.metadata["n"] == 3


def test_escaped_lone_surrogates_are_valid_json_and_read_back(tmp_path):
    blob = with_metadata(small_file(tmp_path / "s.kdtr").read_bytes(), b'{"\\ud800": "\\udfff x"}')
    assert kdtr_format.Reader.from_bytes(blob).metadata == {"\ud800": "\udfff x"}


@pytest.mark.parametrize("unit", [b"[],", b'"\\\\",', b"18446744073709551615,"], ids=["lists", "escapes", "u64"])
def test_metadata_at_the_cap_opens_in_bounded_memory(tmp_path_factory, unit):
    """64 MiB of the shapes that cost the most to check; the speed is measured in test_bench_kdtr."""
    count = (md.MAX_BYTES - 16) // len(unit)
    text = b'{"a": [' + unit * count + b"0]}"
    assert len(text) <= md.MAX_BYTES
    blob = with_metadata(small_file(tmp_path_factory.mktemp("cap") / "s.kdtr").read_bytes(), text)
    path = tmp_path_factory.mktemp("cap") / "cap.kdtr"
    path.write_bytes(blob)
    del blob
    tracemalloc.start()
    try:
        with kdtr_format.open(path) as f:
            assert len(f) == 4
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * len(text), f"opening took {peak / len(text):.2f}x the metadata size"
