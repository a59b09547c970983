"""`PackedIds`: token ids as the embedded server's `prompt_token_ids_b64` (base64 of little-endian int32).

A log's packed form grows lazily and by the new ids only, at 3-byte base64 boundaries; whatever the
order of extends, views and packings, a view packs to exactly the one-shot encoding of its ids, and
the server's own decoder reads back the very ids.
"""

from __future__ import annotations

import base64

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.embedded.protocol import unpack_prompt
from collectors.policy.http import dumps
from collectors.policy.token_ids import PackedIds, TokenLog

IDS = st.lists(st.integers(0, 2**31 - 1), max_size=40)


def one_shot(ids: list[int]) -> bytes:
    return b'"' + base64.b64encode(np.array(ids, dtype="<i4").tobytes()) + b'"'


@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=200))
def test_packed_ids_round_trip_through_the_servers_decoder(ids: list[int]) -> None:
    packed = PackedIds(ids)
    assert packed.pending == len(ids) and packed.quoted() == one_shot(ids) and packed.pending == 0
    assert unpack_prompt(packed.text()).tolist() == ids
    assert orjson.loads(dumps({"p": packed})) == {"p": packed.text()}


@settings(max_examples=200)
@given(st.lists(st.tuples(IDS, IDS, st.booleans()), min_size=1, max_size=8))
def test_a_growing_log_packs_each_view_as_the_one_shot_encoding(steps: list[tuple[list[int], list[int], bool]]) -> None:
    """Each step extends the log, then maybe packs a view of it plus a delta; views taken earlier stay right."""
    log, plain, views = TokenLog(), [], []
    for more, delta, pack in steps:
        log.extend(more)
        plain += more
        view = log.view(delta)
        views.append((view, plain + delta))
        if pack and len(view):
            assert PackedIds(view).quoted() == one_shot(plain + delta)
            assert log.view().unpacked() == 0  # the log's form grew to the view's start
    for view, ids in views:  # packed after the log grew past them
        if ids:
            assert PackedIds(view).quoted() == one_shot(ids)


def test_an_id_past_int32_is_refused_and_leaves_the_log_packable() -> None:
    log = TokenLog([1, 2, 3])
    with pytest.raises(ValueError, match=r"1\.\.2147483648 do not all fit int32"):
        PackedIds(log.view([2**31])).quoted()
    with pytest.raises(ValueError, match="fit int32"):
        dumps({"prompt_token_ids_b64": PackedIds([-(2**40)])})  # through the standard library's fallback too
    assert PackedIds(log.view([4])).quoted() == one_shot([1, 2, 3, 4])


def test_long_logs_and_deltas_pack_a_slice_at_a_time_as_in_one_call() -> None:
    """Past `SLICE` ids (a huge prompt), the ids are packed and base64-encoded a slice at a time, so that no single
    call holds the GIL for the whole list; the text is the one-shot encoding, wherever the slices fall."""
    from collectors.policy.token_ids import SLICE

    rng = np.random.default_rng(0)
    first = rng.integers(0, 2**31 - 1, 2 * SLICE + 5).tolist()
    delta = rng.integers(0, 2**31 - 1, SLICE + 1).tolist()
    assert PackedIds(first + delta).quoted() == one_shot(first + delta)  # a plain list
    log = TokenLog(first)
    assert PackedIds(log.view(delta)).quoted() == one_shot(first + delta)
    log.extend(delta)
    assert PackedIds(log.view([7])).quoted() == one_shot(first + delta + [7])


@settings(max_examples=200)
@given(st.lists(st.tuples(IDS, IDS, st.sampled_from(["tail", "whole", "crc", "none"]), st.booleans()), min_size=1,
                max_size=8))
def test_a_log_grown_by_a_packed_tail_takes_its_bytes_and_stays_exact(
        steps: list[tuple[list[int], list[int], str, bool]]) -> None:
    """The proxy's calls: a view of the log plus the new prompt ids is sent (the tail alone packed, as to a server
    holding the log, or the whole view), then the log grows by the tail (taking the bytes the packing made) and the
    output. Whatever came before, every crc32 and packing is that of the ids as one list."""
    import zlib

    log, plain = TokenLog(), []
    for delta, output, sent, check in steps:
        view = log.view(delta)
        if sent == "tail" and delta:
            assert PackedIds(view, tail_only=True).quoted() == one_shot(delta)
        elif sent == "whole" and len(view):
            assert PackedIds(view).quoted() == one_shot(plain + delta)
        elif sent == "crc":
            assert view.logged_crc32() == zlib.crc32(np.array(plain, dtype="<i4").tobytes())
        log.extend(view.tail, view.tail_json(), view.tail_int32(made_only=True))
        log.extend(output)
        plain += delta + output
        if check:  # else the packed form stays behind the log, and the next tail's bytes are not taken
            assert log.crc32(len(plain)) == zlib.crc32(np.array(plain, dtype="<i4").tobytes())
        assert log.ids.tolist() == plain and log.view().json() == orjson.dumps(plain)
    assert log.crc32(len(plain)) == zlib.crc32(np.array(plain, dtype="<i4").tobytes())
    if plain:
        assert PackedIds(log.view()).quoted() == one_shot(plain)
