"""From staging to a reproduction on a CPU: every attached probe writes `repro.yaml` beside its
result, and a probe of that file on the shadow engine says whether the shadow agrees.

`repro.yaml` is an ordinary expectation: the release the engine reported, the flags it published or
was given (discovery's configuration, kvprobe.observe.discovery), the model geometry the ledger used
(a preset, or its config.json copied beside the file), the pool the engine reported as the flag that
fixes it (vLLM's block override, SGLang's token cap), the request shape and the levels the staging
run measured as an explicit ramp, `target: {launch: shadow}`, and `staging:` — what staging
measured (the plateau with its uncertainty, preemptions, the running figure per level).

`kvprobe probe repro.yaml` replays that admission on the shadow of the release; `compare` puts the
replay's plateau beside staging's (result.json `staging`, one line of the report).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import yaml

from kvprobe.errors import KvprobeError

REPRO_FILE = "repro.yaml"
MODEL_CONFIG_FILE = "repro-model-config.json"
# What a replay judges besides the comparison: admission only (the length limit and the exactness
# of the streams are about request handling, and staging already judged them).
REPLAY_CHECKS = ("rejection_point", "no_preemption", "reported_capacity")
# The shadow's modelled step. Its Locust client reads every streamed chunk on the same two cores as
# the engine, and more than ~1,300 chunks a second outruns it (expectations/shadow-sglang.yaml), so
# the step is long enough that the deepest level's streams stay under that; a staging step above
# MAX_STEP_MS would only make the replay slow.
CHUNKS_PER_SECOND = 1200.0
MIN_STEP_MS, MAX_STEP_MS = 2.0, 40.0
# The budget's share for the shadow's start (vLLM 20-35 s, SGLang 35-60 s on two idle cores; more
# than twice that on busy ones) and its calibration requests; the levels get twice their modelled
# time, as the engine's own Python adds to every step.
SHADOW_STARTUP_SECONDS = 240.0


def after_probe(pr) -> None:
    """The probe's last step before its artifacts are written: an attached probe writes repro.yaml;
    a probe of a repro.yaml compares its plateau with staging's. Never masks the probe's outcome."""
    if pr.exp.staging is not None:
        pr.result.staging = compare(pr.exp, pr.result)
    if not attached(pr):
        return
    try:
        path = write_repro(pr)
    except (KvprobeError, OSError, ValueError) as err:
        pr.log(f"kvprobe: {REPRO_FILE} not written: {err}")
        return
    if path is not None:
        pr.result.repro = str(path)
        pr.log(f"kvprobe: a reproduction on the CPU shadow of {pr.exp.engine} {pr.exp.version}: "
               f"kvprobe probe {path}")


def attached(pr) -> bool:
    """An engine someone else started (a URL), not a fleet: the probes a staging run makes."""
    return bool(pr.options.url or pr.exp.target.url) and not pr.exp.target.fleet and pr.target is not None


def write_repro(pr) -> Path | None:
    """repro.yaml (and the model's config.json when it is not a preset) in the artifacts folder;
    None when the probe measured no level (nothing to replay)."""
    doc = repro_document(pr)
    if doc is None:
        return None
    config = _model_config(pr.exp)
    if config is not None:
        (pr.artifacts / MODEL_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        doc["model_config"] = MODEL_CONFIG_FILE
    path = pr.artifacts / REPRO_FILE
    head = (f"# A reproduction of {pr.exp.name} ({_where(pr)}) on the CPU shadow of {pr.exp.engine} "
            f"{pr.exp.version},\n# written by kvprobe at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}."
            f" Run it: kvprobe probe {REPRO_FILE}\n")
    path.write_text(head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=110))
    return path


def repro_document(pr) -> dict | None:
    """The expectation a replay runs, as plain YAML data."""
    from kvprobe.observe.discovery import reported_pool

    exp, result = pr.exp, pr.result
    levels = sorted({lv.users for lv in result.levels})
    if not levels:
        return None
    flags = {k: v for k, v in exp.flags.items() if k != "served-model-name" and v is not None}
    pool = reported_pool(exp.engine, result.facts.reported) if result.facts is not None else None
    if pool is not None:
        flag, value, others = pool
        for other in others:
            flags.pop(other, None)
        flags[flag] = value
    prof = exp.profile
    req = {"prompt_tokens": prof.request.prompt_tokens, "output_tokens": prof.request.output_tokens,
           "stream": prof.request.stream}
    if prof.request.shared_prefix_tokens:
        req["shared_prefix_tokens"] = prof.request.shared_prefix_tokens
    step_ms = shadow_step_ms(pr, flags)
    lifetime = (prof.request.output_tokens + 1) * step_ms / 1000
    lifetimes = max(prof.hold.lifetimes or 3.0, 2.0)
    budget = SHADOW_STARTUP_SECONDS + len(levels) * lifetimes * lifetime * 2 + prof.drain_seconds
    tol = exp.tolerances
    doc = {
        "name": f"repro-{exp.name}"[:80],
        "description": f"{exp.engine} {exp.version} as staging measured it ({_where(pr)}), replayed on its shadow",
        "engine": exp.engine,
        "version": exp.version,
        "model": exp.model,
    }
    if exp.policy:
        doc["policy"] = exp.policy
    # the card by name where staging named one: the kernels vLLM picks by it move the pool's layout (a Gated
    # DeltaNet layer's checkpoint block on a Hopper, none on an A100); the pool itself is the flag above
    hardware = {"gpu": exp.hardware.name} if exp.hardware.name else {}
    if exp.hardware.gpu_count > 1:
        hardware["count"] = exp.hardware.gpu_count
    if hardware:
        doc["hardware"] = hardware
    doc |= {
        "flags": flags,
        "target": {"launch": "shadow", "time_model": {"step_ms": step_ms, "prefill_us_per_token": 1,
                                                       "decode_us_per_seq": 0}},
        "profile": {"request": req, "ramp": {"strategy": "explicit", "levels": levels},
                    "hold": {"lifetimes": lifetimes, "warmup": prof.hold.warmup},
                    "sampling": {"interval": prof.sample_interval}, "budget_seconds": math.ceil(budget),
                    "drain_seconds": prof.drain_seconds, "processes": prof.processes},
        "tolerances": {"reported_capacity": tol.reported_capacity, "rejection_point": tol.rejection_point,
                       "rejection_point_relative": tol.rejection_point_relative, "usage_gap": tol.usage_gap},
        "checks": [c for c in REPLAY_CHECKS if c in exp.checks] or ["rejection_point"],
        "staging": staging_record(pr),
    }
    return doc


def staging_record(pr) -> dict:
    """What staging measured, for the replay to compare with."""
    from kvprobe.observe.http import redact_url

    rej = pr.result.rejection
    rp = None if rej is None or rej.rejection_point is None else round(float(rej.rejection_point), 3)
    half = None if rej is None or rej.uncertainty is None else round(float(rej.uncertainty), 3)
    record = {"rejection_point": rp, "uncertainty": half, "preemptions": saturated_preemptions(pr.result),
              "running": [{"users": lv.users, "running": round(float(lv.running_mean), 3)}
                          for lv in pr.result.levels if _finite(lv.running_mean)]}
    url = pr.options.url or pr.exp.target.url
    if url:
        record["url"] = redact_url(url)
    record["result"] = str((pr.artifacts / "result.json").resolve())
    return record


def saturated_preemptions(result) -> float | None:
    """Preemptions (SGLang: retractions) counted over the levels where requests waited (every level
    when none did); None when the engine exports no counter."""
    saturated = set(result.rejection.saturated_levels) if result.rejection is not None else set()
    levels = [lv for lv in result.levels if lv.users in saturated] or result.levels
    seen = [lv.preemptions for lv in levels if lv.preemptions is not None]
    return float(sum(seen)) if seen else None


def shadow_step_ms(pr, flags: dict) -> float:
    """The shadow's modelled step: staging's own (one request's lifetime over its O+1 steps), but long
    enough that the most streams staging ran at once stay within what the client reads."""
    out = pr.exp.profile.request.output_tokens
    staging = (pr.lifetime or 0.0) * 1000 / (out + 1)
    streams = max((lv.running_mean for lv in pr.result.levels if _finite(lv.running_mean)), default=1.0)
    interval = flags.get(pr.dialect.STREAM_INTERVAL_FLAG) or 1
    floor = streams * 1000 / (interval * CHUNKS_PER_SECOND)
    return round(min(max(staging, floor, MIN_STEP_MS), MAX_STEP_MS), 2)


def compare(exp, result) -> dict:
    """The replay's plateau beside staging's: agrees within the expectation's rejection-point
    tolerance (True), disagrees even allowing for both uncertainties (False), or cannot say (None)."""
    staged = exp.staging
    rej = result.rejection
    shadow = None if rej is None or rej.rejection_point is None else float(rej.rejection_point)
    shadow_half = None if rej is None or rej.uncertainty is None else float(rej.uncertainty)
    out = {"rejection_point": staged.rejection_point, "uncertainty": staged.uncertainty,
           "shadow_rejection_point": None if shadow is None else round(shadow, 3),
           "shadow_uncertainty": None if shadow_half is None else round(shadow_half, 3),
           "preemptions": staged.preemptions, "shadow_preemptions": saturated_preemptions(result),
           "allowance": None, "agrees": None, "reason": ""}
    if staged.rejection_point is None and shadow is None:
        out["agrees"], out["reason"] = True, "neither staging nor the shadow saturated a level"
        return out
    if staged.rejection_point is None or shadow is None:
        # the same levels: one engine made requests wait where the other admitted them all
        out["agrees"] = False
        out["reason"] = (f"staging saturated no level; the shadow plateaus at {_pm(shadow, shadow_half)}"
                         if shadow is not None else
                         f"the shadow saturated no level; staging measured "
                         f"{_pm(staged.rejection_point, staged.uncertainty)}")
        return out
    starved = [lv.users for lv in result.levels if lv.client_saturated and lv.users in rej.saturated_levels]
    if starved:
        out["reason"] = (f"the shadow plateaus at {_pm(shadow, shadow_half)}, but the load generator was the "
                         f"bottleneck at N={', '.join(map(str, starved))}: not compared (run it again on a quieter "
                         "machine)")
        return out
    tol = exp.tolerances
    allowance = max(tol.rejection_point, tol.rejection_point_relative * abs(staged.rejection_point))
    diff = abs(shadow - staged.rejection_point)
    spread = math.hypot(staged.uncertainty or 0.0, shadow_half or 0.0)
    out["allowance"] = round(allowance, 3)
    shown = (f"the shadow plateaus at {_pm(shadow, shadow_half)}, staging measured "
             f"{_pm(staged.rejection_point, staged.uncertainty)}")
    preempted = _preempted(out["preemptions"]), _preempted(out["shadow_preemptions"])
    if None not in preempted and preempted[0] != preempted[1]:
        out["agrees"] = False
        out["reason"] = (f"{shown}, but " + ("only staging" if preempted[0] else "only the shadow")
                         + f" preempted (staging {out['preemptions']:g}, shadow {out['shadow_preemptions']:g})")
    elif diff <= allowance + 1e-9:
        out["agrees"] = True
        out["reason"] = f"{shown}: within ±{allowance:.2g}"
    elif diff - spread > allowance + 1e-9:
        out["agrees"] = False
        out["reason"] = f"{shown}: {diff:.2f} apart, outside ±{allowance:.2g} even allowing for both uncertainties"
    else:
        out["reason"] = f"{shown}: {diff:.2f} apart, and the uncertainties straddle ±{allowance:.2g}"
    return out


def _preempted(count: float | None) -> bool | None:
    return None if count is None else count > 0


def _pm(value: float, half: float | None) -> str:
    return f"{value:.2f}" + ("" if half is None else f" ± {half:.2f}")


def _finite(x) -> bool:
    return x is not None and math.isfinite(x)


def _where(pr) -> str:
    from kvprobe.observe.http import redact_url

    url = pr.options.url or pr.exp.target.url
    return f"attached at {redact_url(url)}" if url else "attached"


def _model_config(exp) -> dict | None:
    """The config.json the ledger read, when `model` is not a packaged preset (copied, so the file
    reproduces anywhere)."""
    from kvprobe.theory.model.geometry import PRESETS
    from kvprobe.theory.model.presets import load_model_config

    if exp.model_config is None and exp.model in PRESETS:
        return None
    config, _ = load_model_config(exp.model_config or exp.model, base_dir=exp.model_base_dir)
    return config
