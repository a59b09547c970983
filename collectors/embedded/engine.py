"""The embedded server's batcher: one thread runs every request through shared forward passes.

Continuous batching on a transformers model with a KV cache (`DynamicCache`): each iteration
the engine thread admits waiting requests (up to `max_batch` running), prefills them together
(left-padded), samples their first token, merges their cache into the running batch, and runs
one decode step for every running row. A row leaves the batch the step it finishes (stop
token, stop string, max_tokens), so short requests never wait for long ones.

Layout of the batch (`collectors.embedded.kv_batch`): rows left-padded to one width, each row's real
tokens right-aligned, position ids per row, so a row's numbers do not depend on its
neighbours' lengths.

Hot reload (`load_weights`): the new checkpoint is read in the caller's thread while serving
goes on; then the engine thread swaps the model between two decode steps. Running rows are
neither aborted, drained nor resampled: they keep their KV cache (the keys and values of the
tokens so far, computed by the weights that were serving then, as vLLM keeps them in its
keep-mode pause) and sample their next tokens with the new weights. Each row records the
output index at which each version began (`Completion.version_starts`/`version_values`), so
every token is stamped with the weights that sampled it; `policy_version` is the version of
the first token. A checkpoint whose cache layout differs (layers, key/value heads, head size)
cannot continue another model's cache: then the running rows finish on the old weights first,
as before. A checkpoint is a full Hugging Face directory or a LoRA adapter directory, which is
merged into the base model it names when loaded.

Why hand-written: transformers' continuous batching applies one generation config to all
requests and returns neither per-request seeded draws nor processed logprobs; vLLM does all of
this but needs a GPU. The engine reuses transformers for the model and its cache and keeps
only the scheduling here (sampling is in `collectors.embedded.sampling`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from collectors.embedded import kv_batch
from collectors.embedded.routes import RouteRecorder, joined
from collectors.embedded.sampling import find_stop, kept_sets, make_generator, processed_logprobs, sample
from collectors.errors import EngineError, VersionConflict, WeightLoadError
from collectors.model.detokenize import IncrementalText
from collectors.policy import SamplingParams
from trajstore.events import SUPPORT_IDS_CAP

log = logging.getLogger(__name__)


@dataclass
class Completion:
    """One finished request. `policy_version` sampled its first token; when the weights changed during the
    request, version `version_values[k]` sampled the tokens from `version_starts[k]` on (one span when not)."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]  # processed logprob of each sampled token
    top_logprobs: list[list[tuple[int, float]]] | None  # per token: top-N (id, logprob), when asked
    text: str
    finish_reason: str  # stop | length | abort
    stop_reason: str | int | None  # the stop string or stop token id; None for EOS and length
    policy_version: int
    # mixture-of-experts models: (prompt + output - 1, layers, top_k) experts of each fed token (`.routes`)
    routed_experts: np.ndarray | None = None
    # truncated draws: each token's kept-set size, and the ids of the sets of at most SUPPORT_IDS_CAP (CSR)
    support_sizes: list[int] | None = None
    support_ids: list[int] | None = None
    version_starts: list[int] = field(default_factory=lambda: [0])
    version_values: list[int] = field(default_factory=list)  # empty: [policy_version]

    def spans(self) -> tuple[list[int], list[int]]:
        """(starts, versions) of the version spans over `output_ids`."""
        return (self.version_starts, self.version_values) if self.version_values else ([0], [self.policy_version])


@dataclass
class EngineStats:
    """Counters for tests, benchmarks and /stats."""

    requests: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    generated_tokens: int = 0
    peak_batch: int = 0
    reloads: int = 0
    inflight_swaps: int = 0  # running requests that went on sampling with new weights (none was aborted or resampled)


Token = tuple[int, float, list[tuple[int, float]] | None, int]  # id, logprob, top-N (id, logprob) or None, version
TokenCallback = Callable[[Token], None]


@dataclass(eq=False)
class _Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    on_done: Callable[[Completion | BaseException], None]
    generator: torch.Generator | None = None
    version: int = -1  # the version sampling its tokens now
    version_starts: list[int] = field(default_factory=list)  # output index at which each version began
    version_values: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str | None = None
    finish: tuple[str, str | int | None] | None = None
    cancelled: bool = False
    detok: IncrementalText | None = None  # the output's text as it grows, kept only when stop strings are set
    on_token: TokenCallback | None = None  # streaming: called with each token as it is sampled
    routes: list[np.ndarray] = field(default_factory=list)  # MoE: experts of the tokens fed so far
    support_sizes: list[int] = field(default_factory=list)  # truncated draws: each token's kept-set size ...
    support_ids: list[int] = field(default_factory=list)  # ... and the ids of those of at most SUPPORT_IDS_CAP

    def cancel(self) -> None:
        """Stop generating for a caller that went away; the result, if any, is dropped."""
        self.cancelled = True


@dataclass
class _Swap:
    model: PreTrainedModel
    version: int
    path: str
    done: threading.Event = field(default_factory=threading.Event)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


ADAPTER_CONFIG = "adapter_config.json"


def load_model(path: str | Path, device: torch.device) -> PreTrainedModel:
    """Load a full checkpoint, or a LoRA adapter directory merged into the base model it names.

    Weights are served in float32 on every device: logprobs must match the learner's closely.
    An adapter (peft's adapter_config.json + adapter_model.safetensors, as the learner publishes
    and vLLM's runtime LoRA loads) is merged into its base once here, so serving it costs
    exactly what serving a full checkpoint does.
    """
    path = Path(path)
    if (path / ADAPTER_CONFIG).is_file():
        model = _merged_adapter(path)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.to(device).eval()


def adapter_base_dir(adapter_dir: Path) -> Path:
    """The local base model directory an adapter records in `base_model_name_or_path`."""
    try:
        base = json.loads((adapter_dir / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise WeightLoadError(f"{adapter_dir / ADAPTER_CONFIG} is not a valid adapter config ({exc}); "
                              "save the adapter again with peft's save_pretrained") from exc
    if not isinstance(base, str) or not base:
        raise WeightLoadError(f"{adapter_dir / ADAPTER_CONFIG} names no base model (base_model_name_or_path); "
                              "set it to the absolute path of the local model directory the adapter was trained on")
    if not (Path(base) / "config.json").is_file():
        raise WeightLoadError(f"the adapter {adapter_dir} was trained on base model {base!r}, which is not a local "
                              "model directory here (no config.json; Hub names are not downloaded): copy the base "
                              "model to this machine and set base_model_name_or_path in "
                              f"{adapter_dir / ADAPTER_CONFIG} to its absolute path")
    return Path(base)


def _merged_adapter(adapter_dir: Path) -> PreTrainedModel:
    from peft import PeftModel  # only adapter checkpoints need peft; serving full checkpoints never imports it

    base = AutoModelForCausalLM.from_pretrained(str(adapter_base_dir(adapter_dir)), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()


class Engine:
    """Owns the model and the batch; `submit`, `agenerate` and `load_weights` are thread-safe."""

    def __init__(self, model_dir: str | Path, *, device: str = "auto", max_batch: int = 16,
                 policy_version: int = 0, threads: int | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (got {max_batch})")
        if threads is not None:  # process-wide: torch has one intra-op pool
            torch.set_num_threads(threads)
        self.device = resolve_device(device)
        self.model_dir = str(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = load_model(self.model_dir, self.device)
        self._routes = RouteRecorder.attach(self.model)  # None for a dense model
        self.policy_version = policy_version
        self.max_batch = max_batch
        self.vocab_size = self.model.config.vocab_size
        self.max_model_len = self.model.config.max_position_embeddings
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = {*(eos if isinstance(eos, list) else [eos] if eos is not None else [])}
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.stats = EngineStats()
        self._cond = threading.Condition()
        self._reload_lock = threading.Lock()
        self._waiting: deque[_Sequence] = deque()
        self._swap: _Swap | None = None
        self._closed = False
        self._rng = random.Random()
        # the running batch; touched by the engine thread only
        self._rows: list[_Sequence] = []
        self._cache: DynamicCache | None = None
        self._mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)  # (B, T), 0 = padding
        self._thread = threading.Thread(target=self._run, name="trajstore-engine", daemon=True)
        self._thread.start()

    # ---- public API --------------------------------------------------------------------
    @property
    def running(self) -> int:
        return len(self._rows)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def reload_pending(self) -> bool:
        """A checkpoint is loaded and waits for the engine thread to swap it in (at the next step)."""
        return self._swap is not None

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_done: Callable[[Completion | BaseException], None],
               on_token: TokenCallback | None = None) -> _Sequence:
        """Queue a request; `on_done` is called from the engine thread with the result or an error, and
        `on_token((id, logprob, top, version))` with each token as it is sampled (before `on_done`).

        Parameters out of range are refused here (ValueError), before they can fail a whole batch."""
        problems = params.problems()
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))
        seq = _Sequence(list(prompt_ids), params, on_done, on_token=on_token)
        with self._cond:
            if self._closed:
                raise EngineError("the engine is closed; start a new server")
            self._waiting.append(seq)
            self._cond.notify()
        return seq

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Completion] = loop.create_future()

        def resolve(result: Completion | BaseException) -> None:
            if future.done():
                return
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

        seq = self.submit(prompt_ids, params, lambda r: loop.call_soon_threadsafe(resolve, r))
        try:
            return await future
        except asyncio.CancelledError:
            seq.cancel()
            raise

    async def astream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Token | Completion]:
        """Each token as it is sampled, `(id, logprob, top or None, version)`, then the `Completion`.

        The version is that of the weights that sampled the token (it changes when a reload lands while
        the request runs). Closing the
        iterator early (the caller went away) cancels the request: the engine stops sampling it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Token | Completion | BaseException] = asyncio.Queue()
        seq = self.submit(prompt_ids, params, lambda r: loop.call_soon_threadsafe(queue.put_nowait, r),
                          lambda token: loop.call_soon_threadsafe(queue.put_nowait, token))
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Completion):
                    return
        finally:
            seq.cancel()  # a no-op once finished; otherwise the engine drops the row at its next step

    def check_newer(self, version: int) -> None:
        """Raise VersionConflict unless `version` is above the served one (versions only go up)."""
        if version <= self.policy_version:
            raise VersionConflict(f"policy version {version} is not above the served version "
                                  f"{self.policy_version}; versions only go up, publish the next one")

    def load_weights(self, path: str | Path, version: int) -> None:
        """Serve the checkpoint at `path` as `version` from the next admitted request on.

        Blocks until the swap happened, between two decode steps: in-flight requests go on with the new
        weights from their next token (module docstring).
        """
        with self._reload_lock:
            self.check_newer(version)
            path = str(path)
            if not any((Path(path) / name).is_file() for name in ("config.json", ADAPTER_CONFIG)):
                raise WeightLoadError(f"{path} has no config.json (a Hugging Face checkpoint) and no {ADAPTER_CONFIG} "
                                      "(a LoRA adapter); pass a published checkpoint directory such as CKPTS/v000003")
            try:
                model = load_model(path, self.device)
            except WeightLoadError:
                raise
            except Exception as exc:  # noqa: BLE001 - any loader failure leaves the old weights serving
                raise WeightLoadError(f"could not load {path}: {exc}") from exc
            if model.config.vocab_size != self.vocab_size:
                raise WeightLoadError(f"{path} has vocab_size {model.config.vocab_size}, the served tokenizer "
                                      f"has {self.vocab_size}; a checkpoint must keep the model's tokenizer")
            swap = _Swap(model, version, path)
            with self._cond:
                if self._closed:
                    raise EngineError("the engine is closed")
                self._swap = swap
                self._cond.notify()
            swap.done.wait()
            if self.policy_version != version:
                raise EngineError("the engine was closed before the new weights were loaded")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)

    # ---- engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self._closed or self._rows or self._waiting or self._swap):
                        self._cond.wait()
                    if self._closed:
                        break
                    if self._swap is not None and (not self._rows or self._continues(self._swap)):
                        self._apply_swap(self._swap)
                        self._swap = None
                        continue
                    admit: list[_Sequence] = []
                    while self._swap is None and self._waiting and len(self._rows) + len(admit) < self.max_batch:
                        seq = self._waiting.popleft()
                        if not seq.cancelled:
                            admit.append(seq)
                try:
                    if admit:
                        self._prefill(admit)
                    if self._rows:
                        self._decode_step()
                except Exception as exc:  # noqa: BLE001 - one bad batch must not take the server down
                    log.exception("forward pass failed; failing the %d requests in the batch", len(self._rows))
                    for seq in [*self._rows, *(s for s in admit if s not in self._rows)]:
                        seq.on_done(EngineError(f"the forward pass failed: {exc}"))
                    self._reset_batch()
        error = EngineError("the engine was closed before this request finished")
        for seq in [*self._rows, *self._waiting]:
            seq.on_done(error)
        if self._swap is not None:
            self._swap.done.set()

    def _continues(self, swap: _Swap) -> bool:
        """Whether the running rows can go on with `swap`'s weights over the cache the old ones wrote."""
        return kv_batch.cache_layout(self.model.config) == kv_batch.cache_layout(swap.model.config)

    def _apply_swap(self, swap: _Swap) -> None:
        """Serve `swap` from the next step on; running rows keep their cache and start a new version span."""
        for seq in self._rows:
            seq.version = swap.version
            seq.version_starts.append(len(seq.output_ids))
            seq.version_values.append(swap.version)
        self.stats.inflight_swaps += len(self._rows)
        self.model, self.policy_version, self.model_dir = swap.model, swap.version, swap.path
        if self._routes is not None:
            self._routes.close()
        self._routes = RouteRecorder.attach(swap.model)
        self.max_model_len = swap.model.config.max_position_embeddings
        self.stats.reloads += 1
        log.info("now serving policy version %d from %s", swap.version, swap.path)
        swap.done.set()

    def _reset_batch(self) -> None:
        self._rows, self._cache = [], None
        self._mask = self._mask[:0, :0]

    def _prefill(self, seqs: list[_Sequence]) -> None:
        """Run the new prompts together, sample their first tokens, merge them into the batch."""
        width = max(len(s.prompt_ids) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, seq in enumerate(seqs):
            # through numpy: torch.tensor walks a list of ints ~7x slower (10 ms for 80k ids, holding the GIL)
            ids[r, width - len(seq.prompt_ids):] = torch.from_numpy(np.array(seq.prompt_ids, dtype=np.int64))
            mask[r, width - len(seq.prompt_ids):] = 1
            seq.version = self.policy_version
            seq.version_starts, seq.version_values = [0], [self.policy_version]
            seq.generator = make_generator(seq.params.seed, self.device, self._rng.getrandbits(63))
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        if self._routes is not None:
            self._routes.begin()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                         logits_to_keep=1)
        self._record_routes(seqs, mask)
        self.stats.prefill_steps += 1
        self.stats.requests += len(seqs)
        layers = kv_batch.clean_prefill([(l.keys, l.values) for l in out.cache.layers], mask)
        self._sample(seqs, out.logits[:, -1, :])
        if self._rows:
            layers, mask = kv_batch.merge([(l.keys, l.values) for l in self._cache.layers], self._mask, layers, mask)
        self._cache, self._mask = DynamicCache(layers, config=self.model.config), mask
        self._rows = [*self._rows, *seqs]
        self.stats.peak_batch = max(self.stats.peak_batch, len(self._rows))
        self._retire()

    def _decode_step(self) -> None:
        """Feed every row its last sampled token and sample the next one."""
        last = torch.tensor([s.output_ids[-1] for s in self._rows], device=self.device).unsqueeze(1)
        self._mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)
        positions = self._mask.sum(dim=1, keepdim=True) - 1
        if self._routes is not None:
            self._routes.begin()
        out = self.model(input_ids=last, attention_mask=self._mask, position_ids=positions,
                         cache=self._cache, use_cache=True)
        self._record_routes(self._rows, torch.ones_like(last))
        self._cache = out.cache
        self.stats.decode_steps += 1
        self._sample(self._rows, out.logits[:, -1, :])
        self._retire()

    def _record_routes(self, seqs: list[_Sequence], fed: torch.Tensor) -> None:
        """MoE models: give each row the experts of the tokens it just fed (`fed` (B, T) marks them)."""
        if self._routes is not None:
            for seq, routes in zip(seqs, self._routes.take(fed), strict=True):
                seq.routes.append(routes)

    def _sample(self, seqs: list[_Sequence], logits: torch.Tensor) -> None:
        """Sample one token for each of `seqs` from logits (B, V) and record it."""
        params = [s.params for s in seqs]
        f = dict(device=self.device)
        logprobs = processed_logprobs(
            logits, torch.tensor([p.temperature for p in params], dtype=torch.float32, **f),
            torch.tensor([p.top_k for p in params], dtype=torch.long, **f),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, **f))
        ids = sample(logprobs, [p.greedy for p in params], [s.generator for s in seqs])
        chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1)
        n_top = max((p.logprobs or 0) for p in params)
        top = logprobs.topk(n_top, dim=-1) if n_top else None
        ids_list, chosen_list = ids.tolist(), chosen.tolist()
        truncated = [r for r, p in enumerate(params) if p.truncated]
        if truncated:  # the support each token was drawn from, for the learner to renormalize over
            for r, (size, kept) in zip(truncated, kept_sets(logprobs[truncated], SUPPORT_IDS_CAP)):
                seqs[r].support_sizes.append(size)
                seqs[r].support_ids.extend(kept)
        top_values, top_ids = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
        for r, seq in enumerate(seqs):
            seq.output_ids.append(ids_list[r])
            seq.logprobs.append(chosen_list[r])
            if seq.params.logprobs:
                seq.top.append(list(zip(top_ids[r][: seq.params.logprobs], top_values[r][: seq.params.logprobs])))
            if seq.on_token is not None:
                seq.on_token((ids_list[r], chosen_list[r], seq.top[-1] if seq.params.logprobs else None, seq.version))
            self._check_finished(seq)
        self.stats.generated_tokens += len(seqs)

    def _check_finished(self, seq: _Sequence) -> None:
        p, token = seq.params, seq.output_ids[-1]
        if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
            seq.finish = ("stop", token if token in p.stop_token_ids else None)
            if not p.include_stop_str_in_output:  # as vLLM: the stop token stays in token_ids, not in text
                seq.text = self.tokenizer.decode(seq.output_ids[:-1], skip_special_tokens=p.skip_special_tokens)
        elif p.stop:
            if seq.detok is None:
                seq.detok = IncrementalText(lambda ids: self.tokenizer.decode(
                    ids, skip_special_tokens=p.skip_special_tokens))
            seen = len(seq.detok.text)
            seq.detok.push(token)
            # a stop string found now ends in the new text: search from one stop length before it
            start = max(0, seen - max(map(len, p.stop)) + 1)
            hit = find_stop(seq.detok.text[start:], p.stop)
            if hit is not None:
                end = start + hit[0] + (len(hit[1]) if p.include_stop_str_in_output else 0)
                seq.text, seq.finish = seq.detok.text[:end], ("stop", hit[1])
        if seq.finish is None and len(seq.output_ids) >= p.max_tokens:
            seq.finish = ("length", None)
        if seq.finish is None and seq.cancelled:
            seq.finish = ("abort", None)

    def _retire(self) -> None:
        """Answer finished rows, drop them from the batch and cut padding columns nobody needs."""
        keep = [r for r, s in enumerate(self._rows) if s.finish is None]
        if len(keep) == len(self._rows):
            return
        for seq in self._rows:
            if seq.finish is not None:
                self._answer(seq)
        if not keep:
            self._reset_batch()
            return
        layers, self._mask = kv_batch.select([(l.keys, l.values) for l in self._cache.layers], self._mask, keep)
        self._cache = DynamicCache(layers, config=self.model.config)
        self._rows = [self._rows[r] for r in keep]

    def _answer(self, seq: _Sequence) -> None:
        reason, stop_reason = seq.finish
        text = seq.text if seq.text is not None else self.tokenizer.decode(
            seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens)
        seq.on_done(Completion(
            prompt_ids=seq.prompt_ids, output_ids=seq.output_ids, logprobs=seq.logprobs,
            top_logprobs=seq.top if seq.params.logprobs else None, text=text, finish_reason=reason,
            stop_reason=stop_reason, policy_version=seq.version_values[0], version_starts=seq.version_starts,
            version_values=seq.version_values, routed_experts=joined(seq.routes),
            support_sizes=seq.support_sizes if seq.params.truncated else None,
            support_ids=seq.support_ids if seq.params.truncated else None))

