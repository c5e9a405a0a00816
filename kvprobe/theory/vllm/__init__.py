"""vLLM's theory: its memory budget, block pool, scheduler and admission, per release."""
