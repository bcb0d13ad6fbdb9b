# Two entry points: `make serve` and `make test`. Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test install clean

$(STAMP): pyproject.toml spec/pyproject.toml plugins/xeon/pyproject.toml plugins/quant/pyproject.toml plugins/gaudi/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: this version is the CPU build; anything else pulls CUDA wheels.
	$(BIN)/pip install -q torch==2.13.0
	# The quant plugin's fp8 extra is Intel Neural Compressor (PyTorch half), for QUANT_CONFIG.
	$(BIN)/pip install -q -e ./spec -e '.[test]' -e ./plugins/xeon -e './plugins/quant[fp8]' -e ./plugins/gaudi
	# DeepSpeed (gaudi sharding, AutoTP) is an sdist whose setup imports torch: build it against
	# the torch above (no build isolation, which would fetch another torch), with no native ops.
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation deepspeed==0.19.8
	# text-generation's metadata pins huggingface-hub<1; it works with 1.x.
	$(BIN)/pip install -q --no-deps text-generation==0.7.0
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/switchyard serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
