"""A vLLM engine in the prefill role: computes prompts and writes their KV blocks to the pool."""
