"""The CRC-32 of a Parquet file's page headers, which Parquet's own checksums leave out.

A Parquet page checksum covers the page's compressed data, not the header in front of it, and the
footer has no checksum at all. The footer is covered by a CRC in the sealed file's name
(`trajstore.table`); this module covers the headers. A flipped bit in a header can change the
data without failing any check pyarrow makes: a data page's value count cut short drops the end
of a token list (found by flipping every byte of a sealed file), and an encoding of PLAIN turned
into BYTE_STREAM_SPLIT decodes the same bytes as other numbers.

`headers_crc` walks the pages from the first one (after the magic bytes) to the footer: each header
is read, and the page's data stepped over by the header's compressed size. The pages of a file
trajstore writes (no page index, no bloom filter) fill that range, column chunk after column chunk,
so the walk needs no metadata and ends exactly at the footer. It reads a file's small pages a window
at a time and a large page's header alone: a reader checks a file's headers for a read or two per
megabyte of the file, instead of reading the whole file for its CRC. Written here because neither
pyarrow nor any library on the registries exposes Parquet page headers; the walk needs only Thrift's
compact protocol, enough of it to find a header's end.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

ReadAt = Callable[[int, int], bytes]  # (offset, nbytes) -> the bytes there, fewer at the end


class PageHeaderError(ValueError):
    """The pages cannot be walked: a header is malformed, or the pages do not end where the footer starts."""


class _Short(Exception):
    """The bytes read end inside the header: read more."""


def headers_crc(read_at: ReadAt, start: int, end: int) -> int:
    """CRC-32 of the headers of the pages that fill bytes [`start`, `end`) of a file, in order."""
    crc, pos = 0, start
    buffer, at, asked = b"", start, 0  # file bytes [at, at + len(buffer)), read asking for `asked`
    while pos < end:
        try:
            length, compressed = _page_header(buffer, pos - at)
        except (_Short, IndexError):
            if at + len(buffer) >= end or (at == pos and len(buffer) < asked):
                raise PageHeaderError(f"the page header at byte {pos} runs past the pages' end at "
                                      f"{min(end, at + len(buffer))}") from None
            if at == pos and len(buffer) >= MAX_HEADER:
                raise PageHeaderError(f"the page header at byte {pos} is over {MAX_HEADER:,} bytes") from None
            asked = min(len(buffer) * 8 if at == pos and buffer else _WINDOW, end - pos, MAX_HEADER)  # 8x: longer
            buffer, at = bytes(read_at(pos, asked)), pos
            continue
        crc = zlib.crc32(memoryview(buffer)[pos - at:pos - at + length], crc)
        pos += length + compressed
    if pos != end:
        raise PageHeaderError(f"the last page ends at byte {pos}, not at the footer ({end})")
    return crc


_WINDOW = 16 << 10  # bytes read at a time: many small pages, or one large page's header
MAX_HEADER = 16 << 20  # a longer header is damage (Arrow's reader stops at the same size)


# Thrift compact protocol (https://github.com/apache/thrift/blob/master/doc/specs/thrift-compact-protocol.md)
_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(13)
_COMPRESSED_PAGE_SIZE = 3  # PageHeader's field ids: 1 type, 2 uncompressed size, 3 compressed size, ...
_WIDTHS = {_TRUE: 1, _FALSE: 1, _BYTE: 1, _DOUBLE: 8}  # bytes a list element of these types takes


def _page_header(data: bytes, start: int) -> tuple[int, int]:
    """(length of the PageHeader struct at `start` in `data`, its compressed_page_size). Raises IndexError or
    _Short when `data` ends inside it."""
    pos, compressed = _struct(data, start, 0, _COMPRESSED_PAGE_SIZE)
    if compressed is None or compressed < 0:
        raise PageHeaderError("a page header has no valid compressed_page_size")
    return pos - start, compressed


def _struct(data: bytes, pos: int, depth: int, keep: int | None = None) -> tuple[int, int | None]:
    """(the position after the struct at `pos`, the value of its i32 field `keep` if it has one)."""
    field_id, kept = 0, None
    while True:
        head = data[pos]
        pos += 1
        if head == _STOP:
            return pos, kept
        kind = head & 0x0F
        if head >> 4:
            field_id += head >> 4
        else:
            raw, pos = _varint(data, pos)
            field_id = _unzigzag(raw)
        if field_id == keep and kind == _I32:
            raw, pos = _varint(data, pos)
            kept = _unzigzag(raw)
        elif kind not in (_TRUE, _FALSE):  # a boolean field's value is its header's type
            pos = _skip(data, pos, kind, depth + 1)


def _skip(data: bytes, pos: int, kind: int, depth: int) -> int:
    """The position after a value of compact type `kind` at `pos` (in a list, a map or a field)."""
    if kind in (_I16, _I32, _I64):
        return _varint(data, pos)[1]
    if kind == _BINARY or kind in _WIDTHS:  # a boolean in a list or a map takes a byte
        size, pos = _varint(data, pos) if kind == _BINARY else (_WIDTHS[kind], pos)
        if pos + size > len(data):
            raise _Short
        return pos + size
    if depth > 32:
        raise PageHeaderError("a page header nests deeper than any Parquet header does")
    if kind in (_LIST, _SET):
        head = data[pos]
        pos += 1
        size, element = head >> 4, head & 0x0F
        if size == 15:
            size, pos = _varint(data, pos)
        width = _WIDTHS.get(element)
        if width is not None:  # fixed-width elements: stepped over at once, however many a damaged size says
            if pos + size * width > len(data):
                raise _Short
            return pos + size * width
        for _ in range(size):  # each element takes a byte or more: a size past the data ends in _Short
            pos = _skip(data, pos, element, depth + 1)
        return pos
    if kind == _MAP:
        size, pos = _varint(data, pos)
        if size:
            types = data[pos]
            pos += 1
            for _ in range(size):
                pos = _skip(data, _skip(data, pos, types >> 4, depth + 1), types & 0x0F, depth + 1)
        return pos
    if kind == _STRUCT:
        return _struct(data, pos, depth)[0]
    raise PageHeaderError(f"a page header holds a value of unknown Thrift type {kind}")


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise PageHeaderError("a page header holds a varint longer than 64 bits")


def _unzigzag(raw: int) -> int:
    return (raw >> 1) ^ -(raw & 1)
