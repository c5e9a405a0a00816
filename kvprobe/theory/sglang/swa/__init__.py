"""SGLang's scheduler on hybrid sliding-window models: two token pools, with and without the radix cache."""
