"""Everything that consumes shards: batching, losses, the training loop, checkpoint publishing,
LoRA and the supervised warm start. It reads the store only through `trajstore` and never
imports `collectors`; every error it raises on purpose is a `learner.errors.LearnerError`."""
