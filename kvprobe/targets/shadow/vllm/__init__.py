"""The vLLM shadow: real `vllm serve` with kvprobe's model-less worker."""
