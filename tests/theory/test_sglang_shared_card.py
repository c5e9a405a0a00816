"""SGLang on a shared card and --disable-piecewise-cuda-graph, release by release: the defaults come from the
card's total (server_args.py `_handle_gpu_memory_settings(get_device_memory_capacity())`), the pool from the
free memory at start (`profile_max_num_token`), and the flag drops the prefill-graph reserve only in the
releases that have it (memory_profile.py `_PIECEWISE_FLAG`)."""

from __future__ import annotations

import pytest

from kvprobe.cli.main import main
from kvprobe.errors import ConfigError
from kvprobe.theory.ledger.build import build_ledger
from kvprobe.theory.ledger.inputs import LedgerInputs
from kvprobe.theory.model.sizes import GIB, MIB

QWEN = "Qwen/Qwen3-8B"
NVL = 95830 * MIB  # nvidia-smi's memory.total of an H100 NVL


def budget(version="0.5.10.post1", total=NVL, **kw):
    return build_ledger(LedgerInputs(engine="sglang", model=QWEN, engine_version=version, gpu_memory_bytes=total,
                                     **kw)).budget


@pytest.mark.parametrize("version", ["0.5.10", "0.5.10.post1", "0.5.13", "0.5.14", "0.5.19"])
def test_the_flag_drops_the_prefill_graph_reserve_where_the_release_has_it(version):
    on, off = budget(version), budget(version, disable_piecewise_cuda_graph=True)
    # 8192-token graphs: 58 capture sizes x 8 MiB (0.5.10.post1's logged piecewise_cuda_graph_tokens)
    assert on.reserved_mib - off.reserved_mib == 58 * 8
    assert (on.fraction, off.fraction) == (0.855, 0.86)  # the H100 NVL case's logged 0.86
    assert on.chunked_prefill_size == off.chunked_prefill_size == 8192


@pytest.mark.parametrize("version", ["0.5.3", "0.5.4.post1", "0.5.9", "0.5.20", "0.5.22", "0.5.23", None])
def test_a_release_without_the_flag_refuses_it_naming_the_key(version):
    with pytest.raises(ConfigError) as err:
        budget(version, disable_piecewise_cuda_graph=True)
    assert err.value.key == "disable_piecewise_cuda_graph" and "0.5.10-0.5.19" in str(err.value)


def test_a_given_fraction_still_checks_the_flags_release():
    with pytest.raises(ConfigError):
        budget("0.5.9", mem_fraction_static=0.8, disable_piecewise_cuda_graph=True)
    assert budget("0.5.18", mem_fraction_static=0.8, disable_piecewise_cuda_graph=True).fraction == 0.8


def test_the_defaults_come_from_the_total_and_the_pool_from_the_free_memory():
    whole = budget()
    assert budget(gpu_free_memory_bytes=NVL).max_total_num_tokens == whole.max_total_num_tokens
    shared = budget(gpu_free_memory_bytes=int(36.54 * GIB))
    assert (shared.fraction, shared.chunked_prefill_size, shared.reserved_mib) == \
        (whole.fraction, whole.chunked_prefill_size, whole.reserved_mib)
    rest = 36.54 * shared.fraction - shared.weights / GIB  # free x fraction - weights, in SGLang's GiB floats
    assert shared.kv_pool_bytes == int(rest * GIB)
    # the free figure given as the total instead picks a smaller card's defaults: another fraction and chunk
    small = budget(total=int(36.54 * GIB))
    assert (small.fraction, small.chunked_prefill_size) != (shared.fraction, shared.chunked_prefill_size)
    assert shared.estimates == {"other_bytes": NVL - int(36.54 * GIB)}  # what the others hold, shown


@pytest.mark.parametrize("kw,match", [
    ({"gpu_free_memory_bytes": NVL + 1}, "at most the card's total"),
    ({"gpu_free_memory_bytes": 30 * GIB, "estimates": {"other_bytes": GIB}}, "other_bytes"),
    ({"gpu_free_memory_bytes": 30 * GIB, "total": None}, "card's total too"),
])
def test_bad_free_memory_names_the_key(kw, match):
    with pytest.raises(ConfigError) as err:
        budget(**kw)
    assert err.value.key == "gpu_free_memory" and match in str(err.value)


def test_vllm_takes_a_free_memory_only_to_its_start_up_check():
    """vLLM requests total x gpu_memory_utilization; others' memory enters only its start-up check
    (v1/worker/utils.py request_memory, read from 0.18): enough free memory leaves the pool as from the
    total, too little refuses with vLLM's message, and an older release names the key."""
    def ledger(free, version="0.33.0"):
        return build_ledger(LedgerInputs(engine="vllm", model=QWEN, gpu_memory_bytes=80 * GIB, engine_version=version,
                                         gpu_free_memory_bytes=free), explain_refusal=True)
    assert ledger(79 * GIB).budget.kv_pool_bytes == ledger(None).budget.kv_pool_bytes
    assert ledger(79 * GIB).refusal is None
    assert ledger(40 * GIB).refusal == ("ValueError: Free memory on device (40.0/80.0 GiB) on startup is less than "
                                        "desired GPU memory utilization (0.92, 73.6 GiB). Decrease GPU memory "
                                        "utilization or reduce GPU memory used by other processes.")
    with pytest.raises(ConfigError) as err:
        ledger(40 * GIB, version="0.15.1")
    assert err.value.key == "gpu_free_memory" and "start-up check" in str(err.value)


def test_the_cli_takes_both_figures(capsys):
    argv = ["ledger", "--engine", "sglang", "--model", QWEN, "--engine-version", "0.5.10.post1",
            "--gpu-memory", "95830MiB", "--gpu-free-memory", "36.54GiB", "--disable-piecewise-cuda-graph"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "free at start" in out and "36.54 GiB" in out and "0.86" in out and "free x fraction" in out


@pytest.mark.parametrize("extra,match", [
    (["--gpu-free-memory", "36"], "--gpu-free-memory: '36' has no unit"),
    (["--gpu-free-memory", "100GiB"], "--gpu-free-memory: a free memory at most the card's total"),
])
def test_the_cli_names_the_option(capsys, extra, match):
    rc = main(["ledger", "--engine", "sglang", "--model", QWEN, "--gpu-memory", "95830MiB", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and match in err, err


def test_the_cli_wants_the_total_with_a_free_memory(capsys):
    assert main(["ledger", "--engine", "sglang", "--model", QWEN, "--gpu-free-memory", "36GiB"]) == 2
    assert "--gpu-free-memory: the card's total too" in capsys.readouterr().err


def test_an_expectation_says_it_as_hardware_gpu_free_memory(tmp_path):
    import yaml

    from kvprobe.spec.expectation import load_expectations
    from kvprobe.spec.flags import ledger_kwargs

    profile = {"name": "short", "request": {"prompt_tokens": 128, "output_tokens": 32, "stream": True},
               "ramp": {"strategy": "explicit", "levels": [4, 8]}, "hold": {"seconds": 3, "warmup": 0.3},
               "sampling": {"interval": 0.1}, "budget_seconds": 100, "drain_seconds": 10}
    exp = {"name": "shared", "engine": "sglang", "version": "0.5.10.post1", "model": QWEN,
           "flags": {"disable-piecewise-cuda-graph": True},
           "hardware": {"gpu_memory": "95830MiB", "gpu_free_memory": "36.54GiB", "count": 1},
           "target": {"url": "http://127.0.0.1:1"}, "profile": "short"}
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "short.yaml").write_text(yaml.safe_dump(profile))
    (tmp_path / "e.yaml").write_text(yaml.safe_dump(exp))
    (loaded,) = load_expectations(tmp_path / "e.yaml", profile_dirs=[tmp_path / "profiles"])
    free = loaded.hardware.gpu_free_memory_bytes
    assert abs(free - 36.54 * GIB) < 1
    led = build_ledger(LedgerInputs(**ledger_kwargs(loaded)))
    assert led.budget.fraction == 0.86 and led.budget.estimates == {"other_bytes": NVL - free}


@pytest.mark.parametrize("version,dropped_mib", [
    ("0.5.9", 0), ("0.5.10.post1", 0), ("0.5.13", 0),  # the decode reserve whatever the flag
    ("0.5.14", 58 * 8),  # both backends "disabled": the prefill reserve goes, the decode one stays
    ("0.5.15", 58 * 8 + 256 * 2), ("0.5.19", 58 * 8 + 256 * 2), ("0.5.22", 58 * 8 + 256 * 2),
    (None, 58 * 8 + 256 * 2),  # 0.5.23's formula
])
def test_disable_cuda_graph_drops_the_reserves_of_its_release(version, dropped_mib):
    on, off = budget(version), budget(version, disable_cuda_graph=True)
    assert on.reserved_mib - off.reserved_mib == dropped_mib


def test_the_h100_nvl_log_confirms_0_5_10_keeps_the_decode_reserve():
    """The graphs-off run logged 0.86 with --disable-cuda-graph: dropping the 512 MiB decode reserve too would
    have given 0.865."""
    assert budget(disable_cuda_graph=True, disable_piecewise_cuda_graph=True).fraction == 0.86
    assert round((NVL / MIB - 13440 + 512) / (NVL / MIB), 3) == 0.865
