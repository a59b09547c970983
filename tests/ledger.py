"""The token ledger's equality, checked after a test's faults: every generated token is in exactly one place."""

from __future__ import annotations

from typing import Any

import trajstore


def ledger_problems(store: trajstore.Store, run: str | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """The `token_ledger` rows (of `run`, or all) and what breaks its equalities: per run and version,
    generated = trained + waiting + stale + discarded and discarded = masked + incomplete + failed + rejected, no
    negative count, and every sampled token of the `turns` view counted once."""
    with store.snapshot() as snap:
        ledger = snap.query("SELECT * FROM token_ledger WHERE $run IS NULL OR run = $run ORDER BY run, version",
                            {"run": run}).to_pylist()
        sampled = snap.query("SELECT coalesce(sum(output_tokens), 0)::BIGINT AS n FROM turns "
                             "WHERE $run IS NULL OR run = $run", {"run": run}).to_pylist()[0]["n"]
    problems = []
    for row in ledger:
        if row["generated"] != row["trained"] + row["waiting"] + row["stale"] + row["discarded"]:
            problems.append(f"generated != trained + waiting + stale + discarded: {row}")
        if row["discarded"] != row["masked"] + row["incomplete"] + row["failed"] + row["rejected"]:
            problems.append(f"discarded != masked + incomplete + failed + rejected: {row}")
        if min(v for k, v in row.items() if k not in ("run", "version")) < 0:
            problems.append(f"a negative count: {row}")
    if sum(r["generated"] for r in ledger) != sampled:
        problems.append(f"the ledger counts {sum(r['generated'] for r in ledger)} generated tokens, the turns {sampled}")
    return ledger, problems


def assert_ledger_balances(store: trajstore.Store, run: str | None = None) -> list[dict[str, Any]]:
    ledger, problems = ledger_problems(store, run)
    assert not problems, problems
    return ledger
