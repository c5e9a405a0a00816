"""Fleet theory (kvprobe/theory/fleet.py) against figures worked by hand.

Replicas here are capped by max_num_seqs (a pool far larger than the load) and serve long outputs
(O=200), so a finished request's one-step dip in `running` (schedsim samples after a finish, before
the resubmit) costs at most 4/200 of a request: the hand figures hold within 0.1.
"""

import pytest

from kvprobe.errors import ConfigError
from kvprobe.theory import fleet
from kvprobe.theory.schedsim import VllmConfig

P, OUT = 16, 200
CAP4 = VllmConfig(num_gpu_blocks=4097, block_size=16, max_num_seqs=4)
WIDE = VllmConfig(num_gpu_blocks=8193, block_size=16, max_num_seqs=1024)


def test_round_robin_counter_cycles_and_even_split():
    r = fleet.RouterModel("round_robin", 3)
    assert [r.pick([9, 0, 0]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]  # load is ignored
    assert fleet.even_split(10, 3) == [4, 3, 3]
    assert fleet.even_split(9, 3) == [3, 3, 3]
    assert fleet.even_split(2, 3) == [1, 1, 0]


def test_power_of_two_with_two_replicas_is_shortest_queue():
    r = fleet.RouterModel("power_of_two", 2, seed=1, load_signal="inflight")
    assert {r.pick([5, 3]) for _ in range(50)} == {1}
    assert {r.pick([2, 7]) for _ in range(50)} == {0}


def test_power_of_two_without_a_load_signal_is_uniform():
    # every worker's load reads 0 (no /get_load): 0 <= 0 keeps the first random pick
    r = fleet.RouterModel("power_of_two", 3, seed=2)
    picks = [r.pick([9, 0, 0]) for _ in range(3000)]
    assert all(900 < picks.count(k) < 1100 for k in range(3))


def test_cache_aware_cycles_by_tree_size_and_the_imbalance_rule_uses_both_thresholds():
    r = fleet.RouterModel("cache_aware", 3)
    assert [r.pick([0, 0, 0]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]  # fewest texts sent so far
    r = fleet.RouterModel("cache_aware", 2)
    assert r.pick([64, 0]) == 0  # 64 - 0 is not > 64: balanced, smallest tree (both empty: the first)
    assert r.pick([65, 0]) == 1  # > 64 and 65 > 0 * 1.5: least loaded
    assert r.pick([100, 40]) == 0  # difference 60: balanced; 1 text each, the first
    assert r.pick([130, 65]) == 1  # 65 > 64 and 130 > 97.5
    assert r.pick([200, 134]) == 0  # 66 > 64 but 200 <= 201: balanced; 2 texts each, the first


def test_unknown_policy_is_one_clear_error():
    with pytest.raises(ConfigError, match="round_robin, random, power_of_two, cache_aware"):
        fleet.RouterModel("least_busy", 2)


def test_round_robin_fleet_is_the_sum_of_even_shares():
    # 15 users over 3 replicas capped at 4: 5 each for good -> running 4+4+4, waiting 1+1+1
    s = fleet.predict(CAP4, P, OUT, 15, 3, "round_robin", limit=4.0)
    assert s.exact
    assert s.fleet_running == pytest.approx(12, abs=0.1)
    assert s.fleet_waiting == pytest.approx(3, abs=0.1)
    assert s.binding == "replica"
    # 14 users (simulated): shares 5, 5, 4 at every instant, all >= 4 -> running 12, waiting 2
    s = fleet.predict(CAP4, P, OUT, 14, 3, "round_robin", limit=4.0)
    assert not s.exact
    assert s.fleet_running == pytest.approx(12, abs=0.1)
    assert s.fleet_waiting == pytest.approx(2, abs=0.1)
    assert fleet.round_robin_rejection_point(4, 3) == 12
    # 12 users: 4 each, nothing waits: the client binds
    s = fleet.predict(CAP4, P, OUT, 12, 3, "round_robin", limit=4.0)
    assert s.fleet_running == pytest.approx(12, abs=0.1) and s.fleet_waiting == 0
    assert s.binding == "client"


def test_lockstep_simulation_of_round_robin_equals_the_even_split():
    """The module doc's argument, checked: routing every request through the counter in a
    simulation of three schedulers gives the exact per-replica figures for N a multiple of R, and
    for other N the split rotates (time means N/R each) with the same fleet sum."""
    for users in (9, 15):
        exact = fleet.round_robin(CAP4, P, OUT, users, 3, limit=4.0)
        sim = fleet.simulate(CAP4, P, OUT, users, 3, "round_robin", limit=4.0)
        assert sim.inflight == pytest.approx(exact.inflight, abs=0.05)
        assert sim.running == pytest.approx(exact.running, abs=0.1)
    sim = fleet.simulate(CAP4, P, OUT, 10, 3, "round_robin", limit=4.0)
    assert sim.inflight == pytest.approx((10 / 3 * (1 - 1 / 200),) * 3, abs=0.05)  # the dip: 1/lifetime
    assert sim.fleet_waiting == 0  # ceil(10/3) = 4 <= L


def test_random_split_loses_to_imbalance_below_the_independent_bound():
    # 8 users, 2 replicas capped at 4. Independent split: 2 * E[min(Bin(8, 1/2), 4)]
    # = 2 * (1*8 + 2*28 + 3*56 + 4*(70+56+28+8+1)) / 256 = 2 * 884/256 = 6.90625
    assert fleet.independent_split_running(8, 2, 4) == pytest.approx(6.90625)
    s = fleet.simulate(CAP4, P, OUT, 8, 2, "random", limit=4.0, seed=3, lifetimes=40)
    assert 4.0 < s.fleet_running <= 6.90625 + 0.1
    assert s.binding == "router"


def test_cache_aware_with_equal_texts_splits_like_round_robin():
    """Lockstep simulation of the smallest-tree cycle: the even split, so predict() uses the exact
    round-robin figures for N a multiple of R."""
    sim = fleet.simulate(CAP4, P, OUT, 15, 3, "cache_aware", limit=4.0)
    exact = fleet.round_robin(CAP4, P, OUT, 15, 3, limit=4.0)
    assert sim.inflight == pytest.approx(exact.inflight, abs=0.05)
    assert sim.fleet_running == pytest.approx(12, abs=0.1)
    assert fleet.predict(CAP4, P, OUT, 15, 3, "cache_aware", limit=4.0).exact


def test_power_of_two_with_a_load_signal_beats_random_with_three_replicas():
    rnd = fleet.simulate(CAP4, P, OUT, 12, 3, "random", limit=4.0, seed=5, lifetimes=20)
    p2c = fleet.simulate(CAP4, P, OUT, 12, 3, "power_of_two", limit=4.0, seed=5, lifetimes=20,
                         load_signal="inflight")
    assert p2c.fleet_running > rnd.fleet_running + 0.5
    assert p2c.imbalance < rnd.imbalance


def test_kvprobe_ledger_prints_the_fleet_lines(capsys):
    """`kvprobe ledger ... --replicas 4`: one replica's ledger, then the fleet's lines: 81 blocks
    (80 usable), P=128 O=32 -> one replica ~7.8, the fleet 4 x that; round robin splits 32 as 8 each (7.8 in flight:
    the one-step dip of a finish in a 33-step lifetime)."""
    import json

    from kvprobe.cli.main import main

    base = ["ledger", "--engine", "vllm", "--model", "meta-llama/Llama-3.1-8B", "--gpu-memory", "24GiB",
            "--num-gpu-blocks-override", "81", "--max-model-len", "1024", "--prompt-tokens", "128",
            "--output-tokens", "32", "--replicas", "4"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "admission limit, fleet" in out and "7.8 / 7.8 / 7.8 / 7.8" in out and "exact (even split)" in out
    assert main([*base, "--json", "--router-policy", "random"]) == 0
    fleet_json = json.loads(capsys.readouterr().out)["fleet"]
    assert fleet_json["policy"] == "random" and not fleet_json["even_split"]
    assert fleet_json["fleet_limit"] == pytest.approx(4 * fleet_json["replica_limit"])
    assert fleet_json["at_limit"]["binding"] == "router"  # some replica queues while another has room
    assert main([a for a in base if a not in ("--prompt-tokens", "128", "--output-tokens", "32")]) != 0
    assert "--replicas: expected --prompt-tokens and --output-tokens" in capsys.readouterr().err
