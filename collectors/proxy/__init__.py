"""The capture proxy (`trajstore proxy`): chat APIs in front of a policy server, every call stored exactly.

`app` serves the routes; each wire protocol is one adapter in `wire/`; `capture` runs a call
through (reconcile the history with `reconcile`, render with `render`, segment with
`segmenter`, sample, parse with `collectors.model.toolcalls`, stream with `streaming`,
append through `appender`); `sessions` holds rollouts, keys and sessions; `chat` the
protocol-neutral request and reply; `protocol` the public constants agents may import (the
session header, the key's form).
"""

from collectors.proxy.app import ProxyConfig, RunningProxy, create_app, run_proxy, serve_proxy_in_thread, start_proxy
from collectors.proxy.capture import Capture
from collectors.proxy.chat import ChatError, ChatReply, ChatRequest
from collectors.proxy.protocol import DEFAULT_SESSION, KEY_PREFIX, SESSION_HEADER, SESSION_NAME, session_key, split_key
from collectors.proxy.wire import WIRES, WireProtocol

__all__ = ["DEFAULT_SESSION", "KEY_PREFIX", "SESSION_HEADER", "SESSION_NAME", "WIRES", "Capture", "ChatError", "ChatReply",
           "ChatRequest", "ProxyConfig", "RunningProxy", "WireProtocol", "create_app", "run_proxy", "serve_proxy_in_thread",
           "session_key", "split_key", "start_proxy"]
