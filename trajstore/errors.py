"""The store's named exceptions. Every message says what happened, why, and what to do."""

from __future__ import annotations


class TrajstoreError(Exception):
    """Base class of every error the store raises on purpose."""


class InvalidEventError(TrajstoreError, ValueError):
    """One or more events failed validation; nothing of the call was written.

    `problems` lists every problem as (index of the event in the call, message).
    """

    def __init__(self, problems: list[tuple[int, str]], *, what: str = "event") -> None:
        self.problems = problems
        shown = "\n".join(f"  {what} {i}: {msg}" for i, msg in problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        super().__init__(
            f"{len(problems)} problem(s) found; nothing was written. Fix these and append again:\n{shown}{more}"
        )


class WriterBusyError(TrajstoreError):
    """Another live process owns this writer name."""


class WriterClosedError(TrajstoreError):
    """The writer was closed (or failed) and takes no more appends."""


class CorruptionError(TrajstoreError):
    """Stored bytes do not match their checksum; the data was not returned."""


class CommitConflictError(TrajstoreError):
    """The table kept changing under a commit after every retry."""


class StoreNotFoundError(TrajstoreError):
    """No store exists at the location and the call does not create one."""


class QueryError(TrajstoreError):
    """A SQL query failed; the message carries DuckDB's reason."""


class VersionNotFoundError(TrajstoreError):
    """The table version asked for does not exist (or its log was cleaned up)."""


class ArtifactError(TrajstoreError):
    """A published directory (a checkpoint in object storage) is incomplete, damaged or not the one announced."""


class ExportError(TrajstoreError):
    """An export or an import of an exported dataset cannot be done as asked (unknown run, bad filter, bad input)."""
