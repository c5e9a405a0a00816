"""Fleets (issue 15): R replicas of one engine configuration behind a real router.

`router`: sglang-router 0.3.2's facts, environment and process. `target`: the replicas and the
router as one probe target. `sampler`: every replica's /metrics, summed into the fleet's series.
`spec`: the `target: {fleet: ...}` key. `ledger` and `checks`: the fleet's prediction (theory in
kvprobe/theory/fleet.py) and the per-replica and router checks.
"""
