"""The prefill worker: computes prompts' KV and writes it into decode workers' blocks."""
