"""Everything that consumes shards: batching, losses, the training loop and checkpoint
publishing (a later issue). It reads the store only through `trajstore` and never imports
`collectors`."""
