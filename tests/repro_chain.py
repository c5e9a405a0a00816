"""From staging to a reproduction on a CPU, end to end (kvprobe.probe.repro): a staging probe of
kvprobe's emulator, attached by URL, writes repro.yaml; that file runs on a shadow server which is
itself attached as a staging engine, so the same probe replays the emulator's run and writes a
second repro.yaml; the second file runs as written (`target: {launch: shadow}`). Three probes show
both staging kinds reproduced on the shadow, with one shadow start per file."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from kvprobe.engines import get_dialect
from kvprobe.probe.run import ProbeOptions, run_probe
from kvprobe.procgroup import free_port
from kvprobe.spec.expectation import load_expectations
from kvprobe.targets.launch import Target


@dataclass
class Chain:
    emulator: object  # ProbeResult: staging on the emulator
    shadow: object  # ... repro A replayed on an attached shadow (itself staging for repro B)
    replay: object  # ... repro B run as written
    repro_a: object  # Expectation
    repro_b: object


def with_levels(exp, levels: tuple[int, ...], lifetimes: float):
    """`exp` with an explicit ramp of `levels`, each held `lifetimes` request lifetimes."""
    prof = exp.profile
    return replace(exp, profile=replace(prof, ramp=replace(prof.ramp, strategy="explicit", levels=levels),
                                        hold=replace(prof.hold, seconds=None, lifetimes=lifetimes)))


def run_chain(exp, tmp_path: Path, *, step_ms: float, start_shadow, stop_shadow, log) -> Chain:
    """`start_shadow(exp, log_path)` -> a server with `.url`; `stop_shadow(server)` stops its group."""
    port = free_port()
    argv = get_dialect(exp.engine).emulator_command(exp.model, exp.flags, host="127.0.0.1", port=port,
                                                    extra=["--step-ms", str(step_ms)])
    emulator = Target.launch(argv, engine=exp.engine, port=port, log_path=str(tmp_path / "emulator.log"),
                             startup_timeout=60)
    try:
        first = run_probe(exp, ProbeOptions(artifacts_dir=tmp_path / "staging-emulator", url=emulator.url, log=log))
    finally:
        emulator.stop()
    assert first.repro, f"no repro.yaml from staging on the emulator: {first.status_reason}"
    (repro_a,) = load_expectations(first.repro)
    server = start_shadow(repro_a, tmp_path / "shadow.log")
    try:
        second = run_probe(repro_a, ProbeOptions(artifacts_dir=tmp_path / "staging-shadow", url=server.url, log=log))
    finally:
        stop_shadow(server)
    assert second.repro, f"no repro.yaml from staging on the shadow: {second.status_reason}"
    (repro_b,) = load_expectations(second.repro)
    third = run_probe(repro_b, ProbeOptions(artifacts_dir=tmp_path / "replay", log=log))
    return Chain(first, second, third, repro_a, repro_b)


def figures(chain: Chain) -> str:
    def plateau(result) -> str:
        rej = result.rejection
        if rej is None or rej.rejection_point is None:
            return "no plateau"
        return f"{rej.rejection_point:.2f} ± {rej.uncertainty or 0:.2f}"

    return (f"staging on the emulator {plateau(chain.emulator)}; its repro on an attached shadow "
            f"{plateau(chain.shadow)} ({chain.shadow.staging['agrees']}); that shadow's repro launched "
            f"{plateau(chain.replay)} ({chain.replay.staging['agrees']})")
