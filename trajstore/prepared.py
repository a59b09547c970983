"""A batch of events validated and converted to Arrow columns, ready for `Writer.append`.

Preparing is all the CPU of an append but the write (validation, JSON text, token lists to Arrow);
a writer given a prepared batch only numbers, writes and syncs it, so a caller can prepare on its
own thread while another append holds the disk (the capture proxy's group commit does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pyarrow as pa

from trajstore.events import Event, to_columns


@dataclass(frozen=True)
class PreparedBatch:
    """Events as columns (`prepare`). Event ids are filled in here; duplicates are found when it is appended."""

    columns: Mapping[str, pa.Array]  # every column but the writer's (writer, writer_epoch, writer_seq)

    def __len__(self) -> int:
        return len(self.columns["event_id"])

    @staticmethod
    def join(batches: Sequence[PreparedBatch]) -> PreparedBatch:
        """One batch holding `batches`' events in order (several callers' events, appended together)."""
        if len(batches) == 1:
            return batches[0]
        return PreparedBatch({name: pa.concat_arrays([b.columns[name] for b in batches]) for name in batches[0].columns})


def prepare(events: Sequence[Event | Mapping[str, Any]], *, now: datetime | None = None) -> PreparedBatch:
    """Validate and convert events (`to_columns`); raises InvalidEventError listing every problem."""
    return PreparedBatch(to_columns(events, now=now))
