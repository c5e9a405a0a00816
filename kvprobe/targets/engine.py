"""The command line that starts an expectation's engine: the emulator with its time-model and fault
flags, or the real engine's binary with the model and flags as its dialect writes them."""

from __future__ import annotations


def emulator_args(options: dict) -> list[str]:
    """The emulator's own time-model and fault flags from `target.emulator` in the YAML."""
    args: list[str] = []
    for key, value in sorted((options or {}).items()):
        if key == "faults":
            for fault in value:
                args += ["--fault", str(fault)]
        elif key == "args":
            args += [str(a) for a in value]
        elif value is True:
            args.append(f"--{key.replace('_', '-')}")
        elif value not in (False, None):
            args += [f"--{key.replace('_', '-')}", str(value)]
    return args


def _served_alias(exp) -> str | None:
    """The name the load sends when it is not the model the engine loads."""
    return exp.served_model_name if exp.served_model_name not in (None, exp.model) else None


def emulator_argv(exp, dialect, *, port: int) -> list[str]:
    """The emulator serving `exp.model` as the engine would, under the name the load sends."""
    served = _served_alias(exp)
    flags = {**exp.flags, "served-model-name": served} if served else exp.flags
    extra = emulator_args(exp.target.emulator)
    if exp.engine == "vllm" and exp.hardware.capability:  # the declared card's kernels, as the ledger takes them
        extra += ["--gpu-capability", exp.hardware.capability]
    return dialect.emulator_command(exp.model, flags, host="127.0.0.1", port=port, extra=extra, version=exp.version)


def engine_argv(exp, dialect, *, port: int, command: tuple[str, ...] | None = None) -> list[str]:
    """The real engine: it loads `exp.launched_model` and serves it as `exp.served_name`. A command
    replaces the engine's binary ("vllm serve", "python -m sglang.launch_server"); the model and
    flags follow as the dialect writes them."""
    binary = list(command or exp.target.command or ()) or None
    return dialect.launch_command(exp.launched_model, exp.flags, host="127.0.0.1", port=port, binary=binary,
                                  served_model_name=exp.served_name)
