"""An expectation without a YAML file: `kvprobe probe --url URL --engine vllm --prompt-tokens P
--output-tokens O [--model ID] [--model-config config.json]`, the staging command.

Everything a file would say comes from the running engine (`discover`: version, served name,
flags, pool) or from the console: the request shape, and the model's geometry — a preset matching
the served model id (or the loaded model path's last part), or `--model-config`. The load profile
is the shipped `attach` (or `--profile`) with P and O replaced.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from kvprobe.errors import ConfigError
from kvprobe.spec.node import NAME_RE, did_you_mean
from kvprobe.spec.schema import CHECKS, Expectation, Hardware, RequestShape, Target, Tolerances

DEFAULT_PROFILE = "attach"
# Served ids of the same architecture as a preset: an instruction-tuned checkpoint keeps the base
# model's config.json geometry (layers, heads, head size, vocabulary), which is all the ledger reads.
_SAME_GEOMETRY = re.compile(r"-(Instruct|Chat|it)$", re.IGNORECASE)


def preset_for(*names: str | None) -> tuple[str, str] | None:
    """(preset id, the name it matched) for the first of `names` (served id, model path) that is a
    preset: exactly, case-insensitively, by its last path part, or as the instruct variant of one."""
    from kvprobe.theory.model.geometry import PRESETS

    by_lower = {p.lower(): p for p in PRESETS}
    by_base = {p.rsplit("/", 1)[-1].lower(): p for p in PRESETS}
    for name in filter(None, names):
        for candidate in (name, _SAME_GEOMETRY.sub("", name)):
            lower = candidate.rstrip("/").lower()
            found = by_lower.get(lower) or by_base.get(lower.rsplit("/", 1)[-1])
            if found:
                return found, name
    return None


def _name_for(engine: str, served: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"attach-{engine}-{served.rsplit('/', 1)[-1]}").strip("-")[:80]
    return name if NAME_RE.match(name) else f"attach-{engine}"


def attached_expectation(*, url: str, engine: str, facts, prompt_tokens: int, output_tokens: int,
                         model: str | None = None, model_config: str | None = None,
                         version: str | None = None, policy: str | None = None,
                         gpu_memory_bytes: int | None = None, api_key_env: str | None = None,
                         profile: str | None = None, flags: dict | None = None,
                         log=lambda line: None) -> Expectation:
    """The Expectation of a no-YAML probe, from the console's arguments and what the engine said;
    `flags`: the engine's flags declared on the command line (the engine's published values win)."""
    from kvprobe.engines import is_known_version, normalize_version, unknown_version_message
    from kvprobe.observe.discovery import COMMAND_LINE
    from kvprobe.spec.profile import load_profile

    rep = facts.reported
    version = version or (normalize_version(rep.version) if rep.version else None)
    if version is None:
        raise ConfigError(f"expected the engine at {url} to publish its version, or --engine-version "
                          f"(errors reading it: {'; '.join(facts.errors) or 'none'})", key="--engine-version")
    if policy is None and not is_known_version(engine, version):
        raise ConfigError(f"expected {unknown_version_message(engine, version, policy_hint='--policy')}",
                          key="--engine-version")
    served = model or rep.served_model_name
    if served is None:
        raise ConfigError(f"expected the engine at {url} to publish its model (/v1/models), or --model ID",
                          key="--model")
    theory_model, config = _geometry(served, rep.model_path, model_config, log)
    base = load_profile(profile or DEFAULT_PROFILE, search_dirs=[Path.cwd() / "loadprofiles"])
    shape = dataclasses.replace(base.request, prompt_tokens=prompt_tokens, output_tokens=output_tokens)
    if prompt_tokens < 1 or output_tokens < 1:
        raise ConfigError("expected --prompt-tokens and --output-tokens >= 1", key="--prompt-tokens")
    return Expectation(
        name=_name_for(engine, served), path=COMMAND_LINE, engine=engine, version=version,
        model=theory_model, model_base_dir=str(Path.cwd()), served_model_name=served, flags=dict(flags or {}),
        hardware=Hardware(gpu_memory_bytes), target=Target("url", url=url.rstrip("/"), api_key_env=api_key_env),
        profile=dataclasses.replace(base, request=RequestShape(**dataclasses.asdict(shape))),
        tolerances=Tolerances(), checks=CHECKS, model_config=config, policy=policy,
        description=f"attached to {url}")


def _geometry(served: str, model_path: str | None, model_config: str | None, log) -> tuple[str, str | None]:
    """(model for the theory, config.json path or None): --model-config, else a matching preset."""
    if model_config is not None:
        path = Path(model_config).expanduser()
        if not (path.is_file() or (path / "config.json").is_file()):
            raise ConfigError(f"expected a config.json or a directory holding one, got {model_config!r}",
                              key="--model-config")
        return served, str(path.resolve())
    match = preset_for(served, model_path)
    if match is None:
        from kvprobe.theory.model.geometry import PRESETS

        raise ConfigError(f"expected a served model kvprobe has a preset for ({', '.join(sorted(PRESETS))})"
                          f"{did_you_mean(served, PRESETS)}, or --model-config path/to/config.json: the engine "
                          f"serves {served!r}" + (f" from {model_path!r}" if model_path else ""), key="--model-config")
    preset, matched = match
    if matched != preset:
        log(f"kvprobe: model geometry: preset {preset} (matches {matched!r})")
    return preset, None
