"""vLLM's hybrid KV cache (several KV cache groups in one block pool), ported from vllm/v1/core."""
