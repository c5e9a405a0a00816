"""What a person reads: the verdict table, the per-level table, the plot, and the artifact files."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from kvprobe.report.claim import probe_figures
from kvprobe.verdict.checks import fmt

STATUS = {"passed": "PASS", "failed": "FAIL", "error": "ERROR"}
# The widest line of a report a person reads (console, report.txt, pytest's failure text): a check's
# reason runs to hundreds of characters, so the last column wraps under itself beyond this.
REPORT_WIDTH = 120
_LAST_COLUMN_MIN = 40  # a table whose other columns leave less keeps this much for the last one


def wrap_last_column(table: str, width: int = REPORT_WIDTH) -> str:
    """A table from kvprobe.tables with its last column (a reason, a note) wrapped under itself, so
    no line passes `width` while the other columns stay aligned: continuation lines are blank up to
    the last column."""
    lines = table.split("\n")
    rule = next((i for i, line in enumerate(lines) if line.startswith("-") and set(line) <= {"-", " "}), None)
    if rule is None or rule == 0:
        return table
    start = lines[rule].rfind(" ") + 1  # where the last column's dashes begin
    room = max(width - start, _LAST_COLUMN_MIN)
    out = lines[:rule] + [lines[rule][:start + room]]
    for line in lines[rule + 1:]:
        if len(line) <= start + room:
            out.append(line)
            continue
        chunks = textwrap.wrap(line[start:], room, break_long_words=False, break_on_hyphens=False) or [line[start:]]
        out.append(line[:start] + chunks[0])
        out += [" " * start + chunk for chunk in chunks[1:]]
    return "\n".join(out)


def wrap_line(text: str, width: int = REPORT_WIDTH) -> str:
    """One long line of a report (a probe error, the measured limit, the verdict) wrapped with a
    hanging indent, so it reads as one statement."""
    return textwrap.fill(text, width, subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)


def verdict_table(result) -> str:
    """ledger | engine | measured | binding | status | reason — one row per check."""
    from kvprobe.tables import render_table

    rows = [[c.name, fmt(c.predicted), fmt(c.reported), _measured(c), c.binding or "", c.status, c.reason]
            for c in result.checks]
    exp = result.expectation
    head = f"{exp.name}: {exp.engine} {exp.version}, {exp.model}"
    if exp.expect_fail:
        head += f" (fault expectation: '{exp.expect_fail}' must fail)"
    table = wrap_last_column(
        render_table(["check", "ledger", "engine", "measured", "binding", "status", "reason"], rows, title=head))
    if result.error:
        table += "\n" + wrap_line(f"probe error: {result.error}")
        if result.log_tail:  # the engine's or Locust's own lines, as they wrote them
            table += "\n--- log (last lines) ---\n" + result.log_tail
    if result.diagnosis is not None:
        table += "\n" + wrap_line(f"measured limit: {result.diagnosis.reason}")
    if (figures := probe_figures(result)) is not None:
        table += "\n" + wrap_line(figures.line())
    if result.ramp and result.ramp.get("levels"):
        table += "\n" + wrap_line(ramp_line(result.ramp))
    if staged := staging_line(result):
        table += "\n" + wrap_line(staged)
    status = result.status
    tail = "" if status == "passed" else f" — {result.status_reason}"
    return f"{table}\n{wrap_line(f'verdict: {STATUS[status]}{tail}')}"


def ramp_line(ramp: dict) -> str:
    """What the ramp cost: seconds and request lifetimes in all and per level, and why it left the
    prediction if it did."""
    levels = ramp["levels"]
    per = ", ".join(_level_cost(x) for x in levels)
    cost = f"{ramp['seconds']:.1f}s"
    if ramp.get("lifetimes"):
        cost += f" = {ramp['lifetimes']:.1f} request lifetimes"
    unit = " (lifetimes)" if ramp.get("lifetimes") else ""
    line = f"ramp: {ramp['strategy']}, {len(levels)} levels in {cost}; per level{unit}: {per}"
    return line + (f"; {ramp['note']}" if ramp.get("note") else "")


def _level_cost(level: dict) -> str:
    """One level's cost on the ramp line: in request lifetimes (seconds without a timed lifetime), and
    whether a lagging load generator held it on (kvprobe.probe.hold.PastBurst)."""
    cost = (f"{level['lifetimes']:.1f}" if level.get("lifetimes") is not None else f"{level['seconds']:.1f}s")
    return f"N={level['users']} {cost}" + (" (held on: the client lagged)" if level.get("held_for_lag") else "")


def staging_line(result) -> str:
    """A replay of a staging run (repro.yaml): does the shadow agree with what staging measured?"""
    cmp = getattr(result, "staging", None)
    if not cmp:
        return ""
    said = {True: "AGREES", False: "DISAGREES", None: "UNDECIDED"}[cmp["agrees"]]
    return f"staging: the shadow {said} with what staging measured — {cmp['reason']}"


def _measured(check) -> str:
    if check.measured is None or check.uncertainty is None:
        return fmt(check.measured)
    return f"{fmt(check.measured)} ± {check.uncertainty:.2f}"


def levels_table(result) -> str:
    """One row per level, every number named: the running figure the verdict uses and where it
    came from, the engine's gauge and the client's count beside it, the gauges' steady means."""
    from kvprobe.tables import render_table

    weights = result.rejection.weights if result.rejection is not None else {}
    rows = []
    for lv in result.levels:
        note = []
        if lv.disagrees:
            note.append(f"client and gauge disagree ({lv.disagreement:+.2f})")
        if lv.too_few_samples:
            note.append("too few samples")
        rows.append([lv.users, f"{lv.running_mean:.2f}", lv.running_source, _num(lv.engine_running_mean),
                     _num(lv.client_running_mean), _num(lv.waiting_mean), _pct(lv.usage_mean),
                     _num(lv.preemptions, "{:g}"), _num(weights.get(lv.users), "{:.2f}"), "; ".join(note)])
    headers = ["users", "running", "from", "engine gauge", "client count", "waiting", "usage gauge",
               "preemptions", "plateau weight", "note"]
    title = "per level: steady-state means after warm-up; running is the figure the verdict uses"
    return wrap_last_column(render_table(headers, rows, title=title))


def load_processes_table(client) -> str:
    """Client health per load process (local or `kvprobe worker`): the one that saturated is named."""
    from kvprobe.tables import render_table

    rows = [[w.worker, w.host or "—", f"{w.cpu:.2f}", f"{w.lag_p99_ms:.1f}", f"{w.lag_worst_ms:.1f}", w.seconds,
             "SATURATED: " + w.reason if w.saturated else w.reason] for w in client.workers]
    return wrap_last_column(render_table(["worker", "host", "cpu (cores)", "loop lag p99 ms", "worst ms", "seconds",
                                          "health"], rows, title=f"load processes: {client.reason}"))


def _pct(x) -> str:
    return "—" if x is None or x != x else f"{x:.1%}"


def _num(x, pattern: str = "{:.2f}") -> str:
    return "—" if x is None or x != x else pattern.format(x)


def summary_row(result) -> list[str]:
    """One line of the end-of-session table shared by the console and the pytest plugin."""
    rp = result.check("rejection_point")
    pred = result.ledger["admission"]["limit"] if result.ledger and result.ledger.get("admission") else None
    binding = result.ledger["admission"]["binding"] if result.ledger and result.ledger.get("admission") else ""
    return [
        result.expectation.name,
        fmt(pred),
        _measured(rp) if rp else fmt(None),
        binding,
        result.diagnosis.limit if result.diagnosis is not None else "—",
        STATUS[result.status],
        "" if result.passed else result.status_reason,
    ]


def closing_line(result, directory) -> str:
    """`artifacts: DIR (file, file, ...)` naming only the files that were written."""
    names = [Path(path).name for key, path in result.artifacts.items()
             if not key.endswith("_error") and Path(path).is_file()]
    return f"artifacts: {directory}  ({', '.join(names) if names else 'none written'})"


SUMMARY_HEADERS = ["expectation", "predicted", "measured", "binding", "measured limit", "verdict", "why"]


def write_artifacts(result, directory: Path, *, series, records, windows) -> dict[str, str]:
    """result.json, metrics.jsonl, requests.jsonl, ramp.png, report.txt; partial results included."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl", "ramp.png"):  # a reused folder must not show an earlier run's files
        (directory / stale).unlink(missing_ok=True)
    paths: dict[str, str] = {}
    if series is not None:
        series.to_jsonl(directory / "metrics.jsonl")
        paths["metrics"] = str(directory / "metrics.jsonl")
    with open(directory / "requests.jsonl", "w") as fh:
        for r in records or []:
            fh.write(json.dumps(_record_dict(r)) + "\n")
    paths["requests"] = str(directory / "requests.jsonl")
    if series is not None and result.ledger:
        try:
            plot(result, series, windows, directory / "ramp.png")
            paths["plot"] = str(directory / "ramp.png")
        except Exception as err:  # noqa: BLE001 — a plot must never hide the verdict
            paths["plot_error"] = f"{type(err).__name__}: {err}"
    for name in ("engine.log", "ledger.txt"):
        if (directory / name).exists():
            paths[name.split(".")[0]] = str(directory / name)
    if getattr(result, "repro", None):
        paths["repro"] = result.repro
    paths["result"] = str(directory / "result.json")
    paths["report"] = str(directory / "report.txt")
    result.artifacts = paths
    (directory / "result.json").write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    text = verdict_table(result) if result.checks or result.error else ""
    if getattr(result, "fleet", None):
        from kvprobe.report.fleet import replica_table

        text = replica_table(result) + "\n\n" + text
    if result.levels:
        text = levels_table(result) + "\n\n" + text
    if result.client is not None and len(getattr(result.client, "workers", ())) > 1:
        text += "\n\n" + load_processes_table(result.client)
    (directory / "report.txt").write_text(text + "\n")
    return paths


def _record_dict(r) -> dict:
    if hasattr(r, "__dataclass_fields__"):
        return {k: getattr(r, k) for k in r.__dataclass_fields__}
    return dict(r)


def plot(result, series, windows, path: Path) -> None:
    """Users, running and waiting against time with the predicted limit; the usage gauge beneath."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    a = series.arrays()
    t0 = a["t"][0] if len(a["t"]) else 0.0
    t = a["t"] - t0
    adm = result.ledger.get("admission") or {}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    if windows:
        xs, ys = [], []
        for w in windows:
            xs += [w.t_start - t0, w.t_end - t0]
            ys += [w.users, w.users]
        top.plot(xs, ys, color="0.6", lw=1.2, ls="--", label="users (closed loop)")
    top.plot(t, a["running"], color="tab:blue", lw=0.8, alpha=0.45, label="running (engine gauge)")
    top.plot(t, a["waiting"], color="tab:orange", lw=0.8, alpha=0.45, label="waiting (engine gauge)")
    for i, lv in enumerate(result.levels):  # the steady-state means the verdict is computed from
        mid = (lv.t_start + lv.t_end) / 2 - t0
        top.plot([mid, lv.t_end - t0], [lv.running_mean] * 2, color="tab:blue", lw=3,
                 label=f"running, steady ({lv.running_source})" if i == 0 else None)
        top.plot([mid, lv.t_end - t0], [lv.waiting_mean] * 2, color="tab:orange", lw=3,
                 label="waiting, steady" if i == 0 else None)
    if adm.get("limit") is not None:
        top.axhline(adm["limit"], color="tab:red", lw=1.2,
                    label=f"predicted limit {adm['limit']:g} ({adm.get('binding')})")
    if adm.get("no_preemption_limit") is not None and adm["no_preemption_limit"] != adm.get("limit"):
        top.axhline(adm["no_preemption_limit"], color="tab:red", lw=0.8, ls=":",
                    label=f"no-preemption {adm['no_preemption_limit']}")
    rp = result.check("rejection_point")
    if rp is not None and rp.measured is not None:
        shown = f"{rp.measured:g}" + ("" if rp.uncertainty is None else f" ± {rp.uncertainty:.2f}")
        top.axhline(rp.measured, color="tab:green", lw=1.0, ls="-.", label=f"measured plateau {shown}")
    top.set_ylabel("requests")
    top.legend(loc="upper left", fontsize=8)
    verdict = STATUS[result.status]
    exp = result.expectation
    top.set_title(f"{exp.name} — {exp.engine} {exp.version} — {verdict}", fontsize=10)
    bottom.plot(t, a["usage"], color="tab:purple", lw=1.2, label="usage gauge")
    if adm.get("usage_at_limit") is not None:
        bottom.axhline(adm["usage_at_limit"], color="tab:red", lw=0.9, ls="--",
                       label=f"predicted at limit {adm['usage_at_limit']:.0%}")
    bottom.set_ylim(0, max(1.05, float(np.nanmax(a["usage"])) + 0.05 if np.isfinite(a["usage"]).any() else 1.05))
    bottom.set_ylabel("KV usage")
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
