"""A fleet as one probe target: R replicas (each a launch.Target in its own process group, on a
free port) and the real router in front of them; or an attached router URL with the replicas'
URLs (their /metrics are scraped directly: the router's own /engine_metrics relabels them).

The load goes to the router (`url`); the sampler reads every replica (`replica_urls`); the
engine's facts (pool, limits, version) are one replica's — the replicas are one configuration.
The fleet's prediction is its ledger (kvprobe.theory.ledger.fleet); its per-replica figures and
checks are kvprobe.verdict.fleet's, its report table kvprobe.report.fleet's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from kvprobe.engines import get_dialect
from kvprobe.errors import TargetError
from kvprobe.procgroup import free_port
from kvprobe.targets.engine import emulator_argv
from kvprobe.targets.fleet import router as rt
from kvprobe.targets.fleet.sampler import FleetSampler
from kvprobe.targets.interface import OpenHow
from kvprobe.targets.launch import Target
from kvprobe.theory.ledger.fleet import fleet_ledger
from kvprobe.verdict import fleet as fleet_verdict


class FleetTarget:
    mode = "fleet"
    prompt_format = rt.PROMPT_FORMAT  # the router refuses token-id prompts
    one_engine = False  # the series sums R replicas: one replica's ledger says nothing of its counters

    def __init__(self, *, engine: str, dialect, url: str, replica_urls: list[str], policy: str,
                 replicas: list[Target] | None = None, router: rt.RouterProcess | None = None,
                 headers: dict[str, str] | None = None, facts_target: Target | None = None):
        self.engine = engine
        self._dialect = dialect
        self.url = url.rstrip("/")
        self.replica_urls = [u.rstrip("/") for u in replica_urls]
        self.policy = policy
        self.replicas = list(replicas or [])
        self.router = router
        self._headers = dict(headers or {})
        self._facts_target = facts_target or (self.replicas[0] if self.replicas else None)
        self.stop_report: dict[str, object] = {}

    # ------------------------------------------------------------------ construction

    @classmethod
    def launch(cls, *, engine: str, replicas: int, policy: str, artifacts: Path,
               launch_replica: Callable[[int, Path], Target], startup_timeout: float = rt.STARTUP_TIMEOUT,
               router_binary: str | Path | None = None) -> FleetTarget:
        """`launch_replica(i, log_path)` starts replica i (the probe's own emulator/engine launch);
        the router starts once every replica is healthy. A failure stops what was started."""
        started: list[Target] = []
        router = None
        try:
            for i in range(replicas):
                started.append(launch_replica(i, artifacts / f"replica{i}.log"))
            router = rt.RouterProcess.launch([t.url for t in started], policy=policy, log_path=artifacts / "router.log",
                                             binary=router_binary, startup_timeout=startup_timeout)
        except BaseException:
            for t in started:
                with contextlib.suppress(Exception):
                    t.stop(grace=3.0)
            raise
        return cls(engine=engine, dialect=started[0].dialect, url=router.url, replica_urls=[t.url for t in started],
                   policy=policy, replicas=started, router=router, headers=started[0].headers)

    @classmethod
    def open(cls, exp, how: OpenHow) -> FleetTarget:
        """Launch `target.fleet`'s R emulated replicas and the router, or attach to a running fleet."""
        fleet = exp.target.fleet
        if exp.target.mode == "url":
            return cls.attach(exp.target.url, fleet["replica_urls"], engine=exp.engine, policy=fleet["policy"],
                              api_key_env=exp.target.api_key_env)

        def launch_replica(i: int, log_path: Path) -> Target:
            port = free_port()
            argv = emulator_argv(exp, get_dialect(exp.engine), port=port)
            return Target.launch(argv, engine=exp.engine, port=port, log_path=str(log_path),
                                 startup_timeout=exp.target.startup_timeout, env=exp.target.env or None)

        return cls.launch(engine=exp.engine, replicas=fleet["replicas"], policy=fleet["policy"],
                          artifacts=how.artifacts, launch_replica=launch_replica)

    @classmethod
    def attach(cls, url: str, replica_urls: list[str], *, engine: str, policy: str,
               api_key_env: str | None = None) -> FleetTarget:
        """A running router and its replicas: each replica must answer, and so must the router."""
        first = Target.attach(replica_urls[0], engine=engine, api_key_env=api_key_env)
        for other in replica_urls[1:]:
            Target.attach(other, engine=engine, api_key_env=api_key_env)
        ready, why = rt.readiness(url)
        if not ready:
            raise TargetError(f"router at {url} is not ready: {why}")
        return cls(engine=engine, dialect=first.dialect, url=url, replica_urls=replica_urls, policy=policy,
                   headers=first.headers, facts_target=first)

    # ------------------------------------------------------------------ the Target surface the probe uses

    @property
    def dialect(self):
        return self._dialect

    @property
    def headers(self) -> dict[str, str]:
        return dict(self._headers)

    @property
    def pools(self) -> int:
        """One KV pool per replica: the summed series' pool is R times one replica's."""
        return len(self.replica_urls)

    def facts(self, **kw):
        return self._facts_target.facts(**kw)

    def sampler(self, *, interval: float) -> FleetSampler:
        """Every replica's /metrics on one tick; its `series` is the fleet's sum."""
        return FleetSampler(self.replica_urls, self._dialect.METRICS, interval=interval, headers=self.headers)

    # ------------------------------------------------------------------ the fleet's prediction and checks

    @classmethod
    def ledger(cls, exp, one_engine_ledger):
        """The fleet's ledger: R replicas of one replica's, split by the router's policy."""
        shape = exp.profile.request
        return fleet_ledger(one_engine_ledger, replicas=int(exp.target.fleet["replicas"]),
                            policy=exp.target.fleet["policy"], prompt_tokens=shape.prompt_tokens,
                            output_tokens=shape.output_tokens)

    def analyse(self, pr, pool_units: int | None) -> None:
        fleet_verdict.analyse_replicas(pr, pool_units)

    def checks(self, pr, pool_units: int | None, unit: str) -> dict:
        return fleet_verdict.probe_checks(pr, pool_units, unit)

    def alive(self) -> bool:
        if self.router is not None and not self.router.alive():
            return False
        return all(t.alive() for t in self.replicas)

    def log_tail(self, n: int = 20) -> str:
        parts = []
        if self.router is not None:
            parts.append(f"--- router ({self.router.log_path})\n{self.router.log_tail(n)}")
        for i, t in enumerate(self.replicas):
            if not t.alive():
                parts.append(f"--- replica {i} ({t.log_path}) exited\n{t.log_tail()}")
        return "\n".join(parts)

    def stop(self, grace: float = 10) -> None:
        """The router first (no request reaches a dying replica through it), then every replica."""
        errors = []
        if self.router is not None:
            try:
                self.stop_report["router"] = self.router.stop()
            except Exception as err:  # noqa: BLE001 — every replica must still be stopped
                errors.append(str(err))
        for i, t in enumerate(self.replicas):
            try:
                t.stop(grace=grace)
                self.stop_report[f"replica{i}"] = t.stop_report
            except Exception as err:  # noqa: BLE001
                errors.append(str(err))
        if errors:
            raise TargetError("; ".join(errors))

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> FleetTarget:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (f"FleetTarget({self.engine!r}, router={self.url!r}, replicas={len(self.replica_urls)}, "
                f"policy={self.policy!r})")
