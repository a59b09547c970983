"""Gymnasium-style text environments as `trajstore collect` episodes: one generic agent and reward.

Any environment with the gymnasium reset/step API whose observations and actions are text
plugs in (a `gymnasium.Env` with `Text` spaces, or any object with the same two methods,
as the skyrl-gym environments are). The task names it and the agent plays it:

    {"id": "g1", "env": "my_envs:GuessNumber", "env_kwargs": {"high": 20}, "seed": 7,
     "system": "Guess the number."}

    trajstore collect ... --tasks tasks.jsonl --agent collectors.envs.text_gym:agent \\
        --reward collectors.envs.text_gym:reward

`env` is a `module:callable` (a class or factory, called with `env_kwargs`) or, without a
colon, a registered gymnasium id (`gymnasium.make(id, **env_kwargs)`). An episode:

    system:     task["system"] (when given)
    user:       the observation of `reset(seed=task["seed"])`
    assistant:  the model's reply; its text is the action of `step(action)`
    user:       the observation `step` returned
    ...         until `terminated` or `truncated`, or `ctx.max_turns` model calls

Each step's observation is the next user message, so the whole episode is one growing
conversation (one segment at the proxy). A reply cut by max_tokens is still sent to the
environment as the action (the environment decides what a cut answer is worth), then the
rollout is marked truncated. The reward is the environment's own: `return` is the sum of
its step rewards; `steps` are never rewarded, they are in the result.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from typing import Any

from collectors.agents.context import AgentContext, load_object
from collectors.errors import CollectorError


class TextEnvError(CollectorError, ValueError):
    """The task's environment cannot be built or does not speak text."""


@dataclass(frozen=True)
class TextEnvResult:
    """One episode of a text environment; handed to the reward as `result`."""

    text: str  # the last reply
    messages: list[dict[str, Any]]  # the conversation sent to the model, last reply included
    rewards: list[float]  # the environment's reward for each step, in order
    terminated: bool  # the environment ended the episode
    truncated: bool  # the environment, the turn limit or the token limit cut it short
    info: dict[str, Any] = field(default_factory=dict)  # the last step's info when it is JSON (e.g. OpenEnv's state)


def make_env(task: dict[str, Any]) -> Any:
    """The task's environment, built fresh for this episode (see the module docstring)."""
    spec, kwargs = task.get("env"), task.get("env_kwargs") or {}
    if not isinstance(spec, str) or not spec:
        raise TextEnvError("a text-environment task needs `env`: module:callable (e.g. my_envs:GuessNumber) "
                           "or a registered gymnasium id")
    if not isinstance(kwargs, dict):
        raise TextEnvError(f"`env_kwargs` must be an object of keyword arguments, got {type(kwargs).__name__}")
    if ":" in spec:
        factory = load_object(spec, what="environment")
        if not callable(factory):
            raise TextEnvError(f"environment {spec!r} is a {type(factory).__name__}, not a class or factory")
        env = factory(**kwargs)
    else:
        import gymnasium

        try:
            env = gymnasium.make(spec, **kwargs)
        except gymnasium.error.Error as exc:
            raise TextEnvError(f"gymnasium cannot make {spec!r}: {exc}; register it, or give module:callable") from exc
    if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
        raise TextEnvError(f"environment {spec!r} built a {type(env).__name__}, which has no reset() and step()")
    return env


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise TextEnvError(f"{where} returned a {type(value).__name__} observation; a text environment's "
                           "observations must be str (wrap the env to render them as text)")
    return value


def _step_reward(value: Any) -> float:
    reward = float(value)
    if not math.isfinite(reward):
        raise TextEnvError(f"the environment's step reward {value!r} is not a finite number")
    return reward


async def play(env: Any, task: dict[str, Any], ctx: AgentContext) -> TextEnvResult:
    """Play one episode of `env` with the model behind `ctx` (see the module docstring)."""
    observation, _ = await asyncio.to_thread(env.reset, seed=task.get("seed"))
    messages: list[dict[str, Any]] = [{"role": "system", "content": task["system"]}] if task.get("system") else []
    messages.append({"role": "user", "content": _text(observation, "reset()")})
    rewards: list[float] = []
    text, terminated, truncated, info = "", False, False, {}
    while not (terminated or truncated):
        if len(rewards) == ctx.max_turns:
            ctx.truncate("max_turns")
            truncated = True
            break
        reply = await ctx.openai.chat.completions.create(model=ctx.model, messages=messages,
                                                         max_tokens=ctx.max_tokens, **ctx.sampling)
        choice = reply.choices[0]
        text = choice.message.content or ""
        messages.append({"role": "assistant", "content": text})
        # the environment is synchronous user code: in a thread, so it cannot stall other rollouts
        observation, step_reward, terminated, truncated, info = await asyncio.to_thread(env.step, text)
        rewards.append(_step_reward(step_reward))
        if choice.finish_reason == "length" and not terminated:
            ctx.truncate("max_tokens")
            truncated = True
            break
        if not (terminated or truncated):
            messages.append({"role": "user", "content": _text(observation, "step()")})
    return TextEnvResult(text, messages, rewards, bool(terminated), bool(truncated), _jsonable(info))


def _jsonable(info: Any) -> dict[str, Any]:
    """The step's info if it is a JSON object (stored with the result), else nothing."""
    try:
        return dict(json.loads(json.dumps(info))) if isinstance(info, dict) else {}
    except (TypeError, ValueError):
        return {}


async def agent(task: dict[str, Any], ctx: AgentContext) -> TextEnvResult:
    """The collect agent: build the task's environment, play one episode, close the environment."""
    env = make_env(task)
    try:
        return await play(env, task, ctx)
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            close()


def reward(task: dict[str, Any], result: Any, rollout: Any = None) -> dict[str, float]:
    """`{"return": sum of the environment's step rewards}`."""
    rewards = getattr(result, "rewards", None)
    if rewards is None and isinstance(result, dict):  # re-scoring: the stored result is the dataclass as JSON
        rewards = result.get("rewards")
    if not isinstance(rewards, list):
        raise TextEnvError("text_gym.reward scores the result of text_gym.agent (its per-step `rewards`); "
                           f"got a {type(result).__name__}")
    return {"return": float(sum(rewards))}
