"""An OpenEnv server as a text environment: one session per episode over OpenEnv's WebSocket protocol.

OpenEnv (`openenv-core`) serves an environment at `/ws`: a client sends `{"type": "reset",
"data": {kwargs}}`, `{"type": "step", "data": {action fields}}`, `{"type": "state"}` and
`{"type": "close"}`; each reset or step answers `{"type": "observation", "data": {"observation":
{...}, "reward": float|null, "done": bool}}`, a state request `{"type": "state", "data": {...}}`,
and a refusal `{"type": "error", "data": {"message", "code"}}`. Each connection is its own
session (its own environment instance on the server), so concurrent rollouts never share state.

`OpenEnvText` wraps one session in the gymnasium reset/step API of `collectors.envs.text_gym`,
so the text-environment agent and reward play it (each step's observation becomes the next
user message; the reward is the sum of the step rewards):

    {"id": "o1", "env": "collectors.envs.openenv:OpenEnvText", "seed": 3,
     "env_kwargs": {"url": "http://127.0.0.1:8000", "action_field": "message",
                    "observation_field": "prompt", "reset": {"difficulty": 2}}}

    trajstore collect ... --tasks tasks.jsonl --agent collectors.envs.text_gym:agent \\
        --reward collectors.envs.text_gym:reward

The reply's text is the action's `action_field`; the observation shown to the model is its
`observation_field` (or, without one, the observation as JSON). After every step the session's
`state` (episode id, step count, ...) is read and kept in the step's info: the rollout's result
stores the last one. This module speaks the protocol with `websockets` (a dependency of the
project already); `openenv-core` itself is needed only where the environment is served, which may
be another virtualenv or machine.
"""

from __future__ import annotations

import json
from typing import Any

from collectors.envs.text_gym import TextEnvError

DEFAULT_TIMEOUT_S = 60.0  # one reset, step or state answer; a slower environment passes timeout_s


class OpenEnvText:
    """One OpenEnv session with the gymnasium reset/step API over text (see the module docstring)."""

    def __init__(self, url: str, action_field: str = "message", observation_field: str | None = None,
                 reset: dict[str, Any] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://", "ws://", "wss://")):
            raise TextEnvError(f"OpenEnv `url` must be the server's http:// or ws:// address, got {url!r}")
        base = url.rstrip("/").replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        self.url = base if base.endswith("/ws") else base + "/ws"
        self.action_field, self.observation_field = action_field, observation_field
        self.reset_kwargs = dict(reset or {})
        self.timeout_s = timeout_s
        self._ws: Any = None

    def _connect(self) -> Any:
        if self._ws is None:
            from websockets.exceptions import WebSocketException
            from websockets.sync.client import connect

            try:
                self._ws = connect(self.url, open_timeout=self.timeout_s, max_size=None)
            except (OSError, TimeoutError, WebSocketException) as exc:
                raise TextEnvError(f"cannot reach the OpenEnv server at {self.url}: {exc}; start it first "
                                   "(e.g. uvicorn my_env.server.app:app --port 8000)") from exc
        return self._ws

    def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        from websockets.exceptions import WebSocketException

        ws = self._connect()
        try:
            ws.send(json.dumps(message))
            answer = json.loads(ws.recv(timeout=self.timeout_s))
        except (WebSocketException, OSError, TimeoutError, json.JSONDecodeError) as exc:
            raise TextEnvError(f"the OpenEnv server at {self.url} failed on {message['type']}: "
                               f"{type(exc).__name__}: {exc}") from exc
        if answer.get("type") == "error":
            data = answer.get("data") or {}
            raise TextEnvError(f"the OpenEnv server refused {message['type']}: {data.get('message')} "
                               f"({data.get('code')})")
        return answer.get("data") or {}

    def _text(self, observation: Any) -> str:
        if self.observation_field is None:
            return observation if isinstance(observation, str) else json.dumps(observation, sort_keys=True)
        if not isinstance(observation, dict) or self.observation_field not in observation:
            fields = sorted(observation) if isinstance(observation, dict) else type(observation).__name__
            raise TextEnvError(f"the OpenEnv observation has no field {self.observation_field!r} (it has "
                               f"{fields}); set `observation_field` in the task's env_kwargs")
        value = observation[self.observation_field]
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)

    def state(self) -> dict[str, Any]:
        """The session's state as the server reports it (episode_id, step_count, ...)."""
        return self._call({"type": "state"})

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        data = {**self.reset_kwargs, **(options or {})}
        if seed is not None:
            data["seed"] = seed
        answer = self._call({"type": "reset", "data": data})
        return self._text(answer.get("observation")), {"state": self.state()}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        answer = self._call({"type": "step", "data": {self.action_field: action}})
        reward = answer.get("reward")
        return (self._text(answer.get("observation")), 0.0 if reward is None else float(reward),
                bool(answer.get("done")), False, {"state": self.state()})

    def close(self) -> None:
        """End the session: `close`, then wait for the server to close the socket (closing it first
        leaves the server failing to send its own close frame)."""
        if self._ws is not None:
            from websockets.exceptions import WebSocketException

            try:
                self._ws.send(json.dumps({"type": "close"}))
                self._ws.recv(timeout=self.timeout_s)  # returns only if the server answers instead of closing
            except (WebSocketException, OSError, TimeoutError):
                pass  # closed (the normal end), or gone: the server ends the session when the socket drops
            finally:
                self._ws.close()
                self._ws = None
