"""The fleet's ledger: one replica's ledger (every figure of one engine) and the fleet's lines.

The fleet's admission limit is R x L: once every replica runs its own limit L, nothing more is
admitted, under any policy. Where the fleet *starts* queueing depends on the router: under an
even split (round_robin; cache_aware with kvprobe's unique texts) at N = R*L exactly, under
random routing much earlier (kvprobe/theory/fleet.py). `admission` is the fleet's Prediction
(limit and no-preemption limit scaled by R for an even split; the binding stays the replica's:
a KV verdict is drawn where one replica's KV binds), `replica` keeps one replica's ledger, and
`fleet` the theory's figures at the fleet's limit: per-replica split, fleet running and waiting,
imbalance, and what binds there (client, router or replica). `kvprobe.theory.ledger.text` renders it.
"""

from __future__ import annotations

import dataclasses
import math

from kvprobe.theory import fleet as theory


@dataclasses.dataclass
class FleetLedger:
    replica: object  # theory.ledger.Ledger of one replica
    replicas: int
    policy: str
    admission: object  # admission.Prediction of the fleet
    at_limit: theory.FleetStats | None  # the policy's prediction at N = R x L
    even: bool  # the policy splits evenly (exact)

    def __getattr__(self, name):  # capacity, scheduler_config, inputs, budget, ...: one replica's
        if name == "replica":
            raise AttributeError(name)
        return getattr(self.replica, name)

    @property
    def replica_limit(self) -> float:
        return float(self.replica.admission.limit)

    def to_dict(self) -> dict:
        out = self.replica.to_dict()
        out["replica_admission"] = out["admission"]
        out["admission"] = dataclasses.asdict(self.admission)
        out["fleet"] = {"replicas": self.replicas, "policy": self.policy, "even_split": self.even,
                        "replica_limit": self.replica_limit, "fleet_limit": float(self.admission.limit),
                        "at_limit": self.at_limit.to_dict() if self.at_limit else None}
        return out


def fleet_ledger(replica, *, replicas: int, policy: str, prompt_tokens: int, output_tokens: int,
                 simulate_at_limit: bool = True) -> FleetLedger:
    """Scale one replica's prediction to the fleet and predict the split at N = R x L."""
    pred = replica.admission
    even = theory.even_split_policy(policy, replicas)
    L = float(pred.limit)
    how = (f"{replicas} x one replica's {L:g} ({policy}: "
           + ("an even split, exact)" if even else "the plateau once every replica is full; simulated split)"))
    fleet_pred = dataclasses.replace(
        pred, limit=replicas * pred.limit, no_preemption_limit=replicas * pred.no_preemption_limit,
        limit_mean=None if pred.limit_mean is None else replicas * pred.limit_mean,
        users=None, running=None, waiting=None, users_how="", how=how,
        probe_users=None if pred.probe_users is None else replicas * pred.probe_users)
    at_limit = None
    config = replica.scheduler_config
    if simulate_at_limit and config is not None:
        users = replicas * max(1, math.ceil(L))
        at_limit = theory.predict(config, prompt_tokens, output_tokens, users, replicas, policy, limit=L, lifetimes=30)
    return FleetLedger(replica=replica, replicas=replicas, policy=policy, admission=fleet_pred, at_limit=at_limit,
                       even=even)
