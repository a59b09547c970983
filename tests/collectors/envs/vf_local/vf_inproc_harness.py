"""A verifiers harness for the tests that runs in verifiers' own process (the built-in ones are uv scripts,
which fetch their dependencies): `turns` chat completions through the rollout's interception endpoint,
each reply appended to the conversation before the next call."""
from __future__ import annotations

import httpx
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult


class InprocHarnessConfig(vf.HarnessConfig):
    turns: int = 2


class InprocHarness(vf.Harness[InprocHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system, prompt = self.resolve_prompt(data)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        async with httpx.AsyncClient(timeout=120) as http:
            for turn in range(self.config.turns):
                r = await http.post(endpoint.rstrip("/") + "/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                                    json={"model": ctx.model, "messages": messages})
                if r.status_code != 200:
                    return ProgramResult(1, "", r.text)
                reply = r.json()["choices"][0]["message"]["content"] or ""
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Again."}]
        return ProgramResult(0, "", "")


__all__ = ["InprocHarness"]
