"""SGLang's memory budget, release by release: the default `mem_fraction_static`, the GPU-size defaults
it depends on, and how the KV pool is profiled from it, in each release kvprobe has read.

Every read release profiles the pool the same way (model_executor/model_runner.py
`profile_max_num_token`): SGLang takes F, the free memory after CUDA/NCCL initialisation (the
`Load weight begin. avail mem=` line; the minimum over the TP ranks), loads the weights, and keeps

    rest = free after loading - F x (1 - mem_fraction_static);   tokens = int(rest x 2**30 // cell)

(`cell` = the KV bytes of one token on one rank), rounded down to the page size. What moved
between releases is the default fraction (server_args.py `__post_init__`, later
arg_groups/memory_hook.py) and the GPU-size tiers of chunked_prefill_size and cuda_graph_max_bs:
a table on the parallel size (0.4.1.post7-0.4.7), reserved GiB by GPU tier (0.4.8-0.5.2), then a
reserve computed from chunked_prefill_size and the cuda graphs (0.5.3 on), whose terms
`kvprobe.theory.sglang.budget.sglang_reserved_mib` holds and each release's rules parametrise.
Each rule names the release it was read in and the engine file; docs/ledger.md has the table. A
version takes the rule of the newest read release at or below it, up to the newest release that
rule was checked against (`until`); a version outside every range is refused naming the nearest
read release.

0.5.23 keeps the reserved-memory formula of `kvprobe.theory.sglang.budget` as written (`legacy=True`),
on which the shadow targets and expectations rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvprobe.errors import ConfigError
from kvprobe.releases import normalize_version

_GIB_MIB = 1024


@dataclass(frozen=True)
class SglangMemoryRules:
    """What one SGLang release defaults when it sizes the KV pool."""

    release: str  # the release these rules were read in
    until: str  # the newest release checked to carry the same rules
    # the default-fraction formula: "tp-table" | "tp-table-13g" | "parallel-table" | "reserved-tiers" |
    # "reserved-formula"
    fraction: str
    small_gpu_mib: int  # below this total memory: chunked_prefill_size 2048 and the small cuda-graph batch
    large_gpu_mib: int | None  # from this total memory up: chunked_prefill_size 16384 (None: no such tier)
    no_gpu_chunked: int = 8192  # chunked_prefill_size when the GPU memory is unknown
    legacy: bool = False  # 0.5.23: kvprobe.theory.sglang.budget's reserved-memory formula, as written
    # "reserved-formula" (0.5.3 on): the 20-35 GiB tier (chunked_prefill_size, cuda_graph_max_bs at tp < 4, at
    # tp >= 4), whether the prefill (piecewise) cuda graphs are on by default and so reserved, whether a
    # --max-running-requests caps a defaulted decode max_bs, and the fraction without a GPU. (The MLA prefill
    # graphs' token cap, 2048 until 0.5.22, moves no reserve: MLA reserves a flat 1.5 GiB for them.)
    mid_tier: tuple[int, int, int] = (2048, 16, 80)
    prefill_graphs: bool = False
    clamp_max_bs: bool = False
    # --disable-piecewise-cuda-graph exists and drops the prefill-graph reserve (0.5.10-0.5.19; absent before
    # 0.5.10 and from 0.5.20, where argparse rejects it)
    piecewise_flag: bool = False
    no_gpu_fraction: float = 0.88
    sources: tuple[str, ...] = ()
    # what this release changed in the budget from the rules before it, in the words a diff between two
    # releases names the change with (`kvprobe diff`, via the ledger's budget `rules_change`)
    change: str = ""

    def covers(self, version: str) -> bool:
        return release_key(self.release) <= release_key(version) <= release_key(self.until)

    def describe(self) -> str:
        return f"SGLang {self.release} rules (read {self.release} to {self.until}): default fraction {self.fraction}"

    def gpu_defaults(self, gpu_mem_mib: int | None, tp: int) -> tuple[int, int]:
        """(chunked_prefill_size, cuda_graph_max_bs) by the GPU's total memory in MiB (nvidia-smi's
        `memory.total`, server_args.py `get_gpu_memory_capacity`)."""
        if gpu_mem_mib is None:
            return self.no_gpu_chunked, 160
        if self.fraction == "reserved-formula":
            return _formula_tier(gpu_mem_mib, tp, self.mid_tier)
        if gpu_mem_mib < self.small_gpu_mib:
            return 2048, 8 if tp < 4 else 80
        if self.large_gpu_mib is not None and gpu_mem_mib >= self.large_gpu_mib:
            return 16384, 160
        return 8192, 160

    def default_fraction(self, gpu_mem_mib: int | None, *, tp: int = 1, pp: int = 1) -> float:
        """mem_fraction_static when the flag is not given (no speculative decoding, no DP attention)."""
        if self.legacy or self.fraction == "reserved-formula":
            raise ConfigError(f"SGLang {self.release}'s fraction is budget.sglang_default_mem_fraction_static "
                              "(a reserve from chunked_prefill_size and the cuda graphs)")
        size = tp if self.fraction in ("tp-table", "tp-table-13g") else tp * pp
        table = 0.79 if size >= 16 else 0.81 if size >= 8 else 0.85 if size >= 4 else 0.87 if size >= 2 else 0.88
        if self.fraction == "tp-table":
            return table
        if self.fraction == "tp-table-13g":
            if gpu_mem_mib is not None and gpu_mem_mib > 81920:
                return (gpu_mem_mib - 13 * _GIB_MIB) / gpu_mem_mib
            return table
        if self.fraction == "parallel-table":
            if gpu_mem_mib is None:
                return table
            base = table if gpu_mem_mib <= 81920 else 0.88
            if gpu_mem_mib > 180 * 1000:
                return 0.79
            if gpu_mem_mib > 96 * _GIB_MIB:
                return min(base + 48 * _GIB_MIB * (1 - base) / gpu_mem_mib, (gpu_mem_mib - 18 * _GIB_MIB) / gpu_mem_mib)
            return base
        if gpu_mem_mib is None:  # reserved-tiers
            return 0.88
        if gpu_mem_mib < 35 * _GIB_MIB:
            reserved = (2.8 + size / 10) * _GIB_MIB
        elif gpu_mem_mib < 90 * _GIB_MIB:
            reserved = (9.5 + size / 2) * _GIB_MIB
        elif gpu_mem_mib < 160 * _GIB_MIB:
            reserved = (12 + size / 2) * _GIB_MIB
        else:
            reserved = 32 * _GIB_MIB
        return round((gpu_mem_mib - reserved) / gpu_mem_mib, 3)


_PROFILE = ("model_executor/model_runner.py profile_max_num_token: rest = available after loading - "
            "total_gpu_memory x (1 - mem_fraction_static), total_gpu_memory = the minimum free memory over the "
            "ranks after init_torch_distributed; int(rest x (1 << 30) // cell_size)")

_FORMULA = ("server_args.py _handle_gpu_memory_settings ({rel}): reserved = 512 MiB + max(chunked_prefill_size, "
            "2048) x 1.5 + cuda_graph_max_bs x 2 + tp x pp / 8 GiB, at least 10 GiB above 60 GiB; "
            "round((gpu_mem - reserved) / gpu_mem, 3), 0.88 without a GPU")
_TIERS = ("chunked_prefill_size / cuda_graph_max_bs by gpu_mem: below 20 GiB 2048 / 8; below 35 GiB {mid}; "
          "below 60 GiB 4096 / 32 or 160; below 160 GiB 8192 / 256 or 512; else 16384 / 512; 4096 / 160 without a GPU")

# --disable-piecewise-cuda-graph, read in 0.5.2, 0.5.3, 0.5.4, 0.5.4.post1 and every release 0.5.9-0.5.23:
# 0.5.3-0.5.9 have no such flag (0.5.4 server_args.py L2976 and 0.5.9 L4606 have the opt-in
# --enable-piecewise-cuda-graph; 0.5.2 neither). 0.5.10-0.5.13 guard the 8 MiB-per-size reserve with
# `if not self.disable_piecewise_cuda_graph:` (server_args.py _handle_gpu_memory_settings: 0.5.10 and
# 0.5.10.post1 L1305, 0.5.11 L1458, 0.5.12 L1565, 0.5.13 L1616). 0.5.14-0.5.19 map the flag to
# cuda_graph_backend_prefill "disabled" (DeprecatedStoreConstAction: 0.5.14 server_args.py L6390, 0.5.19
# L3960) and reserve only `if prefill_cuda_graph_config.backend != Backend.DISABLED` (0.5.14 L3300, 0.5.15
# L3663, 0.5.18 reserve_for_graph_mb L5101, 0.5.19 arg_groups/memory_hook.py L317). 0.5.20-0.5.23 no longer
# have it (no "disable-piecewise-cuda-graph" anywhere in the 0.5.20 wheel, nor in 0.5.21-0.5.23's arg_groups).
_PIECEWISE_FLAG = ("server_args.py _handle_gpu_memory_settings (0.5.10-0.5.19): --disable-piecewise-cuda-graph "
                   "drops the prefill-graph reserve (0.5.10.post1 L1305 `if not self.disable_piecewise_cuda_graph`; "
                   "0.5.14-0.5.19 via cuda_graph_backend_prefill 'disabled'); the flag is absent before 0.5.10 "
                   "and from 0.5.20")

RULES: tuple[SglangMemoryRules, ...] = (
    SglangMemoryRules(
        "0.4.1.post7", "0.4.5", "tp-table", small_gpu_mib=25_000, large_gpu_mib=None,
        sources=("server_args.py __post_init__ (0.4.1.post7; the same lines in 0.4.2.x, 0.4.3.x, 0.4.4, 0.4.5): "
                 "0.79 at tp >= 16, 0.81 >= 8, 0.85 >= 4, 0.87 >= 2, else 0.88",
                 "server_args.py: gpu_mem < 25,000 MiB -> chunked_prefill_size 2048 (else 8192), cuda_graph_max_bs "
                 "8 (tp < 4) or 80; else 160", _PROFILE)),
    SglangMemoryRules(
        "0.4.6", "0.4.6", "tp-table-13g", small_gpu_mib=25_000, large_gpu_mib=None,
        change="above 81,920 MiB the fraction is (total - 13 GiB) / total from 0.4.6",
        sources=("server_args.py __post_init__ (0.4.6): the tp table up to 81,920 MiB; above it "
                 "(gpu_mem - 13 GiB) / gpu_mem (0.4.6.post5 already differs: tp x pp and a 96 GiB rule; "
                 "not modelled)", _PROFILE)),
    SglangMemoryRules(
        "0.4.7", "0.4.7", "parallel-table", small_gpu_mib=25_000, large_gpu_mib=180_001,
        change="the fraction table on tp x pp, and the 96 GiB and 180,000 MiB rules, from 0.4.7",
        sources=("server_args.py __post_init__ (0.4.7): the table on tp x pp up to 81,920 MiB (0.88 above); "
                 "> 180,000 MiB: 0.79; > 96 GiB: min(f + 48 GiB x (1 - f) / gpu_mem, (gpu_mem - 18 GiB) / gpu_mem)",
                 "server_args.py: chunked_prefill_size 16384 above 180,000 MiB, 2048 below 25,000 MiB", _PROFILE)),
    SglangMemoryRules(
        "0.4.8", "0.5.2", "reserved-tiers", small_gpu_mib=35 * _GIB_MIB, large_gpu_mib=160 * _GIB_MIB,
        no_gpu_chunked=4096,
        change="the fraction from reserved GiB by GPU tier from 0.4.8",
        sources=("server_args.py __post_init__ (0.4.8; the same lines in 0.4.9, 0.4.10, 0.5.0rc2, 0.5.1(.post1-3), "
                 "0.5.2): "
                 "reserved = (2.8 + tp x pp / 10) GiB below 35 GiB, (9.5 + tp x pp / 2) GiB below 90 GiB, "
                 "(12 + tp x pp / 2) GiB below 160 GiB, else 32 GiB (+2 GiB speculative, +4 GiB DP attention); "
                 "round((gpu_mem - reserved) / gpu_mem, 3); a multimodal model scales it from 0.4.9 (not modelled)",
                 "server_args.py: chunked_prefill_size 2048 below 35 GiB, 8192 below 160 GiB, else 16384 (4096 "
                 "without a GPU); cuda_graph_max_bs 8 (tp < 4) or 80 below 35 GiB", _PROFILE)),
    SglangMemoryRules(
        "0.5.3", "0.5.4", "reserved-formula", small_gpu_mib=20 * _GIB_MIB, large_gpu_mib=160 * _GIB_MIB,
        no_gpu_chunked=4096, mid_tier=(2048, 16, 80),
        change="the fraction from a reserve of chunked prefill and cuda-graph bs from 0.5.3",
        sources=(_FORMULA.format(rel="0.5.3; the same in 0.5.3.post1-3 and 0.5.4, whose piecewise cuda graphs "
                                 "are opt-in and not reserved"),
                 _TIERS.format(mid="2048 and cuda_graph_max_bs 16 (tp < 4) or 80"), _PROFILE)),
    SglangMemoryRules(
        "0.5.4.post1", "0.5.9", "reserved-formula", small_gpu_mib=20 * _GIB_MIB, large_gpu_mib=160 * _GIB_MIB,
        no_gpu_chunked=4096, mid_tier=(2048, 24, 80),
        change="the 20-35 GiB tier's cuda-graph bs 16 -> 24 (tp < 4) from 0.5.4.post1",
        sources=(_FORMULA.format(rel="0.5.4.post1; the same to 0.5.9: --enable-piecewise-cuda-graph is opt-in, so the "
                                 "default reserves no prefill graphs"),
                 _TIERS.format(mid="2048 and cuda_graph_max_bs 24 (tp < 4) or 80"), _PROFILE)),
    SglangMemoryRules(
        "0.5.10", "0.5.19", "reserved-formula", small_gpu_mib=20 * _GIB_MIB, large_gpu_mib=160 * _GIB_MIB,
        no_gpu_chunked=4096, mid_tier=(2048, 24, 80), prefill_graphs=True, piecewise_flag=True,
        change="the prefill (piecewise) cuda graphs on by default and reserved (8 MiB per captured size) from 0.5.10",
        sources=(_FORMULA.format(rel="0.5.10; the same to 0.5.18, arg_groups/memory_hook.py "
                                 "handle_gpu_memory_settings in 0.5.19"),
                 _PIECEWISE_FLAG,
                 "server_args.py _handle_gpu_memory_settings (0.5.10): piecewise cuda graphs on by default "
                 "(disable_piecewise_cuda_graph False): + 8 MiB per captured token size up to chunked_prefill_size "
                 "(2048 for MLA, which reserves 1.5 GiB instead), capped by --max-total-tokens; 0.5.13-0.5.16 also "
                 "cap it by --context-length (not modelled)",
                 _TIERS.format(mid="2048 and cuda_graph_max_bs 24 (tp < 4) or 80"), _PROFILE)),
    SglangMemoryRules(
        "0.5.20", "0.5.21", "reserved-formula", small_gpu_mib=20 * _GIB_MIB, large_gpu_mib=160 * _GIB_MIB,
        no_gpu_chunked=4096, mid_tier=(4096, 48, 160), prefill_graphs=True,
        no_gpu_fraction=0.95,
        change=("the 20-35 GiB tier's chunked prefill 2048 -> 4096 and cuda-graph bs 24 -> 48 (tp < 4), so a "
                "larger reserve, and 0.95 without a GPU, from 0.5.20"),
        sources=("arg_groups/memory_hook.py handle_gpu_memory_settings (0.5.20; the same in 0.5.21): the 0.5.10 "
                 "reserve; 0.95 without a GPU; the 20-35 GiB tier 4096 / 48 or 160 (0.5.20 L100-116, where 0.5.19 "
                 "L74-87 has 2048 / 24 or 80)",
                 _TIERS.format(mid="4096 and cuda_graph_max_bs 48 (tp < 4) or 160"), _PROFILE)),
    SglangMemoryRules(
        "0.5.22", "0.5.22", "reserved-formula", small_gpu_mib=20 * _GIB_MIB, large_gpu_mib=160 * _GIB_MIB,
        no_gpu_chunked=4096, mid_tier=(4096, 48, 160), prefill_graphs=True,
        clamp_max_bs=True, no_gpu_fraction=0.95,
        change=("a defaulted decode cuda-graph bs above --max-running-requests lowered to it, and its reserve"
                " with it, from 0.5.22"),
        sources=("arg_groups/memory_hook.py handle_gpu_memory_settings (0.5.22): as 0.5.20, and a defaulted "
                 "decode max_bs above --max-running-requests is lowered to it (L83 decode_max_bs_is_default, "
                 "L182-188, before the reserve's max_bs x 2 at L370; not in 0.5.21)", _PROFILE)),
    SglangMemoryRules(
        "0.5.23", "0.5.23", "reserved-formula", small_gpu_mib=20 * _GIB_MIB, large_gpu_mib=160 * _GIB_MIB,
        legacy=True,
        sources=("arg_groups/memory_hook.py handle_gpu_memory_settings (0.5.23): as 0.5.22, and an MLA model's "
                 "prefill graphs capped at min(8192, chunked_prefill_size) (kvprobe/theory/sglang/budget.py)",
                 "model_executor/kv_cache_configurator.py _profile_available_bytes (0.5.23)")),
)


def cuda_graph_reserves_dropped(version: str | None) -> tuple[bool, bool]:
    """(prefill, decode): the graph reserves --disable-cuda-graph drops from the default fraction. None: 0.5.23.

    0.5.3-0.5.13 add cuda_graph_max_bs x 2 whatever the flag (server_args.py _handle_gpu_memory_settings: 0.5.3
    L646, 0.5.4 L772, 0.5.4.post1 L756, 0.5.9 L1029, 0.5.10.post1 L1290, 0.5.11 L1443, 0.5.12 L1550, 0.5.13 L1601)
    and tie no piecewise graph to it. From 0.5.14 the flag sets both phases' backends "disabled" (0.5.14
    server_args.py L2942, 0.5.15 L3214, 0.5.20 and 0.5.23 arg_groups/cuda_graph_hook.py L60 / L55): 0.5.14 then
    skips the prefill reserve (L3300) and still adds the decode one (L3285); from 0.5.15 both are skipped (L3641,
    L3663; 0.5.18 reserve_for_graph_mb L5085 / L5101; 0.5.20 memory_hook.py L359 / L375; 0.5.23 L366 / L382).
    Before 0.5.3 the fraction has no graph term."""
    key = release_key(version) if version is not None else (0, 5, 23, 0)
    return key >= (0, 5, 14, 0), key >= (0, 5, 15, 0)


def _formula_tier(gpu_mem_mib: int, tp: int, mid: tuple[int, int, int]) -> tuple[int, int]:
    """(chunked_prefill_size, cuda_graph_max_bs) of the reserved-formula releases (0.5.3 on)."""
    if gpu_mem_mib < 20 * _GIB_MIB:
        return 2048, 8
    if gpu_mem_mib < 35 * _GIB_MIB:
        return mid[0], mid[1] if tp < 4 else mid[2]
    if gpu_mem_mib < 60 * _GIB_MIB:
        return 4096, 32 if tp < 4 else 160
    if gpu_mem_mib < 160 * _GIB_MIB:
        return 8192, 256 if tp < 4 else 512
    return 16384, 512


def release_key(version: str) -> tuple[int, int, int, int]:
    """(major, minor, patch, post): 0.4.6.post5 sorts after 0.4.6, whose defaults it changed."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?(?:\.post(\d+))?", normalize_version(version))
    if not m:
        raise ConfigError(f"expected an SGLang release such as 0.4.3.post4, got {version!r}", key="engine_version")
    return tuple(int(g or 0) for g in m.groups())


def memory_rules(version: str) -> SglangMemoryRules:
    """The rules of the read release whose range holds `version`; else refused naming the nearest."""
    for rules in RULES:
        if rules.covers(version):
            return rules
    mine = release_key(version)
    bounds = [b for r in RULES for b in (r.release, r.until)]
    nearest = min(bounds, key=lambda b: _distance(release_key(b), mine))
    ranges = ", ".join(f"{r.release}-{r.until}" if r.release != r.until else r.release for r in RULES)
    raise ConfigError(f"SGLang {version}'s memory budget is not read (read: {ranges}); the nearest read release "
                      f"is {nearest}: pass --engine-version {nearest} to size the pool by its rules",
                      key="engine_version")


def _distance(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Releases apart, counting a minor release as 1000 patch releases and a patch as 100 posts."""
    def flat(k: tuple[int, ...]) -> int:
        return ((k[0] * 1000 + k[1]) * 1000 + k[2]) * 100 + k[3]
    return abs(flat(a) - flat(b))
