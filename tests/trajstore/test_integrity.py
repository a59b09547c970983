"""Sealed files: a flipped byte anywhere is reported by `verify` and by reads, never returned as data.

Parquet checksums a page's data but neither its header nor the footer; trajstore records the CRC-32
of the footer, of the page headers and of the whole file in the file's name
(trajstore.table.Table.write_file). These tests flip bytes in the footer, in the page headers, in
the page data and across the whole file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import trajstore
from trajstore import CorruptionError
from trajstore.page_headers import _page_header
from trajstore.table import _footer_span, file_crcs

QUERY = "SELECT * FROM events ORDER BY event_id"  # every column: a damaged page anywhere is read


def sealed_store(path: Path) -> tuple[trajstore.Store, Path, list[dict]]:
    store = trajstore.open_store(path)
    with store.writer("w") as w:
        w.append([
            {"kind": "turn", "group_id": "g", "rollout_id": f"r{i}", "segment_id": f"s{i}", "turn_index": 0,
             "policy_version": 0, "prompt_ids": list(range(i, i + 40)), "output_ids": list(range(i, i + 60)),
             "output_logprobs": [-0.5] * 60}
            for i in range(300)
        ])
    (sealed,) = (path / "events").glob("*.parquet")
    return store, sealed, store.query(QUERY).to_pylist()


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def test_sealed_file_names_carry_footer_and_file_crcs(tmp_path: Path) -> None:
    _, sealed, _ = sealed_store(tmp_path / "s")
    crcs = file_crcs(sealed.name)
    assert crcs is not None
    import zlib

    data = sealed.read_bytes()
    assert crcs == (zlib.crc32(data[-_footer_span(data):]), zlib.crc32(data))


def test_sealed_files_dictionary_encode_and_keep_statistics_of_scalar_columns_only(tmp_path: Path) -> None:
    """Token ids and logprobs are written plain (zstd shrinks them; a dictionary index it cannot), and so are the
    request and response JSON; the scalar columns are dictionary-encoded with min/max kept."""
    import pyarrow.parquet as pq

    _, sealed, rows = sealed_store(tmp_path / "s")
    meta = pq.ParquetFile(sealed).metadata.row_group(0)
    columns = {meta.column(i).path_in_schema: meta.column(i) for i in range(meta.num_columns)}
    for plain in ("prompt_ids.list.element", "output_ids.list.element", "output_logprobs.list.element", "request",
                  "response"):
        assert not any("DICTIONARY" in e for e in columns[plain].encodings), plain
        assert columns[plain].statistics is None or not columns[plain].statistics.has_min_max, plain
    for scalar in ("event_id", "rollout_id", "writer", "kind", "turn_index"):
        assert any("DICTIONARY" in e for e in columns[scalar].encodings), scalar
        assert columns[scalar].statistics.has_min_max, scalar
    assert sorted(tuple(r["prompt_ids"]) for r in rows) == [tuple(range(i, i + 40)) for i in range(300)]


@pytest.mark.parametrize("where", ["footer", "footer_length", "page_data"])
def test_flipped_byte_is_reported_by_reads_and_verify(tmp_path: Path, where: str) -> None:
    _, sealed, _ = sealed_store(tmp_path / "s")
    data = sealed.read_bytes()
    span = _footer_span(data)
    offset = {"footer": len(data) - span + span // 2, "footer_length": len(data) - 6,
              "page_data": len(data) // 3}[where]
    flip(sealed, offset)
    fresh = trajstore.open_store(tmp_path / "s")  # a new process would start with nothing verified
    with pytest.raises(CorruptionError):
        fresh.query(QUERY)
    report = fresh.verify()
    assert not report.ok and any(sealed.name in p for p in report.problems)


@pytest.mark.parametrize("mask", [0x01, 0x5A, 0x80])
def test_a_flipped_page_header_byte_is_reported_not_read_as_other_data(tmp_path: Path, mask: int) -> None:
    """A data page's header holds its value count and encodings outside the page checksum: a lower count
    once dropped the end of the last row's prompt_ids, and PLAIN read as BYTE_STREAM_SPLIT is other numbers."""
    import pyarrow.parquet as pq

    _, sealed, _ = sealed_store(tmp_path / "s")
    original = sealed.read_bytes()
    row_group = pq.ParquetFile(sealed).metadata.row_group(0)
    chunks = {row_group.column(i).path_in_schema: row_group.column(i) for i in range(row_group.num_columns)}
    for column in ("prompt_ids.list.element", "event_id", "turn_index"):
        start = chunks[column].data_page_offset  # a data page's header: type, sizes, CRC, count, encodings
        for offset in range(start, start + 20):
            data = bytearray(original)
            data[offset] ^= mask
            sealed.write_bytes(bytes(data))
            fresh = trajstore.open_store(tmp_path / "s")
            with pytest.raises(CorruptionError, match="verify"):
                fresh.query(QUERY)
            assert not fresh.verify().ok


def test_byte_flips_across_a_sealed_file_never_return_other_data(tmp_path: Path) -> None:
    _, sealed, expected = sealed_store(tmp_path / "s")
    original = sealed.read_bytes()
    step = max(1, len(original) // 40)
    for offset in range(4, len(original) - 4, step):
        sealed.write_bytes(original)
        flip(sealed, offset)
        fresh = trajstore.open_store(tmp_path / "s")
        try:
            got = fresh.query(QUERY).to_pylist()
        except (CorruptionError, trajstore.QueryError):
            got = None  # reported, not returned
        assert got in (None, expected), f"flip at byte {offset} returned other data: {got}"
        assert not fresh.verify().ok, f"verify missed a flip at byte {offset}"


@pytest.mark.parametrize("sql", ["SELECT parquet FROM events", "SELECT * FROM nowhere", "SELEC 1",
                                 "SELECT 'checksum'::INTEGER", "SELECT * FROM read_parquet('/nonexistent.parquet')"])
def test_a_sql_mistake_is_a_query_error_with_duckdbs_message_not_damage(tmp_path: Path, sql: str) -> None:
    store, _, _ = sealed_store(tmp_path / "s")
    with pytest.raises(trajstore.QueryError) as err:
        store.query(sql)
    assert not isinstance(err.value, CorruptionError)
    assert "verify" not in str(err.value) and "The views are" in str(err.value)


def test_damage_met_while_querying_is_corruption_named_by_the_checksums(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    store, sealed, _ = sealed_store(tmp_path / "s")
    row_group = pq.ParquetFile(sealed).metadata.row_group(0)
    (chunk,) = [row_group.column(i) for i in range(row_group.num_columns)
                if row_group.column(i).path_in_schema == "prompt_ids.list.element"]
    length, size = _page_header(sealed.read_bytes(), chunk.data_page_offset)
    flip(sealed, chunk.data_page_offset + length + size // 2)  # page data: footer and headers (checked on open)
    # are intact
    fresh = trajstore.open_store(tmp_path / "s")
    with pytest.raises(CorruptionError, match="verify"):
        fresh.query(QUERY)
    with pytest.raises(trajstore.QueryError) as err:  # a mistake in SQL is still a mistake in SQL
        fresh.query("SELECT parquet FROM events")
    assert not isinstance(err.value, CorruptionError)


def _every_read_path(store: trajstore.Store) -> dict[str, object]:
    """Each way a caller reads sealed rows: replay and the viewer narrow, the viewer projects,
    the learner takes shards, the collector asks what is stored."""
    def narrow() -> object:
        with store.snapshot() as snap:
            return snap.narrow("rollout_id", ["r7"])

    def project() -> object:
        with store.snapshot() as snap:
            return snap.project(["rollout_id", "prompt_ids", "output_ids", "output_logprobs"])

    def read_files() -> object:
        with store.snapshot() as snap:
            return snap.read_files(snap.files, columns=["output_ids"])

    return {"narrow": narrow, "project": project, "read_files": read_files,
            "holds_rollout": lambda: store.holds_rollout("r7"),
            "shard": lambda: store.shard(policy_version=0, max_staleness=4)}


@pytest.mark.parametrize("path", ["narrow", "project", "read_files", "holds_rollout", "shard"])
def test_every_reader_reports_a_damaged_page_as_querys_damage_report(tmp_path: Path, path: str) -> None:
    """Replay, learn and the viewer read through these; each names the file and the fix, as `query` does."""
    _, sealed, _ = sealed_store(tmp_path / "s")
    data = sealed.read_bytes()
    pages = len(data) - _footer_span(data)
    for offset in range(8, pages, pages // 64):  # a page of every column: the footer (checked on open) is intact
        flip(sealed, offset)
    fresh = trajstore.open_store(tmp_path / "s")
    with pytest.raises(CorruptionError) as err:
        _every_read_path(fresh)[path]()  # type: ignore[operator]
    with pytest.raises(CorruptionError) as from_query:
        fresh.query(QUERY)
    assert str(err.value) == str(from_query.value)
    assert sealed.name in str(err.value) and f"trajstore verify --store {tmp_path / 's'}" in str(err.value)
