"""Staleness-bounded admission (AReaL-style): may a collector start another group now?

The learner trains groups oldest first, `G` groups per published version (`groups_per_version`,
announced in its checkpoint events). With `L` the newest published version, `p` groups ahead
of a new one that are admitted but neither consumed by a checkpoint nor dead, the new group
is trained by the learner holding version `L + p // G`. It is sampled by the version the policy
server serves now, `v`. So it may start only when

    L + p // G - v <= K          (K = --max-staleness)

and otherwise waits until the learner consumes groups (L grows, p shrinks) or the server
loads a newer version (v grows). A group is *dead* when it can no longer be trained: every
rollout finished but too few are usable, or its oldest tokens are already more than K
versions behind L (the learner's shard would skip it).

Several collectors of one run share the room the rule leaves: each sees the others' groups only
at its next store poll, so had each filled the whole room between polls, C collectors would
admit C times what the learner can take in time, most of it trained too stale or never. So
between two polls a collector admits at most its `share` of the room it saw: room // C, and one
more for the first room % C collectors in id order counted from a turn that moves every
`TURN_S` seconds (so a collector that is gone cannot hold room for long), where C counts the
collectors that started a rollout of the run in the last `ACTIVE_S` seconds (each names itself
in its rollouts' started status, meta `collector`). A collector that does not yet see its own
rollouts in the store (starting up: the others cannot see it either) admits one group per poll.
Together they take the room once, whatever the poll's lag, up to clock skew at a turn's edge.

`admissible`, `room`, `share` and `count_pending` are pure; `read_group_rows` and
`read_collectors` are the store queries they need.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
import time
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import pyarrow as pa

from trajstore.schema import TERMINAL_STATUSES


class Queryable(Protocol):
    """A Store or one of its Snapshots."""

    def query(self, sql: str, params: Any = None) -> pa.Table: ...


@dataclass(frozen=True)
class StoreGroup:
    """What the store knows of one group of the run."""

    group_id: str
    consumed: bool  # some rollout of it is in a checkpoint's `consumed` list
    running: int  # rollouts started and not finished
    trainable: int  # rollouts completed/truncated with a reward
    planned: int  # the group size its status events carry (0 when unknown)
    oldest: int | None  # oldest policy version of its turns

    @property
    def complete(self) -> bool:
        """As the `groups` view says: every rollout finished and at least the planned number usable."""
        return self.running == 0 and self.trainable >= max(self.planned, 1)


@dataclass
class LocalGroup:
    """A group this process admitted: the version served then, and whether its slots are done."""

    admitted_version: int
    done: bool = False
    complete: bool = False
    done_tick: int = -1  # the store poll tick running when it finished (see count_pending)


def admissible(latest: int, served: int, pending: int, groups_per_version: int, max_staleness: int) -> bool:
    """The admission rule: the new group, trained at version `latest + pending // G`, is at most
    `max_staleness` versions newer than the `served` version that samples it."""
    return latest + pending // groups_per_version - served <= max_staleness


def room(latest: int, served: int, pending: int, groups_per_version: int, max_staleness: int) -> int:
    """How many more groups the rule admits now (`admissible` holds for the next one exactly when this is > 0)."""
    return (max_staleness + served - latest + 1) * groups_per_version - pending


def share(free: int, collectors: Iterable[str], me: str, turn: int = 0) -> int:
    """This collector's part of `free` groups of room when the `collectors` it saw fill it at once: an
    equal split, the remainder going to the next ones in id order from position `turn` (so together
    they take `free`, and a collector that is gone holds no group of room for long). While it does
    not see itself among them, the others may not see it either: one group at a time then."""
    order = sorted(set(collectors))
    if free <= 0:
        return 0
    if me not in order:
        return 1
    base, extra = divmod(free, len(order))
    return base + ((order.index(me) - turn) % len(order) < extra)


def turn_now() -> int:
    """Whose turn the remainder of a split room is: the same for every collector, moving every TURN_S seconds."""
    return int(time.time() // TURN_S)


def staleness_if_admitted(latest: int, served: int, pending: int, groups_per_version: int) -> int:
    return latest + pending // groups_per_version - served


def count_pending(store_groups: Iterable[StoreGroup], local: Mapping[str, LocalGroup], *, latest: int | None,
                  max_staleness: int, exclude: str | None = None) -> int:
    """How many groups are admitted but neither consumed nor dead.

    `store_groups` come from the last store poll, `local` are this process's groups (they may
    not be in that poll yet, or may have moved on since): a local group counts while its slots
    run, and after that while it is complete; the store adds every other collector's groups
    and says which groups were consumed. `exclude` is the candidate group itself (a resumed one).
    """
    floor = None if latest is None else latest - max_staleness
    by_id = {g.group_id: g for g in store_groups}
    pending = 0
    for group_id in by_id.keys() | local.keys():
        if group_id == exclude:
            continue
        stored, mine = by_id.get(group_id), local.get(group_id)
        if stored is not None and stored.consumed:
            continue
        versions = [v for v in (stored.oldest if stored else None, mine.admitted_version if mine else None)
                    if v is not None]
        if floor is not None and versions and min(versions) < floor:
            continue  # already too stale for the learner: it will never be trained
        if mine is not None:
            pending += (not mine.done) or mine.complete
        elif stored is not None:
            pending += stored.running > 0 or stored.complete
    return pending


_GROUPS_SQL = f"""
    WITH r AS (SELECT group_id, rollout_id, status, trainable, group_size, min_version
               FROM rollouts WHERE run = $run),
    c AS (SELECT DISTINCT rollout_id FROM consumed WHERE run = $run)
    SELECT r.group_id,
           bool_or(c.rollout_id IS NOT NULL) AS consumed,
           count(*) FILTER (WHERE r.status IS NULL OR r.status NOT IN
                            ({", ".join(repr(s) for s in sorted(TERMINAL_STATUSES))})) AS running,
           count(*) FILTER (WHERE r.trainable) AS trainable,
           coalesce(max(r.group_size), 0) AS planned,
           min(r.min_version) AS oldest
    FROM r LEFT JOIN c USING (rollout_id)
    GROUP BY r.group_id
"""


ACTIVE_S = 120.0  # a collector that started no rollout for this long no longer counts for `share`
TURN_S = 2.0  # how long one collector holds the remainder of a split room
_COLLECTORS_SQL = """
    SELECT DISTINCT json_extract_string(meta, '$.collector') AS collector FROM events
    WHERE kind = 'status' AND status = 'started' AND run = $run AND time >= $since
      AND json_extract_string(meta, '$.collector') IS NOT NULL
"""


def read_collectors(snapshot: Queryable, run: str) -> list[str]:
    """The collectors that started a rollout of `run` in the last ACTIVE_S seconds."""
    since = datetime.now(UTC) - timedelta(seconds=ACTIVE_S)
    return snapshot.query(_COLLECTORS_SQL, {"run": run, "since": since}).column("collector").to_pylist()


def read_group_rows(snapshot: Queryable, run: str) -> list[StoreGroup]:
    """Every group of `run` as the store (or one snapshot of it) sees it."""
    table = snapshot.query(_GROUPS_SQL, {"run": run})
    return [StoreGroup(r["group_id"], bool(r["consumed"]), int(r["running"]), int(r["trainable"]),
                       int(r["planned"]), r["oldest"]) for r in table.to_pylist()]
