"""Everything that produces events: policy-server clients, the embedded server, the capture
proxy, chat templates, the agent runner, rewards and checkpoint hot-reload (later issues)."""
