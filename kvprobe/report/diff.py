"""What `kvprobe diff` prints: one table, a column per release, and the changes between consecutive
releases with the rule that explains each (kvprobe.probe.diff holds the figures and the changes)."""

from __future__ import annotations

from kvprobe.report.console import wrap_line

STATUS = {"passed": "PASS", "failed": "FAIL", "error": "ERROR", "refused": "not run (refused)", None: "—"}


def _num(x, pattern: str = "{:g}") -> str:
    return "—" if x is None else pattern.format(x)


def _pct(x) -> str:
    return "—" if x is None else f"{x:.1%}"


def _rule(r: dict) -> str:
    sched = "" if r["async_scheduling"] is None else (", async" if r["async_scheduling"] else ", sync")
    return f"{r['policy']}{sched}"


def _startup(r: dict) -> str:
    if r["startup"] in ("refused", "did not start"):
        return f"{r['startup']} (below)"
    return r["startup"] or "—"


def _measured(r: dict) -> str:
    if r["rejection_point"] is None:
        return "—"
    return f"{r['rejection_point']:.2f}" + ("" if r["uncertainty"] is None else f" ± {r['uncertainty']:.2f}")


def _predicted(r: dict) -> str:
    """The most the release runs at once and, where a reservation engine's finishes leave slots empty
    until the next admission, the time average the measured plateau is judged against
    (theory.prediction.judged_plateau)."""
    mean = r.get("predicted_mean")
    average = "" if mean is None or r["predicted"] is None or mean == r["predicted"] else f", {mean:.2f} on average"
    return f"{_num(r['predicted'], '{:.2f}')}{average} ({r['predicted_binding'] or '—'} binds)"


def _preemptions(r: dict) -> str:
    return _num(r["preemptions_per_deep_level"], "{:.1f}")


def _preemption_rate(r: dict) -> str:
    """Measured per 1k engine steps, the ledger's unit (its row beneath)."""
    return _num(r.get("preemptions_per_1k_steps"), "{:g}/1k steps")


def _ledger_preemptions(r: dict) -> str:
    if r["ledger_preemption_rate"] is None:
        return "—"
    return f"{r['ledger_preemption_rate']:g}/1k steps at N={r['ledger_preemption_users']}"


def _pool(r: dict) -> str:
    unit = r["pool_unit"]
    return f"{_num(r['pool'], '{:,}')} {unit} (ledger {_num(r['ledger_pool'], '{:,}')})"


def _claim(r: dict) -> str:
    """The pool the engine logged, the requests of this shape it suggests (kvprobe.verdict.claim), and
    the line the ledger says this release logs."""
    c, ledger = r.get("engine_claim"), r.get("ledger_claim_tokens")
    mine = "" if ledger is None else f" (ledger {ledger:,})"
    return "—" if not c else f"{c['tokens']:,} tokens = {c['requests']:g} requests of P+O{mine}"


ROWS = (
    ("startup", _startup),
    ("admission rule (ledger)", _rule),
    ("pool (engine's report)", _pool),
    ("engine's capacity line", _claim),
    ("ledger: admission limit", _predicted),
    ("measured rejection point", _measured),
    ("deep levels", lambda r: ", ".join(map(str, r["deep_levels"])) or "—"),
    ("preemptions per deep level", _preemptions),
    ("preemptions (measured)", _preemption_rate),
    ("ledger: preemptions", _ledger_preemptions),
    ("usage at saturation", lambda r: f"{_pct(r['usage_at_saturation'])} (ledger {_pct(r['predicted_usage'])})"),
    ("binding limit (measured)", lambda r: r["binding"] or "—"),
    ("probe verdict", lambda r: STATUS.get(r["status"], str(r["status"]))),
)


def diff_table(diff, *, title: str) -> str:
    from kvprobe.tables import render_table

    headers = [""] + list(diff.versions)
    rows = [[name] + [cell(diff.results[v]) for v in diff.versions] for name, cell in ROWS]
    return render_table(headers, rows, title=title, align="l" * len(headers))


def change_line(change: dict) -> str:
    # with repeated runs, every run's figure on each side
    sides = change["runs"] if "runs" in change else [[x] for x in change["measured"]]
    a, b = (", ".join(map(_show, side)) for side in sides)
    la, lb = change["ledger"]
    return (f"{change['from']} -> {change['to']}: {change['quantity']} {a} -> {b} "
            f"(ledger {_show(la)} -> {_show(lb)}); {change['explanation']}")


def noise_line(noise: dict) -> str:
    figures = ", ".join(map(_show, noise["measured"]))
    return f"{noise['release']} ({', '.join(noise['runs'])}): {noise['quantity']} {figures}"


def _show(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}"
    return "—" if x is None else str(x)


def render_diff(diff, exp) -> str:
    """The table, the refusals and failed starts below it, the changes, and the verdict."""
    out = [diff_table(diff, title=f"kvprobe diff: {exp.name} ({exp.engine}, {exp.model}) on {len(diff.versions)} runs")]
    for label in diff.versions:
        r = diff.results[label]
        if r["refusal"]:
            out.append(wrap_line(f"{label} {r['startup']}: {r['refusal']}"))
        elif r["status"] == "error":
            out.append(wrap_line(f"{label} could not be measured: {r['reason']}"))
    if diff.noise:
        out.append("noise (one release's own runs, apart beyond the tolerances; a change is called only where every "
                   "run of one release differs from every run of the next):")
        out += [wrap_line(f"  {noise_line(n)}") for n in diff.noise]
    every = " (each seen between every run of one release and every run of the next)" if diff.repeat > 1 else ""
    if diff.changes:
        out.append(f"changes{every}:")
        out += [wrap_line(f"  {change_line(c)}") for c in diff.changes]
    else:
        out.append("changes: none beyond the expectation's tolerances" + every)
    out.append(f"artifacts: {', '.join(diff.results[v]['artifacts'] for v in diff.versions)}")
    return "\n".join(out)


def plot_diff(diff, exp, path) -> None:
    """Per release: the measured rejection point (± its uncertainty) against the ledger's limit, the
    engine's own claim for the shape, and preemptions (SGLang: retractions) per deep level beneath."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(diff.versions)
    rows = [diff.results[v] for v in labels]
    x = list(range(len(labels)))

    def series(key):
        return [float("nan") if r.get(key) is None else r[key] for r in rows]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6.0, 1.4 * len(labels) + 3), 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    top.errorbar(x, series("rejection_point"), yerr=[0.0 if r["uncertainty"] is None else r["uncertainty"]
                                                     for r in rows],
                 fmt="o", color="tab:green", capsize=4, label="measured rejection point")
    top.plot(x, series("predicted"), "s--", color="tab:red", label="ledger (each release's rule)")
    claims = [float("nan") if not r.get("engine_claim") else r["engine_claim"]["requests"] for r in rows]
    top.plot(x, claims, "^:", color="0.5", label="the engine's capacity line / (P+O)")
    top.set_ylabel("concurrent requests")
    top.legend(loc="best", fontsize=8)
    top.set_title(f"kvprobe diff: {exp.name} ({exp.engine})", fontsize=10)
    bottom.bar(x, [0.0 if r["preemptions_per_deep_level"] is None else r["preemptions_per_deep_level"]
                   for r in rows], color="tab:orange")
    bottom.set_ylabel("preemptions\nper deep level", fontsize=8)
    bottom.set_xticks(x, [f"{v}\n{r['policy']}" for v, r in zip(labels, rows, strict=True)], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
