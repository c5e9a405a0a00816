"""Fleets: R replicas of one engine configuration behind a real router.

`router`: sglang-router 0.3.2's facts, environment and process. `target`: the replicas and the
router as one probe target. `sampler`: every replica's /metrics, summed into the fleet's series.
The `target: {fleet: ...}` key is parsed by kvprobe.spec.fleet; the fleet's prediction is
kvprobe/theory/fleet.py and kvprobe/theory/ledger/fleet.py, its per-replica figures and checks
kvprobe/verdict/fleet.py, its report table kvprobe/report/fleet.py.
"""
