"""The settings of `trajstore collect` (`CollectSettings`): one frozen dataclass, checked all at once.

Its field defaults are the CLI's option defaults (`cli.collect_cmd` reads them), so this module
stays light: `collect --help` imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from collectors.collect.agent_cmd import CommandEnv

DISPLAYS = ("auto", "live", "plain", "off")
VLLM_RELOADS = ("weights", "follow", "lora")  # collectors.policy.VLLMClient's `reload`


@dataclass(frozen=True)
class CollectSettings:
    """Everything `collect` needs; `problems()` lists every invalid setting at once."""

    store: str
    run: str
    tasks: str
    n: int = 4
    server: str | None = None  # policy server URL; None: start the embedded one on `model`
    vllm: bool = False  # vLLM (VLLMClient): at `server`, or started here on `model` (its own virtualenv)
    vllm_reload: str = "weights"  # this collector reloads vLLM's weights, follows another's reloads, or loads LoRA
    model: str | None = None  # checkpoint dir: served in-process, and the proxy's tokenizer
    proxy: str | None = None  # an external capture proxy; None: one in-process
    control_token: str | None = None  # the embedded server's at `server` (`serve --control-token`): reload from afar
    concurrency: int = 16
    rollout_timeout: float = 600.0
    max_turns: int = 8
    max_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    epochs: int = 1
    forever: bool = False  # cycle over the tasks (epoch after epoch) until stopped
    follow: bool = False  # forever, after waiting for the learner to announce itself
    agent: str | None = None  # module:function
    tools: str | None = None  # module:fn,module:fn for the built-in tool agent
    agent_cmd: str | None = None  # shell command, run per rollout in its directory
    reward: str | None = None  # module:function
    reward_cmd: str | None = None  # shell command: exit 0 = 1.0
    pass_env: tuple[str, ...] = ()  # this process's variables the commands see besides the allow-list
    inherit_env: bool = False  # the commands see all of this process's environment (the control token aside)
    no_reward: bool = False  # collect unscored rollouts on purpose (`trajstore reward` scores them later)
    retries: int = 2
    max_staleness: int | None = None
    groups_per_version: int | None = None  # default: the learner's announcement
    workdir: str | None = None  # default: <tmp>/trajstore-<run>
    keep_workdirs: bool = False  # keep the directories of usable rollouts too (failed ones are always kept)
    display: str = "auto"  # auto (live on a terminal, else plain) | live | plain | off
    policy_version: int = 0  # version of the weights the server starts with (in-process or vLLM)
    device: str = "auto"
    max_batch: int = 16
    threads: int | None = None
    poll_interval_s: float = 0.5
    seal_interval: float = 60.0  # seconds before turns are sealed (visible to other machines); statuses at once
    checkpoint_cache: str | None = None  # copies of checkpoints published on other hosts; None: the default cache

    @property
    def command_env(self) -> CommandEnv:
        return CommandEnv(self.pass_env, self.inherit_env)

    def problems(self) -> list[str]:
        from collectors.policy.contract import TOP_K_MAX  # the policy package loads its clients: not for --help

        out = []
        for name, low in (("n", 1), ("concurrency", 1), ("max_turns", 1), ("max_tokens", 1), ("epochs", 1),
                          ("max_batch", 1), ("retries", 0), ("policy_version", 0)):
            if getattr(self, name) < low:
                out.append(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(self, name)}")
        for name in ("max_staleness", "groups_per_version", "threads"):
            value, low = getattr(self, name), 0 if name == "max_staleness" else 1
            if value is not None and value < low:
                out.append(f"--{name.replace('_', '-')} must be at least {low}, got {value}")
        if self.rollout_timeout <= 0 or self.poll_interval_s <= 0 or not 0 < self.seal_interval < float("inf"):
            out.append("--rollout-timeout, --seal-interval and --poll-interval must be positive")
        if not (0 <= self.temperature <= 2 and 0 < self.top_p <= 1 and 0 <= self.top_k <= TOP_K_MAX):
            out.append(f"sampling needs 0 <= --temperature <= 2, 0 < --top-p <= 1 and --top-k 0 (off) to {TOP_K_MAX} "
                       f"(got {self.temperature}, {self.top_p}, {self.top_k})")
        if not self.run:
            out.append("--run must name the run")
        given = [f"--{n.replace('_', '-')}" for n in ("agent", "tools", "agent_cmd") if getattr(self, n)]
        if len(given) > 1:
            out.append(f"{' and '.join(given)} are all agents: give one (or none for a single model call per rollout)")
        if self.reward and self.reward_cmd:
            out.append("--reward and --reward-cmd both given: give one")
        if not (self.reward or self.reward_cmd or self.no_reward):
            out.append("no reward: give --reward MODULE:FN or --reward-cmd CMD; or --no-reward to collect unscored "
                       "rollouts on purpose (the store counts them untrainable until `trajstore reward` scores them)")
        out += self.command_env.problems()
        if (self.pass_env or self.inherit_env) and not (self.agent_cmd or self.reward_cmd):
            out.append("--pass-env and --inherit-env choose what --agent-cmd and --reward-cmd see; give one of those")
        if self.no_reward and (self.reward or self.reward_cmd):
            out.append("--no-reward with --reward or --reward-cmd: give one or the other")
        if not Path(self.tasks).is_file():
            out.append(f"--tasks {self.tasks} does not exist")
        if self.model is None and self.server is None:
            out.append("no policy: pass --model DIR (served in-process) or --server URL")
        if self.model is not None and not (Path(self.model) / "config.json").is_file():
            out.append(f"--model {self.model} is not a Hugging Face checkpoint directory (no config.json)")
        if self.proxy is not None and self.server is None:
            out.append("--proxy needs --server: the external proxy samples from a server this process must reach "
                       "to hot-reload checkpoints")
        if self.vllm and self.model is None and self.proxy is None:
            out.append("--vllm needs --model DIR too: the in-process capture proxy renders prompts with its "
                       "tokenizer and chat template")
        if self.control_token is not None and (self.server is None or self.vllm):
            out.append("--control-token is for reloading a `trajstore serve` at --server; give --server URL (vLLM's "
                       "reload routes take no token: keep them on the server's machine)")
        if self.vllm_reload not in VLLM_RELOADS:
            out.append(f"--vllm-reload must be one of {', '.join(VLLM_RELOADS)}, got {self.vllm_reload!r}")
        if self.vllm_reload == "follow" and self.vllm and self.server is None:
            out.append("--vllm-reload follow needs --server URL: it follows the reloads of the collector that owns "
                       "that vLLM; a vLLM started by this collector has no other owner")
        if self.checkpoint_cache is not None:
            cache = Path(self.checkpoint_cache)
            if not self.checkpoint_cache.strip() or (cache.exists() and not cache.is_dir()):
                out.append(f"--checkpoint-cache {self.checkpoint_cache!r} must be a directory (it is made when "
                           "missing); checkpoints published on other hosts are fetched into it")
        if self.display not in DISPLAYS:
            out.append(f"display must be one of {', '.join(DISPLAYS)}, got {self.display!r}")
        return out

