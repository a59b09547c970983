"""`trajstore proxy`: a thin click shell over `collectors.proxy.run_proxy`."""

from __future__ import annotations

import logging

import click

from cli.options import seal_interval_option, store_option


@click.command("proxy")
@click.option("--upstream", metavar="URL",
              help="Policy server base URL: `trajstore serve` or vLLM, e.g. http://127.0.0.1:8000. Required, except "
                   "with --render vllm, which then starts vLLM on --model itself.")
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="The checkpoint the upstream serves: its tokenizer and chat template render every prompt.")
@store_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to bind; /rollouts is for the orchestrator, so keep it on loopback or a private network.")
@click.option("--port", type=click.IntRange(0, 65535), default=8100, show_default=True)
@click.option("--run", default="default", show_default=True, help="Run name for rollouts opened without one.")
@click.option("--upstream-kind", type=click.Choice(["embedded", "vllm"]), default="embedded", show_default=True,
              help="embedded: versions come from the server; vllm: stamped by the client "
                   "(see collectors.policy.vllm_client).")
@click.option("--upstream-model",
              help="The served model name to send as `model` (default: none, the server's only model).")
@click.option("--policy-version", type=click.IntRange(min=0), default=0, show_default=True,
              help="vLLM only: the version of the weights it serves at start.")
@click.option("--render", type=click.Choice(["local", "vllm"]), default="local", show_default=True,
              help="local: the proxy renders with the chat template and parses Hermes tool calls; vllm: vLLM renders, "
                   "samples (/inference/v1/generate) and parses with its own parsers (implies --upstream-kind vllm).")
@click.option("--tool-call-parser", metavar="NAME",
              help="With --render vllm and no --upstream: vLLM's tool-call parser, as vLLM names it (hermes, "
                   "llama3_json, mistral, openai, ...).")
@click.option("--reasoning-parser", metavar="NAME",
              help="With --render vllm and no --upstream: vLLM's reasoning parser, as vLLM names it.")
@click.option("--model-name", "model_names", multiple=True,
              help="Also accept this `model` value from agents (repeatable; '*' accepts any name).")
@click.option("--max-model-len", type=click.IntRange(min=2), help="Context length (default: the checkpoint's).")
@click.option("--default-max-tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Sampled tokens when a call sets no max_tokens (never past the context).")
@click.option("--writer", help="Store writer name, unique per process and machine (default: proxy-HOST-PID-SPOOLID, "
                              "unique across machines whatever their hostnames; with --workers N: NAME-w<index>).")
@click.option("--tool-format", type=click.Choice(["hermes", "llama3", "harmony"]),
              help="How replies write tool calls and reasoning: hermes (Qwen2.5 / Hermes call blocks), llama3 (Llama 3 "
                   "JSON calls), harmony (gpt-oss channels). Default: read from the model's chat template.")
@seal_interval_option(60.0)  # ProxyConfig's: its module loads the proxy, too heavy for --help
@click.option("--whole-requests", is_flag=True,
              help="Store each turn's request whole. By default a call that extends its session's previous one "
                   "stores only the new conversation items and a link to that turn (trajstore.requests rebuilds it).")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Processes serving the proxy, one store writer each (use up to the cores you have). Each rollout "
                   "stays on one worker: its base URLs point at that worker's own port; calls on --port with another "
                   "worker's key are forwarded. /stats and /health cover every worker.")
def proxy(upstream: str | None, model_dir: str, store_loc: str, host: str, port: int, run: str, upstream_kind: str,
          upstream_model: str | None, policy_version: int, render: str, tool_call_parser: str | None,
          reasoning_parser: str | None, model_names: tuple[str, ...], max_model_len: int | None,
          default_max_tokens: int, writer: str | None, tool_format: str | None, seal_interval: float,
          whole_requests: bool, workers: int) -> None:
    """Capture proxy: OpenAI and Anthropic chat APIs in front of a policy server, every call stored exactly.

    Open a rollout, then point any SDK or agent CLI at its base URL and key; each call is
    rendered with the chat template, sampled from token ids, answered in the agent's protocol
    and appended as a turn event with the sampled ids, logprobs and policy version.

    \b
    Example:
      trajstore serve --model tiny-model --port 8000 &
      trajstore proxy --upstream http://127.0.0.1:8000 --model tiny-model --store runs/store --run exp1 &
      # or: vLLM renders, samples and parses (started here, with the family's parsers)
      trajstore proxy --render vllm --tool-call-parser hermes --model tiny-model --store runs/store &
      curl -s -X POST localhost:8100/rollouts -H 'Content-Type: application/json' -d '{"group_id": "task-1"}'
      #  -> {"api_key": "ts-...", "base_urls": {"openai": ".../r/ts-.../v1", "anthropic": ".../r/ts-..."}, ...}
      OPENAI_BASE_URL=http://127.0.0.1:8100/r/ts-.../v1 OPENAI_API_KEY=ts-... python my_agent.py
      curl -s -X POST localhost:8100/rollouts/ROLLOUT_ID/close -H 'Authorization: Bearer ts-...' \\
           -H 'Content-Type: application/json' -d '{"status": "completed", "reward": 1.0}'
    """
    from collectors.policy import EmbeddedClient, PolicyClient, VLLMClient
    from collectors.proxy import ProxyConfig, run_proxy

    if (tool_call_parser or reasoning_parser) and (render != "vllm" or upstream):
        raise click.UsageError("--tool-call-parser and --reasoning-parser are vLLM's settings: pass them with "
                               "--render vllm and no --upstream (the proxy then starts vLLM with them), or start "
                               "your vLLM with them (--enable-auto-tool-choice --tool-call-parser NAME)")
    if upstream is None and render != "vllm":
        raise click.UsageError("--upstream URL is required (only --render vllm starts a policy server itself)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ProxyConfig(model_dir=model_dir, run=run, writer=writer, model_names=model_names,
                         max_model_len=max_model_len, default_max_tokens=default_max_tokens,
                         seal_interval=seal_interval, tool_format=tool_format, render=render,
                         whole_requests=whole_requests)
    server = None
    if upstream is None:
        from collectors.policy.vllm_server import VLLMUnavailable, start_vllm

        try:
            server = start_vllm(model_dir, served_name=upstream_model, max_model_len=max_model_len, render=True,
                                tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser)
        except VLLMUnavailable as exc:
            raise click.ClickException(str(exc)) from exc
        upstream, upstream_model = server.url, server.model
    url = upstream

    def client() -> PolicyClient:
        if render == "vllm" or upstream_kind == "vllm":
            return VLLMClient(url, model=upstream_model, policy_version=policy_version)
        return EmbeddedClient(url, model=upstream_model)

    try:
        if workers > 1:
            from collectors.proxy.workers import run_workers

            run_workers(client, store_loc, config, host=host, port=port, workers=workers)
        else:
            run_proxy(client, store_loc, config, host=host, port=port)
    finally:
        if server is not None:
            server.stop()
