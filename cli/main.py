"""The `trajstore` command: thin click commands, each one library call plus printing.

Command modules import what they need (the store, torch, servers) inside their functions, so
`trajstore --help` and commands that do not need torch never load it.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import click

from cli.annotate_cmd import annotate
from cli.collect_cmd import collect, reward
from cli.collectors_cmds import init_model, serve
from cli.demo_cmd import demo
from cli.export_cmd import export
from cli.learn_cmd import learn
from cli.options import Commands, prepare_process, store_option
from cli.output import CommandConsole, print_table, write_table
from cli.proxy_cmd import proxy
from cli.replay_cmd import replay
from cli.sft_cmd import sft
from cli.view_cmd import view
from trajstore.retention import DEFAULT_RETENTION_HOURS, MAX_RETENTION_HOURS, MIN_RETENTION_HOURS

console = CommandConsole()


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="trajstore")
def main() -> None:
    """trajstore: an event-sourced trajectory store for RL of LLM agents.

    \b
    Try:  trajstore walkthrough --store /tmp/ts
          trajstore query --store /tmp/ts "SELECT * FROM rollouts LIMIT 5"
    """
    prepare_process()


@main.command()
@store_option
@click.argument("sql")
@click.option("--format", "fmt", type=click.Choice(["table", "csv", "json", "parquet"]), default="table",
              show_default=True, help="Output format (json = one object per line).")
@click.option("--output", "-o", type=click.Path(dir_okay=False), help="Write to FILE instead of stdout.")
@click.option("--version", "version", type=click.IntRange(min=0),
              help="Query this table version (time travel; `trajstore stats` shows the latest).")
@click.option("--run", "runs", multiple=True, help="Only the events of this run (repeatable); reads only its files.")
@click.option("--since", type=click.DateTime(["%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d"]),
              help="Only events at or after this UTC time; reads only the files that can hold them.")
@click.option("--until", type=click.DateTime(["%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S", "%Y-%m-%d"]),
              help="Only events at or before this UTC time.")
@click.option("--newest", type=click.IntRange(min=1), metavar="N",
              help="Only the newest N events (of the other scopes); reads the newest files first, only as many as needed.")
def query(store_loc: str, sql: str, fmt: str, output: str | None, version: int | None, runs: tuple[str, ...],
          since: datetime | None, until: datetime | None, newest: int | None) -> None:
    """Run SQL over the store's views.

    Views: events, turns, samples, rollouts, groups, advantages, checkpoints, consumed,
    metrics, step_rollouts, token_ledger. --run, --since, --until and --newest narrow the
    events the views see, and the files read, by the statistics the Delta log keeps.

    \b
    Example:
      trajstore query --store runs/s "SELECT group_id, reward_mean FROM groups WHERE complete"
      trajstore query --store s3://b/s --newest 100 "SELECT kind, time FROM events ORDER BY time DESC"
    """
    import trajstore

    store = trajstore.open_store(store_loc, create=False)
    scope = None
    if runs or since or until or newest:
        scope = trajstore.Scope(runs=runs, since=_utc(since), until=_utc(until), newest=newest)
    write_table(store.query(sql, version=version, scope=scope), fmt, output, console)


def _utc(t: datetime | None) -> datetime | None:
    return t.replace(tzinfo=timezone.utc) if t else None


@main.command()
@store_option
@click.argument("file", type=click.Path(exists=True))
@click.option("--writer", help="Writer name (default: <host>-<pid>-<spool id>, unique across machines).")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "hf"]), default="jsonl", show_default=True,
              help="jsonl: a JSON-lines file of events; hf: a directory written by `trajstore export --format hf` "
                   "(its samples, rewards and statuses become events again).")
def ingest(store_loc: str, file: str, writer: str | None, fmt: str) -> None:
    """Append a JSON-lines file of events (see schemas/event.v1.schema.json), or an hf export.

    The whole file is validated first; a bad line is reported with its number and
    nothing is written. Ingesting the same file (or export) twice stores each event once.

    \b
    Examples:
      trajstore ingest --store runs/s events.jsonl
      trajstore ingest --store runs/s2 --format hf ds/
    """
    import trajstore

    store = trajstore.open_store(store_loc)
    if fmt == "hf":
        from trajstore.export import ingest_hf

        console.print(f"{ingest_hf(store, file, writer=writer)} events appended from the hf export {file}; "
                      f"table version {store.version()}")
        return
    if Path(file).is_dir():
        raise click.BadParameter(f"{file} is a directory; give a JSON-lines file, or --format hf for an hf export",
                                 param_hint="FILE")
    result = store.ingest(file, writer=writer)
    console.print(f"{result.lines} events read, {result.appended} appended, "
                  f"{result.duplicates} already stored; table version {result.table_version}")


@main.command()
@store_option
def stats(store_loc: str) -> None:
    """Runs, rollouts, samples, tokens, policy versions and disk use.

    \b
    Example:
      trajstore stats --store runs/s
    """
    import trajstore

    import pyarrow as pa

    s = trajstore.open_store(store_loc, create=False).stats()
    console.print(f"[bold]{s.location}[/bold]  table version {s.table_version}")
    console.print(f"sealed: {s.sealed_files} files, {s.sealed_bytes / 1e6:.2f} MB; "
                  f"live: {s.live_segments} segments, {s.live_bytes / 1e6:.2f} MB")
    console.print(f"events: {s.summary['events']}, checkpoints: {s.summary['checkpoints']}, "
                  f"latest checkpoint version: {s.summary['latest_checkpoint']}")
    print_table(pa.Table.from_pylist(s.runs) if s.runs else pa.table({"run": pa.array([], pa.string())}), console,
                title="runs")
    for run in s.runs:
        share = run.get("multi_version_samples")
        if share is not None:
            console.print(f"run {run['run']}: {share:.1%} of samples span more than one policy version")
    if s.ledger:  # generated = trained + waiting + stale + discarded (masked + incomplete + failed + rejected)
        print_table(pa.Table.from_pylist(s.ledger), console, title="token ledger (generated tokens by policy version)")


@main.command()
@store_option
@click.option("--target-mb", type=click.IntRange(min=1), default=128, show_default=True,
              help="Size of the files compaction writes.")
@click.option("--follow", is_flag=True, help="Keep running: compact whenever --min-files small files gathered, "
              "vacuum hourly with --retention-hours (a service beside a long run, e.g. on object storage).")
@click.option("--every", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
              help="With --follow: seconds between checks.")
@click.option("--min-files", type=click.IntRange(min=2), default=32, show_default=True,
              help="With --follow: merge once this many files are smaller than --target-mb.")
@click.option("--retention-hours", type=click.FloatRange(min=1), default=168, show_default=True,
              help="With --follow: vacuum files replaced longer ago than this (at least 1 hour).")
def compact(store_loc: str, target_mb: int, follow: bool, every: float, min_files: int,
            retention_hours: float) -> None:
    """Seal segments left by dead writers and merge small sealed files.

    \b
    Example:
      trajstore compact --store runs/s --target-mb 256
      trajstore compact --store s3://bucket/run --follow --min-files 32 --every 30
    """
    import trajstore
    from trajstore.maintenance import CompactPolicy, CompactResult, compact_follow

    store = trajstore.open_store(store_loc, create=False)

    def report(r: CompactResult) -> None:
        for writer, n in r.orphans_sealed.items():
            console.print(f"sealed {n} events left by writer {writer}")
        console.print(f"files: {r.files_before} -> {r.files_after} ({r.rewritten} rewritten); "
                      f"table version {r.version if r.version is not None else 'unchanged'}")

    if follow:
        policy = CompactPolicy(target_bytes=target_mb << 20, every_s=every, min_files=min_files,
                               retention_hours=retention_hours)
        compact_follow(store.location, store.table, policy, report=report)
    else:
        report(store.compact(target_bytes=target_mb << 20))


@main.command()
@store_option
@click.option("--retention-hours", type=click.FloatRange(min=MIN_RETENTION_HOURS, max=MAX_RETENTION_HOURS),
              default=DEFAULT_RETENTION_HOURS, show_default=True,
              help=f"Keep unreferenced files younger than this ({MIN_RETENTION_HOURS} hour to a century; time travel "
                   "reaches this far back).")
@click.option("--dry-run", is_flag=True, help="List what would be deleted; delete nothing.")
def vacuum(store_loc: str, retention_hours: float, dry_run: bool) -> None:
    """Reclaim disk: delete files the table no longer references (replaced by compaction, or left by a crash).

    External readers (Spark, Polars, DuckDB) must read the table through its Delta log: until a
    vacuum, the directory also holds files no version uses, which a glob of *.parquet counts twice.

    \b
    Example:
      trajstore compact --store runs/s && trajstore vacuum --store runs/s --retention-hours 24
    """
    import trajstore

    r = trajstore.open_store(store_loc, create=False).vacuum(retention_hours=retention_hours, dry_run=dry_run)
    verb = "would delete" if r.dry_run else "deleted"
    console.print(f"{verb} {len(r.files)} unreferenced file(s), {r.bytes / 1e6:.2f} MB (retention "
                  f"{r.retention_hours:g} h)")


@main.command()
@store_option
def verify(store_loc: str) -> None:
    """Check every segment's checksums and the table's files; exit 1 on any problem.

    \b
    Example:
      trajstore verify --store runs/s
    """
    import trajstore

    r = trajstore.open_store(store_loc, create=False).verify()
    console.print(f"table version {r.table_version}: {r.sealed_files} sealed files, {r.segments} live segments, "
                  f"{r.events_checked} events checked")
    if r.ok:
        console.print("[green]ok[/green]: every checksum matches")
        return
    for problem in r.problems:
        console.print(f"[red]problem[/red]: {problem}", highlight=False)
    raise SystemExit(1)


@main.command()
@click.option("--store", "store_loc", default="walkthrough-store", show_default=True,
              help="Where to create the walkthrough's store (a fresh directory).")
@click.option("--groups", type=click.IntRange(min=1), default=12, show_default=True)
@click.option("--group-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def walkthrough(store_loc: str, groups: int, group_size: int, seed: int) -> None:
    """Ingest a generated multi-turn, multi-group agent run and query it.

    \b
    Example:
      trajstore walkthrough --store /tmp/ts --groups 20
    """
    import trajstore
    from trajstore.synth import generate_run

    path = Path(store_loc)
    if path.exists() and any(path.iterdir()):
        raise click.ClickException(f"{path} is not empty; pass --store with a new directory")
    path.mkdir(parents=True, exist_ok=True)
    events = generate_run(groups=groups, group_size=group_size, seed=seed)
    jsonl = path / "generated-run.jsonl"
    jsonl.write_text("".join(json.dumps(e) + "\n" for e in events))
    store = trajstore.open_store(path)
    r = store.ingest(jsonl, writer="walkthrough")
    console.rule("1. ingest")
    console.print(f"$ trajstore ingest --store {path} {jsonl}\n{r.lines} events read, {r.appended} appended")
    r2 = store.ingest(jsonl, writer="walkthrough")
    console.print(f"again: {r2.appended} appended, {r2.duplicates} already stored (event ids derive from content)")
    steps = [
        ("2. rollouts: reward = sum of the latest value per component; fan-out into samples",
         "SELECT rollout_id, status, reward, segments, sessions, turns, tokens, trainable_tokens "
         "FROM rollouts ORDER BY rollout_id LIMIT 8"),
        ("3. groups: completeness and reward spread",
         "SELECT group_id, size, complete, trainable, reward_mean, reward_std, min_version FROM groups "
         "ORDER BY group_id LIMIT 6"),
        ("4. advantages by SQL: " + ", ".join(trajstore.ESTIMATOR_TITLES[name] for name in trajstore.ESTIMATORS),
         f"SELECT rollout_id, reward, {', '.join(trajstore.ESTIMATORS)} FROM advantages ORDER BY rollout_id LIMIT 8"),
        ("5. one sample: tokens, loss mask (prompt and tool tokens 0) and behaviour logprobs",
         "SELECT segment_id, len(tokens) AS n, prompt_tokens, trainable_tokens, "
         "loss_mask[prompt_tokens - 1:prompt_tokens + 2] AS mask_around_first_output, "
         "logprobs[prompt_tokens:prompt_tokens + 2] AS first_logprobs FROM samples "
         "ORDER BY segment_id LIMIT 4"),
        ("6. what the policy versions earned",
         "SELECT min_version AS version, count(*) AS rollouts, round(avg(reward), 3) AS mean_reward "
         "FROM rollouts WHERE trainable GROUP BY 1 ORDER BY 1"),
    ]
    for title, sql in steps:
        console.rule(title)
        console.print(f'$ trajstore query --store {path} "{sql}"', markup=False, highlight=False, soft_wrap=True)
        print_table(store.query(sql), console)
    shard = store.shard(policy_version=2, max_staleness=2, max_rollouts=16)
    console.rule("7. the learner's next shard (python: store.shard(policy_version=2, max_staleness=2))")
    console.print(f"{shard.num_rollouts} rollouts in {len(shard.group_ids)} complete groups, {len(shard)} samples, "
                  f"{shard.num_tokens} tokens, table version {shard.table_version}")
    s = store.stats()
    console.rule("8. stats")
    console.print(f"{s.summary['events']} events, {s.sealed_files} sealed files ({s.sealed_bytes / 1e3:.1f} kB)")
    console.print(f"\nNext: trajstore query --store {path} \"SELECT * FROM turns LIMIT 3\"; "
                  f"trajstore stats --store {path}; trajstore verify --store {path}")


main.add_command(init_model)
main.add_command(serve)
main.add_command(replay)
main.add_command(proxy)
main.add_command(collect)
main.add_command(reward)
main.add_command(learn)
main.add_command(sft)
main.add_command(annotate)
main.add_command(demo)
main.add_command(export)
main.add_command(view)

if __name__ == "__main__":
    main()
