PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test probe bench matrix lint ledger clean shadow-vllm shadow-sglang router

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# Two lanes of end-to-end tests and one worker of unit tests (tests/conftest.py): the lanes' probes
# take turns at loading the cores, their engines start while the other lane ramps.
test: $(STAMP)
	KVPROBE_TEST_LANES=2 $(BIN)/python -m pytest -q --durations=25 -n 3 --dist loadgroup

probe: $(STAMP)
	$(BIN)/kvprobe probe expectations/emulated-vllm.yaml --artifacts artifacts/probe

ledger: $(STAMP)
	$(BIN)/kvprobe ledger --engine vllm --model meta-llama/Llama-3.1-8B --gpu-memory 24GiB --max-model-len 8192 --prompt-tokens 512 --output-tokens 256

bench: $(STAMP)
	$(BIN)/python -m bench

# The release pairs of expectations/diff/ on every release kvprobe has facts for (emulated: the
# emulator plays each release's admission rule); a change found exits 1, which is what a matrix is for.
# Then the pairs with a shadow environment per release, on the real engines' code (--install builds a
# missing environment: ~2-4 min and ~2 GB each, less beside the others: `kvprobe shadow share`), and each
# engine's shape on every release installed here (`--versions installed`: 2-3 min per release). Last,
# SGLang 0.5.19, 0.5.21 and 0.5.22's own Scheduler step by step against the simulation of each (~1 min each),
# and every installed vLLM release's own KV planner on the shadow worker's MLA specs (~30 s each). Between
# them, the vLLM shadow pool sizings `make test` leaves out (--kv-cache-memory-bytes, --gpu-memory-utilization).
matrix: $(STAMP)
	-$(BIN)/kvprobe diff expectations/diff/vllm-first-chunk.yaml --versions 0.9.2,0.11.0,0.19.0,0.24.0,0.33.0 \
		--artifacts artifacts/matrix/vllm
	-$(BIN)/kvprobe diff expectations/diff/vllm-block-size.yaml --versions 0.33.0,0.34.0 \
		--artifacts artifacts/matrix/vllm-block-size
	-$(BIN)/kvprobe diff expectations/diff/sglang-ignore-eos.yaml --versions 0.5.20,0.5.21,0.5.22,0.5.23 \
		--artifacts artifacts/matrix/sglang
	-$(BIN)/kvprobe diff expectations/diff/sglang-ignore-eos-shadow.yaml --versions 0.5.21,0.5.23 --install \
		--artifacts artifacts/matrix/sglang-shadow
	-$(BIN)/kvprobe diff expectations/diff/sglang-ignore-eos-shadow.yaml --versions 0.5.21,0.5.22 --install \
		--artifacts artifacts/matrix/sglang-shadow-boundary
	-$(BIN)/kvprobe diff expectations/diff/sglang-swa-budget-shadow.yaml --versions 0.5.20,0.5.21 --install \
		--artifacts artifacts/matrix/sglang-swa-budget
	-$(BIN)/kvprobe diff expectations/diff/sglang-mid-tier-shadow.yaml --versions 0.5.19,0.5.20 --install \
		--artifacts artifacts/matrix/sglang-mid-tier
	-$(BIN)/kvprobe diff expectations/diff/sglang-graph-bs-shadow.yaml --versions 0.5.21,0.5.22 --install \
		--artifacts artifacts/matrix/sglang-graph-bs
	-$(BIN)/kvprobe diff expectations/diff/vllm-full-prompt-shadow.yaml --versions 0.18.1,0.33.0 --install \
		--artifacts artifacts/matrix/vllm-shadow
	-$(BIN)/kvprobe diff expectations/diff/vllm-full-prompt-shadow.yaml --versions 0.18.1,0.19.1 --install \
		--artifacts artifacts/matrix/vllm-shadow-0.19
	-$(BIN)/kvprobe diff expectations/diff/vllm-watermark-shadow.yaml --versions 0.23.0,0.24.0 --install \
		--artifacts artifacts/matrix/vllm-shadow-watermark
	-$(BIN)/kvprobe diff expectations/diff/vllm-active-seqs-shadow.yaml --versions 0.30.0,0.31.0 --install \
		--artifacts artifacts/matrix/vllm-shadow-active-seqs
	-$(BIN)/kvprobe diff expectations/diff/vllm-mla-shadow.yaml --versions 0.18.1,0.33.0 --install \
		--artifacts artifacts/matrix/vllm-mla-shadow
	-$(BIN)/kvprobe diff expectations/diff/vllm-hybrid-window-shadow.yaml --versions 0.18.1,0.33.0 --install \
		--artifacts artifacts/matrix/vllm-hybrid-window-shadow
	-$(BIN)/kvprobe diff expectations/diff/vllm-hybrid-window-shadow.yaml --versions 0.25.1,0.26.0 --install \
		--artifacts artifacts/matrix/vllm-hybrid-window-inflight
	-$(BIN)/kvprobe diff expectations/diff/vllm-window-cap-shadow.yaml --versions 0.19.1,0.20.2 --install \
		--artifacts artifacts/matrix/vllm-window-cap-shadow
	-$(BIN)/kvprobe diff expectations/diff/vllm-block-size-shadow.yaml --versions 0.33.0,0.34.0 --install \
		--artifacts artifacts/matrix/vllm-block-size-shadow
	-$(BIN)/kvprobe diff expectations/hybrid-vllm-qwen3-next.yaml --versions 0.33.0,0.34.0 --install \
		--artifacts artifacts/matrix/vllm-mamba-block-size-shadow
	-$(BIN)/kvprobe diff expectations/hybrid-vllm-qwen3-next.yaml --versions 0.18.1,0.25.1,0.33.0 --install \
		--artifacts artifacts/matrix/vllm-mamba-releases-shadow
	-$(BIN)/kvprobe diff expectations/diff/vllm-mamba-cache-mode-shadow.yaml --versions 0.26.0,0.27.1,0.28.0,0.32.0,0.33.0 \
		--install --artifacts artifacts/matrix/vllm-mamba-cache-mode-shadow
	-$(BIN)/kvprobe probe expectations/shadow-vllm-shapes.yaml --name shadow-vllm-kv-cache-memory-bytes \
		--artifacts artifacts/matrix/shadow-vllm-kv-cache-memory-bytes
	-$(BIN)/kvprobe probe expectations/shadow-vllm-shapes.yaml --name shadow-vllm-gpu-memory-utilization \
		--artifacts artifacts/matrix/shadow-vllm-gpu-memory-utilization
	-$(BIN)/kvprobe diff expectations/diff/vllm-full-prompt-shadow.yaml --versions installed \
		--artifacts artifacts/matrix/vllm-installed
	-$(BIN)/kvprobe diff expectations/diff/sglang-ignore-eos-shadow.yaml --versions installed \
		--artifacts artifacts/matrix/sglang-installed
	-$(BIN)/python -m pytest -q -p no:cacheprovider tests/theory/matrix_real_sglang_releases.py
	-$(BIN)/python -m pytest -q -p no:cacheprovider tests/theory/matrix_real_vllm_hybrid_releases.py
	-KVPROBE_RELEASES=installed $(BIN)/python -m pytest -q -p no:cacheprovider tests/shadow_env/test_mla_vllm_releases.py

shadow-vllm: $(STAMP)
	$(BIN)/kvprobe shadow install vllm==0.33.0

shadow-sglang: $(STAMP)
	$(BIN)/kvprobe shadow install sglang==0.5.23

router: $(STAMP)
	$(BIN)/kvprobe shadow install sglang-router==0.3.2

lint: $(STAMP)
	$(BIN)/ruff check kvprobe tests bench

clean:
	rm -rf $(VENV) artifacts .pytest_cache
