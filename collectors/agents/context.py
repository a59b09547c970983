"""What an agent and a reward are to `trajstore collect`: plain callables with a documented signature.

An agent is an async function that plays one rollout of one task:

    async def my_agent(task: dict, ctx: AgentContext) -> Any:
        reply = await ctx.openai.chat.completions.create(model=ctx.model, messages=[...])
        return reply.choices[0].message.content          # handed to the reward as `result`

Every model call it makes through `ctx.openai` / `ctx.anthropic` (or any HTTP client pointed
at `ctx.base_urls` with `ctx.api_key`) goes through the capture proxy and is stored as a
token-exact turn of this rollout. A sub-agent uses `ctx.session(name)`: the same clients, its
own session, hence its own segments of the same rollout.

A reward scores a finished rollout, sync or async:

    def my_reward(task: dict, result: Any, rollout: RolloutInfo) -> float | dict[str, float]

A dict gives named components; each becomes one reward event and the rollout's reward is
their sum (the `rollouts` view). Both are plugged in by import path (`module:function`),
never by subclassing: a plain function is all a user writes.

The SDK clients of `ctx.openai` / `ctx.anthropic` are cheap to build when they share one HTTP
connection pool (`shared_http_client`, owned by the runner for the whole run): a client that
makes its own pool loads the CA bundle, tens of milliseconds of CPU per rollout. Without one
(an agent driven by hand, in a test), each context's clients get their own pool as usual.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from collectors.proxy import DEFAULT_SESSION, SESSION_HEADER, session_key

if TYPE_CHECKING:
    import httpx2


class Agent(Protocol):
    def __call__(self, task: dict[str, Any], ctx: AgentContext) -> Awaitable[Any]: ...


@dataclass(frozen=True)
class RolloutInfo:
    """What the runner knows of one rollout when its reward is computed."""

    run: str
    group_id: str
    rollout_id: str
    slot: int  # the rollout's place in its group, 0..n-1
    attempt: int  # 0 for the first try of a slot, then 1, 2, ... for retries
    workdir: Path  # the rollout's own working directory
    policy_version: int  # the version served when the rollout was admitted
    agent_output: str | None = None  # --agent-cmd: the tail of its stdout and stderr
    agent_exit: int | None = None  # --agent-cmd: its exit status


@dataclass
class AgentContext:
    """Everything an agent needs for one rollout: clients bound to it, its limits and its directory."""

    rollout: RolloutInfo
    base_urls: Mapping[str, str]  # {"openai": ".../r/KEY/v1", "anthropic": ".../r/KEY"}
    api_key: str
    model: str  # a `model` name the proxy accepts
    max_turns: int
    max_tokens: int  # per model call
    sampling: Mapping[str, Any] = field(default_factory=dict)  # temperature, top_p, ... for each call
    session_name: str = DEFAULT_SESSION
    # one connection pool for the SDK clients of every rollout (`shared_http_client`); its owner closes it
    http_client: httpx2.AsyncClient | None = field(default=None, repr=False)
    _outcome: dict[str, str] = field(default_factory=dict, repr=False)  # shared by all sessions of the rollout
    _clients: dict[str, Any] = field(default_factory=dict, repr=False)

    def truncate(self, reason: str) -> None:
        """Mark the rollout truncated (a turn or token limit hit); it still gets its reward."""
        self._outcome.setdefault("truncated", reason)

    @property
    def truncated(self) -> str | None:
        """Why the rollout was truncated ("max_turns", "max_tokens", ...), or None."""
        return self._outcome.get("truncated")

    @property
    def workdir(self) -> Path:
        return self.rollout.workdir

    @property
    def openai(self) -> Any:
        """An `openai.AsyncOpenAI` bound to this rollout (and session)."""
        if "openai" not in self._clients:
            import openai

            self._clients["openai"] = openai.AsyncOpenAI(base_url=self.base_urls["openai"], api_key=self.api_key,
                                                         default_headers=self._headers(), max_retries=0,
                                                         http_client=self.http_client)
        return self._clients["openai"]

    @property
    def anthropic(self) -> Any:
        """An `anthropic.AsyncAnthropic` bound to this rollout (and session)."""
        if "anthropic" not in self._clients:
            import anthropic

            self._clients["anthropic"] = anthropic.AsyncAnthropic(
                base_url=self.base_urls["anthropic"], api_key=self.api_key, default_headers=self._headers(),
                max_retries=0, http_client=self.http_client)
        return self._clients["anthropic"]

    def session(self, name: str) -> AgentContext:
        """The same rollout seen from another session (a sub-agent): its turns form their own segments."""
        return AgentContext(self.rollout, self.base_urls, self.api_key, self.model, self.max_turns,
                            self.max_tokens, self.sampling, name, self.http_client, self._outcome)

    def env(self) -> dict[str, str]:
        """The variables an external agent reads: OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_*."""
        key = session_key(self.api_key, self.session_name)
        return {"OPENAI_BASE_URL": self.base_urls["openai"], "OPENAI_API_KEY": key,
                "ANTHROPIC_BASE_URL": self.base_urls["anthropic"], "ANTHROPIC_API_KEY": key,
                "TRAJSTORE_MODEL": self.model, "TRAJSTORE_ROLLOUT_ID": self.rollout.rollout_id,
                "TRAJSTORE_MAX_TOKENS": str(self.max_tokens), "TRAJSTORE_MAX_TURNS": str(self.max_turns)}

    def _headers(self) -> dict[str, str]:
        return {} if self.session_name == DEFAULT_SESSION else {SESSION_HEADER: self.session_name}

    async def aclose(self) -> None:
        """Close this context's own SDK clients; a shared `http_client` stays open (closing an SDK client
        would close its pool, so those built on it are only dropped)."""
        if self.http_client is None:
            for client in self._clients.values():
                await client.close()
        self._clients.clear()


def shared_http_client(connections: int) -> httpx2.AsyncClient:
    """One HTTP connection pool for the OpenAI and Anthropic SDK clients of many rollouts (both SDKs run
    on `httpx2` and take any `httpx2.AsyncClient`), sized for `connections` calls at once. Close it with
    `aclose()`, inside the event loop that used it."""
    import httpx2
    import openai

    # aiohttp underneath (the SDK's own transport for it): httpx2's pool scans every pooled connection on
    # each request, which at a hundred connections costs more CPU than the request; a full pool would make
    # calls queue here, unseen, so leave room for sub-agents' parallel calls too
    limits = httpx2.Limits(max_connections=max(1000, 4 * connections), max_keepalive_connections=max(100, connections))
    return openai.DefaultAioHttpClient(limits=limits)


def load_object(spec: str, *, what: str = "object") -> Any:
    """Import `module:name` (or `path/to/file.py:name`); the error says what to pass instead."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r} must be written module:name, e.g. collectors.envs.arithmetic:agent")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).resolve()
            spec_obj = importlib.util.spec_from_file_location(path.stem, path)
            if spec_obj is None or spec_obj.loader is None or not path.is_file():
                raise ImportError(f"no Python file at {path}")
            module = importlib.util.module_from_spec(spec_obj)
            sys.modules[path.stem] = module
            spec_obj.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))  # `mymodule:fn` in the current directory, as python -m does
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"could not import {what} {spec!r}: {exc}; check the module is on PYTHONPATH "
                         "(or give a file path: ./my_agent.py:run)") from exc
    try:
        obj = getattr(module, attr)
    except AttributeError:
        names = ", ".join(n for n in dir(module) if not n.startswith("_"))[:300]
        raise ValueError(f"{what} {spec!r}: module {module_name} has no {attr!r} (it has: {names})") from None
    return obj



def result_text(result: Any) -> str | None:
    """The final reply in an agent's result, as a reward reads it: the result itself when it is text, its
    `text` attribute (the tool agent's and the text-environment agent's results), or its "text" key (such a
    result as stored in the rollout's final status and handed back by `trajstore reward`); else None."""
    if isinstance(result, str):
        return result
    text = result.get("text") if isinstance(result, Mapping) else getattr(result, "text", None)
    return text if isinstance(text, str) else None
