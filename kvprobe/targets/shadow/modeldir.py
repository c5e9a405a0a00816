"""A model folder the real engines load offline: the model's config.json and a tokenizer, no weights.

The engines read the model's geometry from `config.json` exactly as they would on a GPU (that is
what sizes the KV pool), and they need a tokenizer that `transformers.AutoTokenizer` loads without
a hub. The tokenizer is a word-level one over the model's whole vocabulary (token id i is the word
`t<i>`), built with the `tokenizers` package *of the engine environment* so that its file format is
the one that engine's transformers reads; streamed text then carries one word per token.

Folders are cached under `cache_root()/models/<engine>-<version>/` by the digest of the config, so
a probe rebuilds nothing it already has. For engines that resolve a hub id (SGLang's
`--model-path meta-llama/Llama-3.1-8B`), `hf_home` lays the same files out as a local Hugging Face
cache snapshot, so that the served model name stays the preset's id with `HF_HUB_OFFLINE=1`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

from kvprobe.targets.shadow.envs import EngineEnv, EnvError, cache_root

TOKENIZER_REVISION = "1"  # bump when the tokenizer files written below change
TRANSFORMERS_VERSION_KEY = "transformers_version"  # absent -> transformers 5.20 warns about a regex

_BUILD_TOKENIZER = r"""
import json, sys
from tokenizers import Tokenizer, models, pre_tokenizers
folder, size, named = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
vocab = {f"t{i}": i for i in range(size)}
for name, i in named.items():  # the model's own special tokens, where an engine looks them up by name
    del vocab[f"t{i}"]
    vocab[name] = i
tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.save(f"{folder}/tokenizer.json")
"""


def vocab_size(config: dict, source: str = "config.json") -> int:
    """The vocabulary as the engines read it (multimodal configs nest it in `text_config`)."""
    for section in (config, config.get("text_config") or {}, config.get("llm_config") or {}):
        size = section.get("vocab_size")
        if isinstance(size, int) and size > 0:
            return size
    raise EnvError(f"{source}: vocab_size: expected a positive integer (top level or text_config)")


def _first_id(value, default: int) -> int:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else default


def _special_ids(config: dict, size: int) -> tuple[int, int]:
    text = config.get("text_config") or {}
    bos = _first_id(config.get("bos_token_id", text.get("bos_token_id")), 0)
    eos = _first_id(config.get("eos_token_id", text.get("eos_token_id")), size - 1)
    return bos, eos


# Special tokens an engine looks up by name at start-up, with the model's own ids: vLLM 0.18.1's gpt-oss
# reasoning parser reads vocab["<|end|>"] and encodes "<|channel|>final" and "<|message|>"
# (reasoning/gptoss_reasoning_parser.py L73-83; `openai_gptoss` is set for every GptOssForCausalLM,
# model_executor/models/config.py L60-65). The harmony encoding's ids: openai/gpt-oss gpt_oss/tokenizer.py
# (o200k_harmony, commit 037102b9).
NAMED_TOKENS = {
    "gpt_oss": {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002, "<|constrain|>": 200003,
                "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008,
                "<|call|>": 200012},
}


def named_tokens(config: dict, size: int) -> dict[str, int]:
    """The special tokens of this model kept by name in the shadow's tokenizer (those inside its vocabulary)."""
    named = NAMED_TOKENS.get(config.get("model_type"), {})
    return {name: i for name, i in named.items() if 0 < i < size}


def _digest(config: dict) -> str:
    text = json.dumps(config, sort_keys=True) + TOKENIZER_REVISION
    named = NAMED_TOKENS.get(config.get("model_type"))
    if named:  # a folder built before the names were kept is rebuilt; other models' folders stay
        text += json.dumps(named, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _slug(model: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "-" for c in model).strip("-") or "model"


def model_folder(model: str, config: dict, env: EngineEnv) -> Path:
    """The folder for `model` (its config dict as kvprobe's theory read it), built once per env."""
    folder = cache_root() / "models" / f"{env.engine}-{env.version}" / f"{_slug(model)}-{_digest(config)}"
    if (folder / "tokenizer_config.json").exists():
        return folder
    size = vocab_size(config, model)
    partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
    partial.mkdir(parents=True, exist_ok=True)
    cfg = dict(config)
    cfg.setdefault(TRANSFORMERS_VERSION_KEY, "4.57.0")
    (partial / "config.json").write_text(json.dumps(cfg, indent=1))
    try:
        out = subprocess.run([str(env.python), "-c", _BUILD_TOKENIZER, str(partial), str(size),
                              json.dumps(named_tokens(config, size))],
                             capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise EnvError(f"building the tokenizer for {model} took more than 300 s") from None
    if out.returncode != 0:
        raise EnvError(f"building the tokenizer for {model} in {env.root} failed: "
                       + (out.stderr.strip().splitlines() or ["no output"])[-1])
    bos, eos = _special_ids(config, size)
    word = {i: name for name, i in named_tokens(config, size).items()}
    (partial / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": word.get(bos, f"t{bos}"),
        "eos_token": word.get(eos, f"t{eos}"),
        "unk_token": "t0", "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False}, indent=1))
    try:
        partial.rename(folder)  # atomic: a reader sees a whole folder or none
    except OSError:
        if not (folder / "tokenizer_config.json").exists():  # lost a race with another builder: fine
            raise
    return folder


def hf_home(model: str, folder: Path) -> Path:
    """An HF_HOME in which the hub id `model` resolves offline to `folder` (a snapshot of links)."""
    home = folder.parent / (folder.name + ".hf")
    repo = home / "hub" / ("models--" + model.replace("/", "--"))
    revision = folder.name.rsplit("-", 1)[-1].ljust(40, "0")[:40]
    snapshot = repo / "snapshots" / revision
    if not (repo / "refs" / "main").exists():
        snapshot.mkdir(parents=True, exist_ok=True)
        for f in folder.iterdir():
            link = snapshot / f.name
            if not link.exists():
                link.symlink_to(f)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
    return home
