"""A vLLM engine in the decode role: loads a prompt's KV blocks from the pool, then generates."""
