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
	$(BIN)/pip install -q -e ./spec -e '.[test]' -e ./plugins/xeon -e ./plugins/quant -e ./plugins/gaudi
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
