"""The page-header walk over Parquet files pyarrow writes: it ends exactly at the footer, sees every
header byte, and answers any bytes with a CRC or a PageHeaderError, never a hang."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajstore.page_headers import PageHeaderError, headers_crc
from trajstore.table import _footer_span


def parquet_bytes(**options: object) -> bytes:
    rng = random.Random(0)
    table = pa.table({
        "ids": pa.array([[rng.randrange(150_000) for _ in range(rng.randrange(300))] for _ in range(2_000)],
                        pa.list_(pa.int32())),
        "name": pa.array([f"rollout-{rng.randrange(50)}-" + "x" * rng.randrange(200) for _ in range(2_000)]),
        "reward": pa.array([rng.random() if rng.random() < 0.8 else None for _ in range(2_000)]),
        "flag": pa.array([rng.random() < 0.5 for _ in range(2_000)]),
        "meta": pa.array([{"k": str(i), "n": i} for i in range(2_000)]),
    })
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **options)  # type: ignore[arg-type]
    return sink.getvalue().to_pybytes()


SHAPES = {
    "defaults": {},
    "many small pages, row groups, page checksums, zstd": dict(data_page_size=512, row_group_size=300,
                                                                 write_page_checksum=True, compression="zstd"),
    "page v2, no dictionary, statistics": dict(data_page_version="2.0", use_dictionary=False, data_page_size=2048),
}


def walk(data: bytes) -> int:
    return headers_crc(lambda at, n: data[at:at + n], 4, len(data) - _footer_span(data))


def chunk_starts(data: bytes) -> list[int]:
    meta = pq.read_metadata(pa.BufferReader(data))
    starts = []
    for r in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            chunk = meta.row_group(r).column(c)
            starts.append(chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset)
    return starts


@pytest.mark.parametrize("shape", SHAPES)
def test_the_walk_ends_at_the_footer_and_sees_each_chunk_s_first_header(shape: str) -> None:
    data = parquet_bytes(**SHAPES[shape])
    crc = walk(data)
    for start in chunk_starts(data):
        for offset in range(start, start + 6):  # the header's type and sizes
            flipped = bytearray(data)
            flipped[offset] ^= 0x01
            try:
                assert walk(bytes(flipped)) != crc, f"a flip at byte {offset} left the headers' CRC unchanged"
            except PageHeaderError:
                pass


def test_pages_that_do_not_end_at_the_footer_are_an_error() -> None:
    data = parquet_bytes()
    end = len(data) - _footer_span(data)
    with pytest.raises(PageHeaderError, match="not at the footer|runs past"):
        headers_crc(lambda at, n: data[at:at + n], 4, end - 1)
    with pytest.raises(PageHeaderError, match="runs past"):  # a file cut short: the reads come back shorter
        headers_crc(lambda at, n: data[at:min(at + n, 100)], 4, end)


@pytest.mark.parametrize("window", [1, 8, 100])
def test_a_header_longer_than_the_read_window_is_read_whole(monkeypatch: pytest.MonkeyPatch, window: int) -> None:
    """A header past the window (one with long statistics) is read again, 8x longer, instead of failing."""
    import trajstore.page_headers

    data = parquet_bytes(**SHAPES["page v2, no dictionary, statistics"])
    expected = walk(data)
    monkeypatch.setattr(trajstore.page_headers, "_WINDOW", window)
    assert walk(data) == expected


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n >> 7 else 0))
        n >>= 7
        if not n:
            return bytes(out)


@pytest.mark.parametrize("element", [0x3, 0x5])  # bytes (stepped over at once), i32s (read one by one)
def test_a_header_that_says_it_holds_a_huge_list_is_an_error_within_the_header_bound(
        monkeypatch: pytest.MonkeyPatch, element: int) -> None:
    """A damaged size stops at the data's end, or at MAX_HEADER (the bound Arrow's reader has), not at 2**40."""
    import trajstore.page_headers

    monkeypatch.setattr(trajstore.page_headers, "MAX_HEADER", 64 << 10)
    data = bytes([0x15, 0x00, 0x19, 0xF0 | element]) + _varint(1 << 40) + b"\x00" * (1 << 20)
    with pytest.raises(PageHeaderError, match="the page header at byte 0 is over 65,536 bytes"):
        headers_crc(lambda at, n: data[at:at + n], 0, len(data))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.integers(0, 400))
def test_any_bytes_give_a_crc_or_a_page_header_error(data: bytes, end: int) -> None:
    try:
        headers_crc(lambda at, n: data[at:at + n], 0, min(end, len(data)))
    except PageHeaderError:
        pass
