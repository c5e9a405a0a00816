"""SGLang's rules that change from release to release: the admission policy a version runs. The
version strings themselves (the default release, the known ones) are `kvprobe.releases`'; the
engine's dialect (`kvprobe.engines.sglang`) and the ledger both ask here, so a version runs the
same policy in the emulator and in the ledger."""

from __future__ import annotations

from kvprobe.releases import version_tuple

# --max-prefill-tokens default (python/sglang/srt/server_args.py, 0.5.23): the prefill budget of a
# scheduling pass, and the activation estimate's token count when chunked prefill is off.
MAX_PREFILL_TOKENS = 16384


def policy(version: str) -> str:
    """The admission policy (schedsim's name) of an SGLang version: 0.5.22 and later reserve an
    ignore_eos request's output at ratio 1.0; 0.5.21 and older scale it by new_token_ratio
    (python/sglang/srt/managers/schedule_policy.py `PrefillAdder._get_running_request_total_token_offset`:
    0.5.21 L788-795, 0.5.22 L754-763). Both sides run on their shadows (docs/diff.md, 0.5.21 -> 0.5.22)."""
    return "sglang-0.5.21" if version_tuple(version) <= (0, 5, 21) else "sglang-0.5.22"


# What each policy's rule says, in the words a diff between two releases names it with (`kvprobe diff`).
RULES = {"sglang-0.5.21": "an ignore_eos request's output reserved at new_token_ratio, up to 0.5.21",
         "sglang-0.5.22": "an ignore_eos request's output reserved in full (ratio 1.0) from 0.5.22"}
