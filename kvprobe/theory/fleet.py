"""A fleet: R identical replicas behind a router, driven by a closed loop of N fixed-length requests.

What the fleet admits is not R x one replica's limit at every N: the router decides how the N
requests in flight split over the replicas, and a replica queues as soon as *its* share exceeds
its own limit L, whatever room the others have. Three things can bind:

- `client`: N is below what the fleet admits; nothing waits (N <= R*L under an even split).
- `router`: some replica queues while another has room: the fleet runs fewer than min(N, R*L)
  because of the split (random, cache_aware's pile-up), not because the fleet is full.
- `replica`: every replica runs its own limit L, the fleet runs R*L; what binds inside a replica
  (kv, max_num_seqs, ...) is that replica's ledger binding.

The router's policies are modelled from sglang-router 0.3.2 (the wheel's sglang_router_rs: the
Rust policies of sgl-project/sglang `sgl-model-gateway/src/policies/`, older tree
`sgl-router/src/policies/`):

- round_robin (round_robin.rs): `counter.fetch_add(1) % healthy.len()`, the load is ignored.
  Exact for an even split: requests are identical and each replica serves its share in arrival
  order, so requests finish in the order they were sent and their users resubmit in that order;
  the k-th send goes to replica k mod R, and the N requests in flight are always N consecutive
  sends: every replica holds floor(N/R) or ceil(N/R) of them at every instant (which replicas hold
  the ceiling rotates as the window slides). So no replica queues while ceil(N/R) <= L: the
  fleet's rejection point is R*L exactly, and with N a multiple of R every replica is one engine
  with N/R users for good (`closed_loop`), the fleet its sum. Other N are simulated. (Once a
  replica queues, finishing order can change — but only with every replica at or above L.)
- random (random.rs): a uniform healthy replica per request, load ignored.
- power_of_two (power_of_two.rs): two *distinct* random replicas, the one with the lower load
  wins (`load1 <= load2` keeps the first). The load is a LoadMonitor's token load when it has one
  for both (it polls SGLang's /get_load), else the worker's own load counter. Measured with
  0.3.2 in front of vLLM-dialect replicas (no /get_load): `GET /workers` shows load 0 for every
  worker with 12 requests in flight, and 12 requests split 3/3/6 — every comparison is 0 <= 0, the
  first pick wins, and the policy is uniform random (`load_signal="none"`, the default here).
  With a load signal (`"inflight"`) it compares in-flight counts; with two replicas it then always
  compares both: join-the-shortest-queue, an even split.
- cache_aware (cache_aware.rs): if max_load - min_load > balance_abs_threshold (64) and
  max_load > min_load * balance_rel_threshold (1.5) (router_args.py defaults), the least loaded
  replica; else the replica whose approximate radix tree of request *text* matches best above
  cache_threshold (0.3), else the replica with the smallest tree. kvprobe's prompts reach the
  router as text (token ids are refused, kvprobe/targets/fleet/router.py) of equal length, unique from
  the first word: no match reaches 0.3, and the smallest tree is the replica that was sent the
  fewest requests so far — a cycle, like round_robin (measured: 12 requests arriving in turn over
  three replicas, 4/4/4 by `GET /workers`; the router routes concurrent arrivals in parallel, and
  two that read the sizes before either is inserted share a replica: 3/4/5 seen once when 12 arrived
  at once). The imbalance rule never fires under that cycle.

Time model: every replica steps once per time unit in lockstep (identical replicas, one engine
step each); a finished request's user resubmits through the router before the next step, as in
schedsim.closed_loop. Pure: no clock, no I/O; randomness from a seeded numpy Generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from kvprobe.errors import ConfigError
from kvprobe.theory.schedsim import (
    SglangConfig,
    SimRequest,
    VllmConfig,
    arrival_steps,
    closed_loop,
    make_scheduler,
    request_lifetime,
    workload_prompt,
)

POLICIES = ("round_robin", "random", "power_of_two", "cache_aware")
BALANCE_ABS_THRESHOLD = 64  # sglang-router 0.3.2 router_args.py RouterArgs.balance_abs_threshold
BALANCE_REL_THRESHOLD = 1.5  # ... RouterArgs.balance_rel_threshold
WAITING_SLACK = 0.05  # mean waiting below this is "nothing waits" (a transient at a finish)


# --------------------------------------------------------------------------- the router


@dataclass
class RouterModel:
    """One routing decision from the router's per-replica in-flight counts (`loads`)."""

    policy: str
    replicas: int
    seed: int = 0
    balance_abs_threshold: int = BALANCE_ABS_THRESHOLD
    balance_rel_threshold: float = BALANCE_REL_THRESHOLD
    load_signal: str = "none"  # power_of_two: "none" (no /get_load: uniform random) | "inflight"
    _counter: int = field(default=0, init=False)
    _sent: list = field(default_factory=list, init=False, repr=False)
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ConfigError(f"router policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {self.replicas}")
        if self.load_signal not in ("none", "inflight"):
            raise ConfigError(f"load_signal must be 'none' or 'inflight', got {self.load_signal!r}")
        self._rng = np.random.default_rng(self.seed)
        self._sent = [0] * self.replicas

    def pick(self, loads: list[int]) -> int:
        R = self.replicas
        if R == 1:
            return self._chose(0)
        if self.policy == "round_robin":
            return self._chose(self._counter % R)
        if self.policy == "random" or (self.policy == "power_of_two" and self.load_signal == "none"):
            return self._chose(int(self._rng.integers(R)))
        if self.policy == "power_of_two":
            # power_of_two.rs: idx2 = (idx1 + 1 + rand(0..R-1)) % R — two distinct replicas
            i = int(self._rng.integers(R))
            j = (i + 1 + int(self._rng.integers(R - 1))) % R
            return self._chose(i if loads[i] <= loads[j] else j)
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            return self._chose(loads.index(lo))  # min_by_key keeps the first minimum
        sent = self._sent
        return self._chose(sent.index(min(sent)))  # the smallest tree: fewest (equal-length) texts

    def _chose(self, r: int) -> int:
        self._counter += 1
        self._sent[r] += 1
        return r


def even_split(users: int, replicas: int) -> list[int]:
    """Round robin's in-flight split at any instant (module doc): floor or ceil of N/R."""
    base, extra = divmod(users, replicas)
    return [base + (r < extra) for r in range(replicas)]


def round_robin_rejection_point(replica_limit: int, replicas: int) -> int:
    """The largest N no replica queues at under round robin: ceil(N/R) <= L  <=>  N <= R*L."""
    return replicas * replica_limit


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class FleetStats:
    users: int
    replicas: int
    policy: str
    running: tuple[float, ...]  # per replica, time mean, sorted from the most loaded
    waiting: tuple[float, ...]
    inflight: tuple[float, ...]  # running + waiting: what the router counts per worker
    replica_limit: float  # L: one replica's running plateau (closed_loop at saturation)
    usage: tuple[float, ...] = ()  # per replica (same order), the usage gauge's time mean
    steps: int = 0  # measured window (0: exact, no simulation)
    exact: bool = False

    @property
    def fleet_running(self) -> float:
        return sum(self.running)

    @property
    def fleet_waiting(self) -> float:
        return sum(self.waiting)

    @property
    def fleet_limit(self) -> float:
        """R x L: the fleet's running plateau once every replica is saturated (any policy)."""
        return self.replicas * self.replica_limit

    @property
    def fleet_usage(self) -> float | None:
        """The mean of the replicas' usage gauges (what the fleet sampler reads for identical pools)."""
        return sum(self.usage) / len(self.usage) if self.usage else None

    @property
    def imbalance(self) -> float:
        """max - min of the per-replica mean in-flight counts (0: an even split of a multiple of R)."""
        return max(self.inflight) - min(self.inflight)

    @property
    def binding(self) -> str:
        """What stops the fleet admitting more at this N (module doc): client, router or replica."""
        if self.fleet_waiting <= WAITING_SLACK:
            return "client"
        if self.fleet_running >= self.fleet_limit * 0.98:
            return "replica"
        return "router"

    def to_dict(self) -> dict:
        return {"users": self.users, "replicas": self.replicas, "policy": self.policy,
                "running": list(self.running), "waiting": list(self.waiting), "inflight": list(self.inflight),
                "replica_limit": self.replica_limit, "fleet_limit": self.fleet_limit,
                "fleet_running": self.fleet_running, "fleet_waiting": self.fleet_waiting,
                "usage": list(self.usage), "fleet_usage": self.fleet_usage,
                "imbalance": self.imbalance, "binding": self.binding, "exact": self.exact, "steps": self.steps}


# --------------------------------------------------------------------------- predictions


def replica_limit(config: VllmConfig | SglangConfig, prompt_tokens: int, output_tokens: int,
                  saturating_users: int) -> float:
    """One replica's running plateau: closed_loop with enough users to saturate it."""
    return closed_loop(config, prompt_tokens, output_tokens, saturating_users).running_mean


def round_robin(config: VllmConfig | SglangConfig, prompt_tokens: int, output_tokens: int, users: int,
                replicas: int, *, limit: float | None = None, saturating_users: int | None = None) -> FleetStats:
    """Exact for N a multiple of R: every replica is one engine with N/R users (module doc)."""
    if users % replicas:
        raise ConfigError(f"the exact round-robin split needs users a multiple of replicas ({users} % {replicas})")
    one = closed_loop(config, prompt_tokens, output_tokens, users // replicas)
    if limit is None:
        limit = replica_limit(config, prompt_tokens, output_tokens, saturating_users or max(2 * users, 1))
    inflight = one.running_mean + one.waiting_mean
    return FleetStats(users=users, replicas=replicas, policy="round_robin", running=(one.running_mean,) * replicas,
                      waiting=(one.waiting_mean,) * replicas, inflight=(inflight,) * replicas, replica_limit=limit,
                      usage=(one.usage_mean,) * replicas, steps=one.steps, exact=True)


def simulate(config: VllmConfig | SglangConfig, prompt_tokens: int, output_tokens: int, users: int,
             replicas: int, policy: str, *, lifetimes: float = 6.0, warmup_lifetimes: float = 2.0,
             seed: int = 0, limit: float | None = None, saturating_users: int | None = None,
             load_signal: str = "none") -> FleetStats:
    """R schedulers stepped in lockstep, the router model choosing each request's replica."""
    if users < 1:
        raise ConfigError(f"users must be >= 1, got {users}")
    router = RouterModel(policy, replicas, seed=seed, load_signal=load_signal)
    scheds = [make_scheduler(config) for _ in range(replicas)]
    life = request_lifetime(config, prompt_tokens, output_tokens)
    arrivals = arrival_steps(life, users)
    t0 = arrivals[-1] + math.ceil(warmup_lifetimes * life)
    t_end = t0 + max(math.ceil(lifetimes * life), 200)
    sums = np.zeros((3, replicas))
    count = 0

    def send() -> None:
        nonlocal count
        loads = [s.stats.running + s.stats.waiting for s in scheds]
        r = router.pick(loads)
        scheds[r].add(SimRequest(f"u{count}", workload_prompt(count, prompt_tokens), output_tokens))
        count += 1

    nxt = 0
    for t in range(t_end):
        while nxt < users and arrivals[nxt] <= t:
            send()
            nxt += 1
        finished = 0
        for s in scheds:
            finished += len(s.step().finished)
        if t >= t0:
            for r, s in enumerate(scheds):
                sums[0, r] += s.stats.running
                sums[1, r] += s.stats.waiting
                sums[2, r] += s.stats.used_tokens / s.stats.pool_tokens
        for _ in range(finished):
            send()
    window = t_end - t0
    means = sums / window
    order = np.argsort(-(means[0] + means[1]), kind="stable")
    if limit is None:
        limit = replica_limit(config, prompt_tokens, output_tokens, saturating_users or max(2 * users, 1))
    return FleetStats(users=users, replicas=replicas, policy=policy,
                      running=tuple(float(means[0, r]) for r in order),
                      waiting=tuple(float(means[1, r]) for r in order),
                      inflight=tuple(float(means[0, r] + means[1, r]) for r in order),
                      usage=tuple(float(means[2, r]) for r in order), replica_limit=limit, steps=window)


def even_split_policy(policy: str, replicas: int, load_signal: str = "none") -> bool:
    """Policies whose in-flight split is round robin's: round_robin; cache_aware with kvprobe's
    equal-length unique texts (a cycle, module doc); power_of_two comparing in-flight counts
    over two replicas (join-the-shortest-queue)."""
    return (policy in ("round_robin", "cache_aware") or replicas == 1
            or (policy == "power_of_two" and replicas == 2 and load_signal == "inflight"))


def predict(config: VllmConfig | SglangConfig, prompt_tokens: int, output_tokens: int, users: int,
            replicas: int, policy: str, **kw) -> FleetStats:
    """The fleet at N users: exact for an even-split policy with N a multiple of R, simulated
    otherwise."""
    if policy not in POLICIES:
        raise ConfigError(f"router policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if even_split_policy(policy, replicas, kw.get("load_signal", "none")) and users % replicas == 0:
        exact_kw = {k: v for k, v in kw.items() if k in ("limit", "saturating_users")}
        return replace(round_robin(config, prompt_tokens, output_tokens, users, replicas, **exact_kw), policy=policy)
    return simulate(config, prompt_tokens, output_tokens, users, replicas, policy, **kw)


def independent_split_running(users: int, replicas: int, limit: int) -> float:
    """E[sum_r min(n_r, L)] with n ~ Multinomial(N, 1/R): the random policy if a request's stay did
    not depend on its replica's queue. An upper bound for the closed loop, where requests queued on
    a crowded replica stay longer and so are over-represented in flight (hand-checkable)."""
    from math import comb

    p = 1.0 / replicas
    one = sum(comb(users, k) * p**k * (1 - p) ** (users - k) * min(k, limit) for k in range(users + 1))
    return replicas * one
