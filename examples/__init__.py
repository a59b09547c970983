"""Working examples to copy for your own task: an environment, an agent program, a reward command (docs/own-task.md)."""
