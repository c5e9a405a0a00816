"""Run-level state of the pytest plugin: which files are expectations, one probe per expectation
shared by its check items, the shared targets, the report header and the end-of-run table."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvprobe.errors import ConfigError, KvprobeError
from kvprobe.pytest_plugin.options import get_option

SKIP_REASON = "kvprobe probe: needs --kvprobe (a live engine or the emulator)"


class CheckFailed(Exception):
    """A check's verdict was FAIL; its report is the ledger-versus-measurement table, not a traceback."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text


def _positive_seconds(value) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise pytest.UsageError(f"kvprobe: --kvprobe-budget / kvprobe_budget: expected seconds > 0, got {value!r}")
    return seconds


class KvprobeSession:
    def __init__(self, config):
        self.config = config
        self.enabled = bool(get_option(config, "kvprobe"))
        root = Path(str(config.rootpath))
        paths = get_option(config, "expectations") or ["expectations"]
        self.expectation_paths = [(root / p).resolve() if not Path(p).is_absolute() else Path(p)
                                  for p in map(str, paths)]
        self.artifacts = Path(get_option(config, "artifacts") or root / "artifacts" / "kvprobe")
        self.url = get_option(config, "url")
        self.engine_command = get_option(config, "engine-command")
        self.budget = _positive_seconds(get_option(config, "budget"))
        self.profile = get_option(config, "profile")
        self.tolerances = get_option(config, "tolerance") or []
        if self.enabled:
            from kvprobe.spec.expectation import tolerance_overrides

            try:  # a bad option is a one-line usage error now, not a failure in every probe later
                tolerance_overrides(self.tolerances)
            except KvprobeError as err:
                raise pytest.UsageError(f"kvprobe: {err}") from None
        self.results: dict[str, object] = {}  # expectation name -> ProbeResult
        self.bad_input: dict[str, ConfigError] = {}  # expectation name -> what the user must fix
        self.targets: dict[tuple, object] = {}  # shared targets of the kvprobe_target fixture

    # --- collection ---------------------------------------------------------------------------

    def extend_args(self) -> None:
        """Without explicit paths, collect the expectation folders: with --kvprobe only them (the
        probes, not the project's unit tests under `testpaths`), without it beside the tests (their
        items are then collected and skipped). Explicit paths are collected as given."""
        if self.config.args_source == pytest.Config.ArgsSource.ARGS:
            return
        found = [str(p) for p in self.expectation_paths if p.exists()]
        if self.enabled and found:
            self.config.args[:] = found
            return
        for path in found:
            if path not in self.config.args:
                self.config.args.append(path)

    def is_expectation_file(self, path: Path) -> bool:
        path = Path(path).resolve()
        explicit = {Path(a).resolve() for a in self.config.args if a.endswith((".yaml", ".yml"))}
        return path in explicit or any(path == p or p in path.parents for p in self.expectation_paths)

    # --- probes -------------------------------------------------------------------------------

    def options(self, exp):
        from kvprobe.probe.run import ProbeOptions
        from kvprobe.spec.expectation import tolerance_overrides
        from kvprobe.spec.launch import split_command

        tw = self.config.get_terminal_writer() if hasattr(self.config, "get_terminal_writer") else None
        return ProbeOptions(
            artifacts_dir=self.artifacts / exp.name,
            url=self.url,
            engine_command=split_command(self.engine_command) if self.engine_command else None,
            tolerances=tolerance_overrides(self.tolerances),
            budget_seconds=self.budget,
            profile=self.profile,
            log=(lambda line: tw.line(line)) if tw else (lambda line: None),
        )

    def result_for(self, exp):
        """Run the expectation's probe once; every check item of it reads the same result. Bad input
        found while it runs (an API key the engine refuses, the other engine) is raised to every item
        of it as that, never as a probe that could not measure."""
        if exp.name in self.bad_input:
            raise self.bad_input[exp.name]
        if exp.name not in self.results:
            from kvprobe.probe.run import run_probe

            try:
                self.results[exp.name] = run_probe(exp, self.options(exp))
            except ConfigError as err:
                self.bad_input[exp.name] = err
                raise
        return self.results[exp.name]

    # --- reporting ----------------------------------------------------------------------------

    def header_lines(self) -> list[str]:
        if not self.enabled:
            return ["kvprobe: probes collected but skipped (enable with --kvprobe)"]
        return [f"kvprobe: artifacts {self.artifacts}; "
                f"target {'attach ' + self.url if self.url else 'launch per expectation'}"]

    def collected_lines(self, items) -> list[str]:
        """One line per expectation collected (after -k and deselection), in collection order."""
        seen: dict[str, str] = {}
        for item in items:
            e = getattr(item, "expectation", None)
            if e is not None and e.name not in seen:
                seen[e.name] = f"kvprobe: {e.name}: engine {e.engine} {e.version}, model {e.model}"
        return list(seen.values())

    def summary_table(self) -> str:
        if not self.results:
            return ""
        from kvprobe.report.console import SUMMARY_HEADERS, summary_row, wrap_last_column
        from kvprobe.tables import render_table

        rows = [summary_row(r) for r in self.results.values()]
        return wrap_last_column(render_table(SUMMARY_HEADERS, rows))

    def close(self) -> None:
        for target in list(self.targets.values()):
            target.stop()
        self.targets.clear()


class ExpectationFile(pytest.File):
    """An expectations YAML file: one item per expectation and check."""

    def collect(self):
        from kvprobe.spec.expectation import load_expectations

        for exp in load_expectations(self.path):
            releases = release_expectations(exp)
            for one in releases:
                checks = list(one.checks)
                if one.expect_fail and one.expect_fail not in checks:
                    checks.append(one.expect_fail)
                for check in checks:
                    yield KvprobeItem.from_parent(self, name=f"{one.name}[{check}]", expectation=one, check=check)
            if exp.expect_change:
                yield ChangeItem.from_parent(self, name=f"{exp.name}[expect_change]", expectation=exp,
                                             releases=releases)

    def repr_failure(self, excinfo):  # a Collector's takes no style: passing one was a TypeError
        if isinstance(excinfo.value, KvprobeError):
            return str(excinfo.value)
        return super().repr_failure(excinfo)


class _ReportedItem(pytest.Item):
    """An item whose failure is a verdict or a bad input: its text, not a traceback."""

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, (CheckFailed, KvprobeError)):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, 0, f"kvprobe {self.name}"


class KvprobeItem(_ReportedItem):
    def __init__(self, *, expectation, check, **kwargs):
        super().__init__(**kwargs)
        self.expectation = expectation
        self.check = check
        self.add_marker(pytest.mark.kvprobe)
        disabled = getattr(expectation, "enabled", True) is False
        if disabled:
            self.add_marker(pytest.mark.skip(reason=f"{expectation.name}: disabled in its file (enabled: false)"))

    def setup(self):
        """The probe runs here, once per expectation. One that could not measure this check (the
        engine unreachable or dead, the client saturated, no metrics, too few deep levels) is a
        pytest *error* — a broken probe — never a failure, which means the engine disagrees."""
        from kvprobe.report.console import verdict_table

        session = self.config._kvprobe
        try:
            result = session.result_for(self.expectation)
        except ConfigError as err:
            pytest.fail(f"kvprobe: bad input: {err}", pytrace=False)
        check = result.check(self.check)
        for key, value in _properties(result, check):
            self.user_properties.append((key, value))
        if result.error or check is None or check.inconclusive:
            why = result.error or (check.reason if check is not None else f"check {self.check} was not run")
            pytest.fail(f"kvprobe could not measure {self.name}: {why}\n{verdict_table(result)}\n"
                        f"{_artifact_lines(result)}", pytrace=False)

    def runtest(self):
        from kvprobe.report.console import verdict_table

        result = self.config._kvprobe.result_for(self.expectation)
        check = result.check(self.check)
        expected_fail = self.expectation.expect_fail == self.check
        ok = not check.passed if expected_fail else check.passed
        if not ok:
            lead = (f"fault expectation: check '{self.check}' should have FAILED but it passed\n"
                    if expected_fail else "")
            raise CheckFailed(f"{lead}{verdict_table(result)}\n{_artifact_lines(result)}")



def release_expectations(exp) -> list:
    """`versions: [A, B]`: the expectation once per release, named `NAME@A` (its own probe and
    artifacts), or `repeat` times in a row (`NAME@A`, `NAME@A#2`); without it, the expectation itself."""
    if not exp.versions:
        return [exp]
    from kvprobe.probe.diff import labels, with_version

    runs = [v for v in exp.versions for _ in range(exp.repeat)]
    return [with_version(exp, v, label) for v, label in zip(runs, labels(runs), strict=True)]


class ChangeItem(_ReportedItem):
    """`expect_change:` of an expectation with `versions:`: each named figure must change between
    consecutive releases (kvprobe.probe.diff, as `kvprobe diff` finds it); the releases' probes are
    the ones their check items share."""

    def __init__(self, *, expectation, releases, **kwargs):
        super().__init__(**kwargs)
        self.expectation = expectation
        self.releases = releases
        self.add_marker(pytest.mark.kvprobe)
        if getattr(expectation, "enabled", True) is False:
            self.add_marker(pytest.mark.skip(reason=f"{expectation.name}: disabled in its file (enabled: false)"))

    def runtest(self):
        from dataclasses import replace

        from kvprobe.probe.diff import release_figures
        from kvprobe.probe.diff_changes import find_changes, find_noise
        from kvprobe.report.diff import change_line, noise_line

        session = self.config._kvprobe
        runs = [one.name.rpartition("@")[2] for one in self.releases]
        try:
            results = [session.result_for(one) for one in self.releases]
        except ConfigError as err:
            pytest.fail(f"kvprobe: bad input: {err}", pytrace=False)
        figures = {run: release_figures(r, session.artifacts / one.name)
                   for run, one, r in zip(runs, self.releases, results, strict=True)}
        tol = replace(self.expectation.tolerances, **session.options(self.expectation).tolerances)
        repeat = self.expectation.repeat
        changes = find_changes(runs, figures, tol, repeat=repeat)
        noise = find_noise(runs, figures, tol, repeat=repeat)
        missing = [k for k in self.expectation.expect_change if k not in {c["key"] for c in changes}]
        if missing:
            seen = "\n".join(f"  {change_line(c)}" for c in changes) or "  none beyond the tolerances"
            spread = "".join(f"\n  noise: {noise_line(n)}" for n in noise)
            raise CheckFailed(f"expected a change of {', '.join(missing)} between {' -> '.join(runs)}; "
                              f"what changed:\n{seen}{spread}")
        for c in changes:
            self.user_properties.append(("kvprobe_change", change_line(c)))
        for n in noise:
            self.user_properties.append(("kvprobe_noise", noise_line(n)))



def _artifact_lines(result) -> str:
    return "artifacts:\n" + "\n".join(f"  {k}: {v}" for k, v in result.artifacts.items()
                                       if not k.endswith("_error") and Path(v).is_file())


def _properties(result, check):
    """JUnit properties: predicted, reported and measured values, so CI dashboards can plot them."""
    props = [("kvprobe_expectation", result.expectation.name), ("kvprobe_passed", result.passed),
             ("kvprobe_probe_status", result.status)]
    if check is not None:
        props += [("kvprobe_check", check.name), ("kvprobe_predicted", check.predicted),
                  ("kvprobe_reported", check.reported), ("kvprobe_measured", check.measured),
                  ("kvprobe_uncertainty", check.uncertainty), ("kvprobe_binding", check.binding),
                  ("kvprobe_measured_limit", check.diagnosis), ("kvprobe_status", check.status),
                  ("kvprobe_reason", check.reason)]
    if result.error:
        props.append(("kvprobe_error", result.error))
    return props
