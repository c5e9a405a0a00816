"""The model folder the real engines load: checked by the engine environment's own transformers."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvprobe.targets.shadow import envs, modeldir
from kvprobe.theory.model.geometry import load_model_config
from tests.engine_envs import engine_env

pytestmark = pytest.mark.slow

MODELS = ["meta-llama/Llama-3.1-8B", "deepseek-ai/DeepSeek-V3", "openai/gpt-oss-20b"]
HARMONY = ["<|end|>", "<|channel|>", "<|message|>", "<|return|>"]
# one process loads every folder given (one import of transformers): one JSON line per folder
_LOAD = r"""
import json, sys
from transformers import AutoConfig, AutoTokenizer
for folder in sys.argv[1:]:
    tok = AutoTokenizer.from_pretrained(folder)
    cfg = AutoConfig.from_pretrained(folder)
    print(json.dumps({"len": len(tok), "eos": tok.eos_token_id, "bos": tok.bos_token_id,
                      "text": tok.decode([5, 6, 7]), "ids": tok("t5 t9", add_special_tokens=False)["input_ids"],
                      "model_type": cfg.model_type, "harmony": tok.convert_tokens_to_ids(
                          ["<|end|>", "<|channel|>", "<|message|>", "<|return|>"])}))
"""


@pytest.fixture(scope="module")
def vllm_env(pytestconfig):
    return engine_env("vllm", "0.33.0", pytestconfig)  # installs when missing (~1 min warm)


@pytest.fixture(scope="module")
def loaded(vllm_env):
    """{model: (its folder, what the engine's transformers read from it)}, all in one process."""
    folders = [modeldir.model_folder(m, load_model_config(m)[0], vllm_env) for m in MODELS]
    out = subprocess.run([str(vllm_env.python), "-c", _LOAD, *map(str, folders)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, **envs.shadow_import_env("vllm")})
    assert out.returncode == 0, out.stderr[-2000:]
    answers = [json.loads(line) for line in out.stdout.strip().splitlines() if line.startswith("{")]
    assert len(answers) == len(MODELS), out.stdout[-2000:]
    return dict(zip(MODELS, zip(folders, answers, strict=True), strict=True))


@pytest.mark.parametrize("model", MODELS)
def test_engine_transformers_loads_the_folder(vllm_env, loaded, model):
    config, _ = load_model_config(model)
    folder, got = loaded[model]
    assert got["len"] == config["vocab_size"]
    eos = config["eos_token_id"]
    assert got["eos"] == (eos[0] if isinstance(eos, list) else eos)
    assert got["text"] == "t5 t6 t7" and got["ids"] == [5, 9]
    assert got["model_type"] == config["model_type"]
    # gpt-oss keeps the harmony tokens an engine looks up by name (vLLM 0.18.1's reasoning parser), at the
    # model's own ids: eos 200002 is "<|return|>"; other models have no such words (the unknown token, 0)
    named = modeldir.named_tokens(config, config["vocab_size"])
    assert got["harmony"] == [named.get(name, 0) for name in HARMONY]
    assert (got["harmony"] == [200007, 200005, 200008, 200002]) is (model == "openai/gpt-oss-20b")
    # cached: the second call returns the same folder without rebuilding it
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    assert modeldir.model_folder(model, config, vllm_env) == folder
    assert (folder / "tokenizer.json").stat().st_mtime_ns == stamp


def test_hf_home_resolves_the_hub_id_offline(vllm_env):
    config, _ = load_model_config("meta-llama/Llama-3.1-8B")
    folder = modeldir.model_folder("meta-llama/Llama-3.1-8B", config, vllm_env)
    home = modeldir.hf_home("meta-llama/Llama-3.1-8B", folder)
    code = ("from huggingface_hub import snapshot_download; "
            "print(snapshot_download('meta-llama/Llama-3.1-8B'))")
    out = subprocess.run([str(vllm_env.python), "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    snap = out.stdout.strip().splitlines()[-1]
    assert json.loads(open(os.path.join(snap, "config.json")).read())["num_hidden_layers"] == 32


def test_vocab_size_is_required():
    with pytest.raises(envs.EnvError, match="my.json: vocab_size: expected a positive integer"):
        modeldir.vocab_size({"hidden_size": 8}, "my.json")
    assert modeldir.vocab_size({"text_config": {"vocab_size": 262208}}) == 262208
