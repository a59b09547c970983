"""Exports: each format is read by its consumer (datasets, a chat-format check, Arrow, NeMo Gym's schema),
the hf export reads back into an equal store, and an export streams in bounded batches."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import trajstore
from tests.trajstore.chat_run import chat_run
from trajstore.errors import ExportError
from trajstore.export import export, ingest_hf, source
from trajstore.export.hf import write_hf
from trajstore.synth import generate_run
from trajstore.views import ESTIMATORS

HERE = Path(__file__).parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # `datasets` reads the local export; never the network


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> trajstore.Store:
    s = trajstore.open_store(tmp_path_factory.mktemp("export") / "store")
    with s.writer("w") as w:
        w.append(generate_run(run="synth", groups=6))
        w.append(chat_run())
    return s


def _same(a: trajstore.Store, b: trajstore.Store, sql: str) -> None:
    left, right = a.query(sql), b.query(sql)
    assert left.num_rows > 0
    assert left.to_pylist() == right.to_pylist()


@pytest.mark.parametrize("run", ["synth", "chat"])
def test_hf_round_trip_is_exact(store: trajstore.Store, tmp_path: Path, run: str) -> None:
    export(store, "hf", run=run, out=tmp_path / "ds", batch_rows=5)
    copy = trajstore.open_store(tmp_path / "copy")
    appended = ingest_hf(copy, tmp_path / "ds", batch_rows=3)
    where = f"WHERE run = '{run}'"
    _same(store, copy, f"SELECT rollout_id, segment_id, session_id, tokens, loss_mask, logprobs, prompt_tokens, num_tokens, "
                       f"trainable_tokens, turns, min_version, max_version, segment_reward FROM samples {where} ORDER BY ALL")
    _same(store, copy, f"SELECT group_id, rollout_id, reward, status, error, trainable, reward_components, group_size, "
                       f"segments, turns, tokens FROM rollouts {where} AND turns > 0 ORDER BY rollout_id")
    # group statistics are sums in DuckDB's (parallel, unordered) aggregation order: equal to the last few bits
    _same(store, copy, f"SELECT * EXCLUDE (started, ended) REPLACE (round(reward_mean, 12) AS reward_mean, "
                       f"round(reward_std, 12) AS reward_std) FROM groups {where} ORDER BY group_id")
    _same(store, copy, f"SELECT rollout_id, reward, group_trainable, {', '.join(f'round({e}, 12)' for e in ESTIMATORS)} "
                       f"FROM advantages {where} ORDER BY rollout_id")
    _same(store, copy, f"SELECT segment_id, turn_index, policy_version, prompt_ids, output_ids, output_logprobs, "
                       f"trainable_tokens, finish_reason, time, sampling, request, response, meta FROM turns {where} "
                       "ORDER BY segment_id, turn_index")
    assert appended > 0
    assert ingest_hf(copy, tmp_path / "ds") == 0  # event ids come from what they identify: a second ingest adds nothing


def test_hf_export_loads_with_datasets_and_its_card_describes_it(store: trajstore.Store, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    yaml = pytest.importorskip("yaml")
    result = export(store, "hf", run="synth", out=tmp_path / "ds")
    ds = datasets.load_dataset("parquet", data_dir=str(tmp_path / "ds" / "data"), split="train")
    expected = store.query("SELECT segment_id, tokens, logprobs FROM samples WHERE run = 'synth' ORDER BY rollout_id, "
                           "segment_id")
    assert ds.num_rows == result.rows == expected.num_rows
    assert ds["tokens"] == expected.column("tokens").to_pylist()
    assert ds["segment_id"] == expected.column("segment_id").to_pylist()
    card = (tmp_path / "ds" / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert datasets.Features._from_yaml_list(front["dataset_info"]["features"]) == ds.features
    assert front["trajstore"]["run"] == "synth" and front["dataset_info"]["splits"][0]["num_examples"] == ds.num_rows
    by_card = datasets.load_dataset(str(tmp_path / "ds"), split="train")  # the card's config names the files
    assert by_card.num_rows == ds.num_rows


def test_sft_lines_are_chat_conversations_of_the_chosen_samples(store: trajstore.Store, tmp_path: Path) -> None:
    result = export(store, "sft", run="chat", out=tmp_path / "sft.jsonl", where="reward >= 1")
    lines = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert len(lines) == result.rows == 4  # rollouts 0 and 2 of both groups are right
    for line in lines:
        messages = line["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
        assert all(isinstance(m["content"], str) for m in messages)
        call = messages[2]["tool_calls"][0]
        assert call["type"] == "function" and call["function"]["name"] == "python"
        assert json.loads(call["function"]["arguments"]) == {"code": "1+1"}
        assert messages[3]["tool_call_id"] == call["id"] and messages[3]["content"] == "2"
        assert messages[4]["content"] == "1+1 = 2"
        assert line["tools"][0]["function"]["parameters"]["properties"] == {"code": {"type": "string"}}
    if importlib.util.find_spec("trl") is not None:  # TRL's own reader, where installed (the checks above stand alone)
        from trl.data_utils import is_conversational

        assert all(is_conversational(line) for line in lines)


def test_sft_skips_samples_stored_without_chat_json(store: trajstore.Store, tmp_path: Path) -> None:
    result = export(store, "sft", run="synth", out=tmp_path / "sft.jsonl")
    assert result.rows == 0 and result.skipped > 0


def test_tokens_table_has_one_row_per_token_with_behaviour_logprobs(store: trajstore.Store, tmp_path: Path) -> None:
    result = export(store, "tokens", run="chat", out=tmp_path / "t.parquet", batch_rows=3)
    table = pq.read_table(tmp_path / "t.parquet")
    assert table.num_rows == result.rows == store.query("SELECT sum(num_tokens) AS n FROM samples WHERE run = 'chat'"
                                                        ).column("n")[0].as_py()
    sampled = table.filter(table.column("sampled"))
    turns = store.query("SELECT flatten(list(output_logprobs ORDER BY segment_id, turn_index)) AS lp, "
                        "flatten(list(coalesce(output_mask, list_transform(output_ids, lambda x: true)) "
                        "ORDER BY segment_id, turn_index)) AS m FROM turns WHERE run = 'chat'")
    assert sampled.column("behaviour_logprob").to_pylist() == turns.column("lp")[0].as_py()
    assert sampled.column("loss_mask").to_pylist() == turns.column("m")[0].as_py()
    assert table.filter(table.column("loss_mask")).column("sampled").to_pylist() == [True] * sum(
        table.column("loss_mask").to_pylist())
    assert table.column("learner_logprob").null_count == table.num_rows  # the learner logs no per-token logprobs
    first = table.slice(0, 1).to_pylist()[0]
    assert first["position"] == 0 and first["turn_index"] == 0 and first["behaviour_logprob"] is None


def test_ng_trajectory_lines_follow_nemo_gyms_schema(store: trajstore.Store, tmp_path: Path) -> None:
    schema = json.loads((HERE / "ng_trajectory.schema.json").read_text())
    for run in ("chat", "synth"):
        export(store, "ng-trajectory", run=run, out=tmp_path / f"{run}.jsonl")
        samples = {r["segment_id"]: r for r in store.query(
            f"SELECT segment_id, samples.tokens, reward FROM samples JOIN rollouts USING (rollout_id) "
            f"WHERE samples.run = '{run}'"
        ).to_pylist()}
        for text in (tmp_path / f"{run}.jsonl").read_text().splitlines():
            line = json.loads(text)
            jsonschema.validate(line, schema)
            sample = samples[line["trajstore"]["segment_id"]]
            assert line["reward"] == (sample["reward"] or 0.0)
            for item in line["response"]["output"]:  # every call's prompt + output is a prefix of the sample
                if "generation_token_ids" in item:
                    ids = item["prompt_token_ids"] + item["generation_token_ids"]
                    assert sample["tokens"][:len(ids)] == ids
    line = json.loads((tmp_path / "chat.jsonl").read_text().splitlines()[0])
    assert [i["type"] for i in line["response"]["output"]] == ["function_call", "function_call_output", "message"]
    assert line["responses_create_params"]["input"][-1] == {"type": "message", "role": "user", "content": "What is 1+1?"}


def test_export_reads_the_run_in_bounded_batches(store: trajstore.Store, tmp_path: Path) -> None:
    with store.snapshot(memory_limit="128MB") as snap:
        sizes = [b.num_rows for b in source.sample_batches(snap, "synth", rows=4)]
        # a chunk of 2 groups at a time gives the rows of the whole run at once, `batch` advantage (run mean) included
        chunked = [b for b in source.sample_batches(snap, "synth", groups_per_chunk=2)]
        assert len(chunked) == 3  # 6 groups
        whole = pa.Table.from_batches(list(source.sample_batches(snap, "synth", groups_per_chunk=100)))
        chunked_table = pa.Table.from_batches(chunked)
        assert chunked_table.drop_columns(["batch"]).to_pylist() == whole.drop_columns(["batch"]).to_pylist()
        # the run's mean is summed chunk by chunk: equal up to float rounding
        assert chunked_table.column("batch").to_pylist() == pytest.approx(whole.column("batch").to_pylist(), abs=1e-12)
        assert whole.column("batch").null_count < whole.num_rows
        total = snap.query("SELECT count(*) AS n FROM samples WHERE run = 'synth'").column("n")[0].as_py()
        assert sum(sizes) == total and max(sizes) <= 4 and len(sizes) >= total // 4
        rows = write_hf(source.sample_batches(snap, "synth", rows=4), tmp_path / "ds", {"run": "synth", "store": "s",
                                                                                         "table_version": 0},
                        rows_per_shard=10)
    assert rows == total
    assert len(list((tmp_path / "ds" / "data").glob("*.parquet"))) > 1  # shards roll over as rows stream in


def test_export_errors_say_what_to_do(store: trajstore.Store, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"run 'nope' has no turns .* the runs are: chat, synth"):
        export(store, "hf", run="nope", out=tmp_path / "a")
    with pytest.raises(ExportError, match=r"(?s)--where .*rewrd.* columns are: run, group_id"):
        export(store, "sft", run="chat", out=tmp_path / "b.jsonl", where="rewrd > 1")
    assert not (tmp_path / "b.jsonl").exists()  # a bad filter writes nothing
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ExportError, match="not an empty directory"):
        export(store, "hf", run="chat", out=tmp_path / "full")
    with pytest.raises(ExportError, match="is a directory"):
        export(store, "tokens", run="chat", out=tmp_path / "full")
    with pytest.raises(ExportError, match="not a `trajstore export --format hf` directory"):
        ingest_hf(store, tmp_path / "full")


def test_where_keeps_only_matching_rows(store: trajstore.Store, tmp_path: Path) -> None:
    result = export(store, "hf", run="chat", out=tmp_path / "ds", where="status = 'completed' AND reward < 1")
    table = pq.read_table(tmp_path / "ds" / "data")
    assert result.rows == table.num_rows == 4 and max(table.column("reward").to_pylist()) < 1
