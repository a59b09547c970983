"""Writer names unique across machines: a spool id per machine, and a claim of each name in the table.

A writer's name owns its write-ahead directory, but only on its own machine: the `flock`
that keeps two processes of one machine apart cannot see another machine. Two machines
writing an `s3://` store under one name (two containers with one hostname and one pid make
the same `<host>-<pid>`) would each acknowledge appends that the other's seals then refuse.
So, for a remote store:

- every spool directory (the writing machine's `wal_root`) has a random 62-bit id, made once
  and kept in `<wal_root>/.spool-id`: it identifies the machine's disk, not its hostname;
- a writer claims its name in the Delta table when it opens, before it acknowledges anything:
  a commit of the application transaction `owner:<name>` whose version is the spool id (no
  data). The commit is conditional (Delta's conflict check plus a precheck against the
  latest version), so of two machines racing for one name exactly one wins; the other's
  open fails with `WriterBusyError`. Reopening a name on its own machine costs no commit.
- default writer names carry the spool id (`unique_name`, per process; `machine_name`, per
  machine: a role such as a run's learner keeps its name across restarts on one machine and
  takes another on the next), so they never clash.

A name stays with its machine's spool: a writer that moves to another machine (its old disk
lost) takes a new name. A local store needs no claim: its write-ahead directories live in the
store directory itself, where the flock sees every writer.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

from deltalake import DeltaTable

from trajstore.durable import fsync_path, sync_file
from trajstore.errors import CorruptionError, WriterBusyError
from trajstore.table import Table

SPOOL_ID_FILE = ".spool-id"
CLAIM_PREFIX = "owner:"  # writer names cannot hold ':', so no claim's app id is a writer's


def spool_id(wal_root: Path) -> int:
    """The id of this machine's spool for a store (created on first use; atomic if two processes race)."""
    path = wal_root / SPOOL_ID_FILE
    if not path.exists():
        wal_root.mkdir(parents=True, exist_ok=True)
        tmp = wal_root / f"{SPOOL_ID_FILE}.{secrets.token_hex(4)}"
        with open(tmp, "w") as f:
            f.write(f"{secrets.randbits(62) + 1}\n")
            sync_file(f)
        try:
            os.link(tmp, path)  # create-if-absent: a racing process's id wins, and both read it below
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        fsync_path(wal_root)
    text = path.read_text().strip()
    if not text.isdigit():
        raise CorruptionError(f"{path} should hold this machine's spool id (a number), not {text[:40]!r}; delete it "
                              "only if no writer of this machine has sealed anything (writers claimed their names "
                              "with it)")
    return int(text)


def unique_name(wal_root: Path, prefix: str = "") -> str:
    """`<prefix><host>-<pid>-<spool id>`: unique across machines whatever their hostnames and pids."""
    host = "".join(c if c.isalnum() or c in "._-" else "_" for c in socket.gethostname())[:40] or "host"
    return f"{prefix}{host}-{os.getpid()}-{spool_id(wal_root):x}"[:100]


def machine_name(wal_root: Path, prefix: str) -> str:
    """`<prefix>-<spool id>`: the same for every process of this machine, another on any other machine."""
    suffix = f"-{spool_id(wal_root):x}"
    return prefix[:100 - len(suffix)] + suffix


def claim(table: Table, name: str, owner: int) -> None:
    """Make `name` this spool's in the table, or raise WriterBusyError if another spool holds it."""
    app = CLAIM_PREFIX + name

    def holder(dt: DeltaTable) -> int | None:
        version = dt.transaction_version(app)
        return None if version is None else int(version)

    def precheck(dt: DeltaTable) -> bool:
        current = holder(dt)
        if current is None:
            return True
        if current == owner:
            return False  # claimed already (an earlier open, or an attempt whose reply was lost)
        raise WriterBusyError(
            f"writer name {name!r} of {table.location.uri} belongs to another machine (spool id {current:x}; this "
            f"machine's is {owner:x}, in {table.location.wal_root / SPOOL_ID_FILE}): two machines appending under "
            "one name would lose events at seal time, so nothing was appended. Give this writer another name (the "
            "default names are unique across machines)")

    if precheck(table.current()):
        table.commit([], operation="claim", writer_txn=(app, owner), precheck=precheck)
