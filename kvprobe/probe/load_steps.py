"""The load steps around a probe's ramp: the sampler and Locust started, the load stopped and the
drain watched. Each reads and fills a `kvprobe.probe.state.ProbeRun`."""

from __future__ import annotations

import time

from kvprobe.analysis import levels as analysis
from kvprobe.load.turns import TURN_WAIT_SECONDS
from kvprobe.probe.state import ProbeRun

# How long a client started idle may wait for its first level: the probe's waits for the machine to
# itself and for the load turn (each bounded by TURN_WAIT_SECONDS), and its request timed alone.
IDLE_LIMIT_SECONDS = 2 * TURN_WAIT_SECONDS + 300.0


def start_client(pr: ProbeRun) -> None:
    """Locust at zero users, before the probe waits for its load turn: its start (a second or two of
    imports, more on a busy machine) is then no part of the turn, which the next probe waits for."""
    from kvprobe.load.runner import LocustRun

    exp, shape = pr.exp, pr.exp.profile.request
    workers = exp.profile.workers
    remote = ({"expect_workers": workers.expect, "bind_host": workers.host, "bind_port": workers.port,
               "workers_wait": workers.wait_seconds} if workers else {})
    pr.load = LocustRun(pr.target.url, model=pr.model, prompt_tokens=shape.prompt_tokens,
                        output_tokens=shape.output_tokens, workdir=pr.artifacts / "locust",
                        api_key_env=exp.target.api_key_env, processes=exp.profile.processes, stream=shape.stream,
                        engine=exp.engine, shared_prefix_tokens=shape.shared_prefix_tokens,
                        time_limit=exp.profile.budget_seconds + 60, idle_limit=IDLE_LIMIT_SECONDS,
                        # a new seed per probe: a long-lived engine must not serve a second probe's
                        # prompts from the first probe's prefix cache
                        seed=int(time.time() * 1000) % 1_000_003,
                        prompt_format=pr.target.prompt_format,
                        # Locust dispatches a level's new users at once (a spawn rate of at least the
                        # step), so their first requests would leave together and fixed-length requests
                        # stay in phase: one cohort, which a report-held gauge (SGLang's usage) reads at
                        # one point of its cycle (the emulated SGLang's 0.42-0.45 at N=11 where spread
                        # phases read 0.48, as the ledger assumes). Real clients' phases spread: each new
                        # user waits up to one request lifetime before its first request (set in
                        # start_load, once a request has been timed).
                        **remote)
    if workers:
        pr.log(f"kvprobe: {exp.name}: waiting up to {workers.wait_seconds:g} s for {workers.expect} Locust worker(s); "
               f"start each on a load host with: {pr.load.worker_command()}  (they send to {pr.target.url})")
    pr.load.start()


def start_load(pr: ProbeRun) -> None:
    """The /metrics sampler, and the idle client's new users spread over a request lifetime."""
    pr.sampler = pr.target.sampler(interval=pr.exp.profile.sample_interval)
    pr.sampler.start()
    pr.load.start_jitter = pr.lifetime or 0.0


# Checks that read the series after the load stops: the sampler watches the drain for them.
DRAIN_CHECKS = ("leak", "replica_leak")


def stop_load(pr: ProbeRun) -> None:
    """Stop Locust and read its client's health over the levels held."""
    pr.t_stop = time.time()
    pr.load.stop()
    # the run's client health over the levels held: the spawn before the first and the stop after
    # the last block Locust's loop for a second or so, which in a short ramp outweighs its levels
    span = (pr.windows[0].t_start, pr.windows[-1].t_end) if pr.windows else ()
    pr.result.client = pr.load.client_health(*span)


def watch_drain(pr: ProbeRun) -> None:
    """Watch the drain when a check needs it, stop the sampler, read the records."""
    if set(DRAIN_CHECKS) & {*pr.exp.checks, pr.exp.expect_fail}:
        # long enough for an engine's idle report (SGLang's 30 s), unless it reads zero sooner
        wait_drained(pr.sampler, seconds=analysis.drain_window(pr.exp.profile.drain_seconds,
                                                               pr.dialect.IDLE_REPORT_SECONDS))
    pr.series = pr.sampler.stop()
    pr.replica_series = getattr(pr.sampler, "replica_series", None)
    pr.sampler = None
    pr.records = pr.load.records()
    for line in pr.load.clock_warnings() if pr.load.expect_workers else ():
        pr.log(f"kvprobe: {pr.exp.name}: warning: {line}")


def wait_drained(sampler, *, seconds: float) -> None:
    """Give the engine `seconds` to return running, waiting and usage to zero (polls, bounded)."""
    end = time.time() + seconds
    while time.time() < end:
        s = sampler.latest()
        if s is not None and s.ok and not (s.running or s.waiting or s.usage):
            # a few more samples, so the series shows the zero holding rather than one reading
            seen = len(sampler.series)
            while len(sampler.series) < seen + 3 and time.time() < end:
                time.sleep(0.05)
            return
        time.sleep(0.1)
