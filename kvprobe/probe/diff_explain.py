"""Which release rule explains a change `kvprobe diff` found (`kvprobe.probe.diff_changes.find_changes`): the
refusal the ledger gave where one release refuses to start, the admission policy the ledger applied
on each side, and the memory rules it sized the pool by. A pool
is named by the memory rules alone (an admission policy moves no pool); a figure that moved with the
ledger's pool names those rules beside the policy, where that changed too.
"""

from __future__ import annotations

from kvprobe.theory.ledger.rules import ADMISSION_ASPECTS, BLOCK_SIZE, CAPACITY_LINE_ASPECTS


def explanation(ra: dict, rb: dict, key: str = "rejection_point", tol=None) -> str:
    """The rules that explain a change: the memory rules for the pool (an admission policy moves no
    pool), the rules behind the engine's capacity line for that line, and for the rest the admission
    policy and, where the ledger's pool moved too, the memory rules beside it."""
    if key == "startup" and (refused := startup_explanation(ra, rb)):
        return "explained: " + refused
    parts = []
    if key == "pool" or _ledger_pool_moved(ra, rb, tol):
        parts.append(memory_explanation(ra, rb))
    parts += differing_rules(ra, rb, CAPACITY_LINE_ASPECTS + (BLOCK_SIZE,) if key == "capacity_line"
                             else ADMISSION_ASPECTS)
    if key not in ("pool", "capacity_line") and ra["policy"] != rb["policy"]:  # admission moves neither
        parts.append(f"{ra['policy']} -> {rb['policy']}, {rb['rule']}")
    if key not in ("pool", "capacity_line") and ra.get("scheduler_loop") and rb.get("scheduler_loop") \
            and ra["scheduler_loop"] != rb["scheduler_loop"]:  # SGLang's loop rules (theory/sglang/releases.py)
        parts.append(f"scheduler loop: {rb['scheduler_loop']}")
    parts = [p for p in parts if p]
    if parts:
        return "explained: " + "; and ".join(parts)
    return (f"explained: the ledger predicts it from each release's own figures (admission rule {ra['policy']} on "
            "both)")


def differing_rules(ra: dict, rb: dict, aspects: tuple[str, ...]) -> list[str]:
    """The release rules of `aspects` that differ between the two releases, as the ledger applied them on
    the second: those behind the engine's capacity line (theory/ledger/rules.py CAPACITY_LINE_ASPECTS), or
    those that move admission under one policy (ADMISSION_ASPECTS: a window group's charge and blocks in
    flight, the hybrid pool's free order and retention, the block size a release takes)."""
    a, b = ra.get("release_rules") or {}, rb.get("release_rules") or {}
    return [f"{aspect}: {b[aspect]}" for aspect in aspects if b.get(aspect) is not None and a.get(aspect) != b[aspect]]


def startup_explanation(ra: dict, rb: dict) -> str | None:
    """A start-up that changed is explained by the refusal the ledger gave for the release that
    refuses (a flag its command line lacks, a pool too small, a free-memory check): the reason, not
    the admission policy, which may be the same on both sides."""
    refusing = [r for r in (ra, rb) if r.get("ledger_startup") == "refused" and r.get("refusal")]
    if len(refusing) != 1:
        return None
    r = refusing[0]
    other = rb if r is ra else ra
    return f"{r['version']} refuses where {other['version']} starts: {r['refusal']}"


def _ledger_pool_moved(ra: dict, rb: dict, tol) -> bool:
    la, lb = ra.get("ledger_pool"), rb.get("ledger_pool")
    if la is None or lb is None or la == lb:
        return False
    allowance = 0.0 if tol is None else tol.reported_capacity * max(abs(la), abs(lb))
    return abs(lb - la) > allowance + 1e-9


def memory_explanation(ra: dict, rb: dict) -> str | None:
    """The memory rules on each side and the figures of theirs that moved, as the ledger applied
    them; None when the same rules set the same figures (the pool then moved for another reason)."""
    ma, mb = ra.get("memory") or {}, rb.get("memory") or {}
    moved = [f"{name} {ma.get(key)} -> {mb.get(key)}" for key, name in MEMORY_FIGURES
             if ma.get(key) is not None and mb.get(key) is not None and ma.get(key) != mb.get(key)]
    name_a, name_b = _rules_name(ma), _rules_name(mb)
    if name_a == name_b and not moved:
        return None
    text = f"memory rules {name_a} -> {name_b}" if name_a != name_b else f"memory rules {name_b}"
    if mb.get("change") and name_a != name_b:
        text += f", {mb['change']}"
    if moved:
        text += f" (the ledger's {', '.join(moved)})"
    return text


def _rules_name(memory: dict) -> str | None:
    """A release's memory rules by name: "SGLang 0.5.20 rules (read 0.5.20 to 0.5.21)", else how the
    fraction was found (0.5.23's formula carries no rules name)."""
    rules = memory.get("rules")
    return rules.split(": ")[0] if rules else memory.get("fraction_source")


# The ledger's budget figures a release's memory rules set (SGLang's default fraction and the GPU-tier
# defaults it is computed from), as the diff names a pool change with them.
MEMORY_FIGURES = (("fraction", "mem_fraction_static"), ("chunked_prefill_size", "chunked prefill"),
                  ("cuda_graph_max_bs", "cuda-graph bs"))


def memory_figures(budget: dict | None) -> dict | None:
    """The memory rules the ledger sized the pool by (the release's rules, what their first release
    changed, how the fraction was found) and the figures they set; None without a budget."""
    if not budget:
        return None
    out = {"rules": budget.get("rules"), "change": budget.get("rules_change"),
           "fraction_source": budget.get("fraction_source")}
    out.update({key: budget.get(key) for key, _ in MEMORY_FIGURES})
    return out
