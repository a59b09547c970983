"""The embedded policy server (`trajstore serve`): vLLM's `/v1/completions` subset on torch + transformers.

`engine` batches concurrent requests over a KV cache (`kv_batch`) and samples each row with
its own parameters (`sampling`); `protocol` is the request and response JSON; `app` the
aiohttp server with hot reload of checkpoints.
"""

from collectors.embedded.app import RunningServer, create_app, run_server, serve_in_thread, start_server
from collectors.embedded.engine import Completion, Engine, load_model

__all__ = ["Completion", "Engine", "RunningServer", "create_app", "load_model", "run_server", "serve_in_thread",
           "start_server"]
