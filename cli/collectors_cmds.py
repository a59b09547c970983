"""`trajstore init-model` and `trajstore serve`: thin click shells over collectors.model and collectors.embedded."""

from __future__ import annotations

import click

from cli.options import control_token_option
from collectors.model.build import ModelSize

_DEFAULT = ModelSize()
_MOE_EXPERTS = 4  # what --moe builds unless --experts says otherwise


@click.command("init-model")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--vocab-size", type=int, default=_DEFAULT.vocab_size, show_default=True,
              help="Tokenizer and embedding size, special tokens included.")
@click.option("--hidden-size", type=int, default=_DEFAULT.hidden_size, show_default=True)
@click.option("--layers", type=int, default=_DEFAULT.layers, show_default=True)
@click.option("--heads", type=int, default=_DEFAULT.heads, show_default=True, help="Attention heads.")
@click.option("--kv-heads", type=int, default=_DEFAULT.kv_heads, show_default=True,
              help="Key/value heads (grouped-query attention); must divide --heads.")
@click.option("--intermediate-size", type=int, default=_DEFAULT.intermediate_size, show_default=True,
              help="MLP width.")
@click.option("--max-positions", type=int, default=_DEFAULT.max_positions, show_default=True,
              help="Context length (prompt + completion).")
@click.option("--tie-embeddings", is_flag=True,
              help="One matrix for the input embedding and the LM head (vLLM can then hot-reload it only as LoRA).")
@click.option("--moe", is_flag=True,
              help="A mixture-of-experts model (Qwen3-MoE, every layer sparse) instead of a dense Qwen2: the "
                   "embedded server records each token's experts and the learner replays them.")
@click.option("--experts", type=click.IntRange(min=1), default=_MOE_EXPERTS, show_default=True,
              help="With --moe: experts per layer.")
@click.option("--experts-per-token", type=click.IntRange(min=1), default=_DEFAULT.experts_per_token,
              show_default=True, help="With --moe: experts each token is routed to per layer (the router's top-k).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the tokenizer corpus and the weights.")
@click.option("--family", type=click.Choice(["hermes", "llama3", "harmony"]), default="hermes", show_default=True,
              help="Chat format of the tokenizer and template: hermes (Qwen2.5 / Hermes call blocks), llama3 (Llama "
                   "3.1 JSON calls), harmony (gpt-oss channels, calls to functions.NAME).")
def init_model(directory: str, vocab_size: int, hidden_size: int, layers: int, heads: int, kv_heads: int,
               intermediate_size: int, max_positions: int, tie_embeddings: bool, moe: bool, experts: int,
               experts_per_token: int, seed: int, family: str) -> None:
    """Create a small random Qwen2 model with a trained BPE tokenizer and chat template.

    The directory is a Hugging Face checkpoint that transformers and vLLM load offline. The
    defaults are servable by vLLM's CPU backend (head size 32, separate LM head); a shape vLLM
    could not serve or hot-reload is written all the same, with a warning saying why.

    \b
    Example:
      trajstore init-model tiny-model --layers 2 --hidden-size 64
      trajstore init-model tiny-moe --moe --experts 4 --experts-per-token 2
      trajstore serve --model tiny-model
    """
    from collectors.model.build import init_model as build  # torch/transformers load only for this command

    size = ModelSize(vocab_size=vocab_size, hidden_size=hidden_size, layers=layers, heads=heads, kv_heads=kv_heads,
                     intermediate_size=intermediate_size, max_positions=max_positions, tie_embeddings=tie_embeddings,
                     experts=experts if moe else 0, experts_per_token=experts_per_token)
    problems = size.problems()
    if problems:
        raise click.UsageError("; ".join(problems))
    result = build(directory, size, seed=seed, family=family)
    kind = f"Qwen3-MoE ({experts} experts, top-{experts_per_token})" if moe else "Qwen2"
    click.echo(f"wrote {result.path}: {family} chat format, {kind} with {result.parameters:,} parameters, "
               f"{result.vocab_size} tokens, "
               f"{layers} layers, hidden {hidden_size}, context {max_positions}")
    for warning in result.warnings:
        click.echo(f"warning: vLLM (CPU) cannot use this model as is: {warning}", err=True)


@click.command("serve")
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="Hugging Face checkpoint directory (e.g. made by `trajstore init-model`).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Interface to bind; /v1/load_weights answers loopback callers only, unless --control-token.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--max-batch", type=click.IntRange(min=1), default=16, show_default=True,
              help="Most requests decoded together.")
@click.option("--device", default="auto", show_default=True, help="auto (CUDA when torch sees one), cpu, cuda, cuda:1.")
@click.option("--policy-version", type=click.IntRange(min=0), default=0, show_default=True,
              help="Version reported for the weights in --model.")
@click.option("--served-model-name", help="Name in /v1/models and the `model` field (default: the --model path).")
@click.option("--threads", type=click.IntRange(min=1), help="torch CPU threads (1 is fastest for tiny models).")
@control_token_option("Let callers on other machines reload weights: /v1/load_weights then answers only requests "
                      "sending `Authorization: Bearer TOKEN` (collect --control-token), loopback included.")
@click.option("--checkpoint-cache", type=click.Path(file_okay=False), metavar="DIR",
              help="Where versions that collectors name by their published URI are fetched to (default: "
                   "$TRAJSTORE_CHECKPOINT_CACHE or ~/.cache/trajstore/checkpoints).")
@click.option("--prefix-cache-tokens", type=click.IntRange(min=0), default=16 << 20, show_default=True,
              help="Token ids held for sessions' `session_key`s (int32, least recently used evicted), so their next "
                   "call sends only the new ids after a `prompt_prefix`; 0 turns it off.")
def serve(model_dir: str, host: str, port: int, max_batch: int, device: str, policy_version: int,
          served_model_name: str | None, threads: int | None, control_token: str | None,
          checkpoint_cache: str | None, prefix_cache_tokens: int) -> None:
    """Serve a model with vLLM's completions API (token ids in, token ids and logprobs out).

    Concurrent requests share batched decode steps; each response reports the policy version
    that sampled it (field `policy_version`, header X-Policy-Version). Load a new checkpoint
    while serving with POST /v1/load_weights {"path": DIR, "version": N}, or name a version the
    learner published to object storage by {"uri": URI, "digest": SHA256, "version": N}: the server
    fetches and verifies it itself, so collectors on other hosts can reload it (with --control-token).

    \b
    Example:
      trajstore serve --model tiny-model --port 8000
      TRAJSTORE_CONTROL_TOKEN="$TOKEN" trajstore serve --model tiny-model --host 10.0.0.5   # reloaded from other hosts
      curl localhost:8000/v1/completions -d '{"prompt": [1, 2, 3], "max_tokens": 8, "return_token_ids": true}'
    """
    from collectors.embedded import run_server

    run_server(model_dir, host=host, port=port, model_name=served_model_name, device=device, max_batch=max_batch,
               policy_version=policy_version, threads=threads, control_token=control_token,
               checkpoint_cache=checkpoint_cache, prefix_cache_tokens=prefix_cache_tokens)
