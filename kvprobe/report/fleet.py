"""The per-replica table of a fleet probe's report: each level, each replica's running, waiting,
usage and in-flight means, the imbalance, and the policy's prediction at that N."""

from __future__ import annotations

from kvprobe.tables import render_table


def _n(x, pattern: str = "{:.1f}") -> str:
    return "—" if x is None else pattern.format(x)


def replica_table(result) -> str:
    fleet = getattr(result, "fleet", None) or {}
    levels = fleet.get("levels") or []
    if not levels:
        return ""
    rows = []
    for lv in levels:
        pred = lv.get("predicted") or {}
        for i, r in enumerate(lv["replicas"]):
            rows.append([lv["users"] if i == 0 else "", i, _n(r["running"]), _n(r["waiting"]),
                         _n(r["usage"], "{:.1%}"), _n(r["inflight"]),
                         _n(lv["imbalance"]) if i == 0 else "",
                         (f"{pred.get('imbalance', 0):.1f}, {pred.get('binding', '')} binds" if pred else "—")
                         if i == 0 else ""])
    title = (f"per replica: {fleet['replicas']} replicas behind sglang-router ({fleet['policy']}); one replica's "
             f"limit {fleet['replica_limit']:g}, the fleet's {fleet['fleet_limit']:g}")
    return render_table(["users", "replica", "running", "waiting", "usage gauge", "in flight", "imbalance",
                         "predicted imbalance"], rows, title=title)
