"""One probe, from an expectation to a result: predict, reach the engine, ramp, observe, judge."""
