# Two entry points: `make serve` and `make test`. Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
KERNELS_STAMP := $(VENV)/.kernels
KERNEL_SOURCES := $(wildcard plugins/xeon/switchyard_xeon/kernels/*.cpp) \
	$(wildcard plugins/xeon/switchyard_xeon/kernels/*.h) \
	plugins/xeon/switchyard_xeon/isa.py plugins/xeon/setup.py

.PHONY: serve test install kernels clean

$(STAMP): pyproject.toml spec/pyproject.toml engine/pyproject.toml plugins/xeon/pyproject.toml plugins/quant/pyproject.toml plugins/gaudi/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: this version is the CPU build; anything else pulls CUDA wheels.
	$(BIN)/pip install -q torch==2.13.0
	# The quant plugin's fp8 extra is Intel Neural Compressor (PyTorch half), for QUANT_CONFIG.
	$(BIN)/pip install -q -e ./spec -e ./engine -e '.[test]' -e './plugins/quant[fp8]' -e ./plugins/gaudi
	# DeepSpeed (gaudi sharding, AutoTP) is an sdist whose setup imports torch: build it against
	# the torch above (no build isolation, which would fetch another torch), with no native ops.
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation deepspeed==0.19.8
	# text-generation's metadata pins huggingface-hub<1; it works with 1.x.
	$(BIN)/pip install -q --no-deps text-generation==0.7.0
	touch $(STAMP)

# The xeon engine with its native kernels, compiled here once per ISA level (a few minutes
# on 2 cores), against the torch above: no build isolation, which would fetch another torch.
# Editing a kernel source makes the next `make serve`/`make test` build again; `switchyard
# serve` itself never compiles.
# Two builds at once wait on a flock, which the kernel releases when its holder dies, so
# a build killed half way never blocks the next one.
$(KERNELS_STAMP): $(STAMP) $(KERNEL_SOURCES)
	$(BIN)/pip install -q setuptools ninja
	@mkdir -p plugins/xeon/build
	@flock -n plugins/xeon/build/.lock true || echo "waiting (30 min at most) for another \
	kernel build to finish: flock on plugins/xeon/build/.lock"
	flock -w 1800 plugins/xeon/build/.lock env MAX_JOBS=$${MAX_JOBS:-$$(nproc)} timeout 1800 \
		$(BIN)/pip install -q --no-build-isolation -e ./plugins/xeon
	touch $(KERNELS_STAMP)

install: $(KERNELS_STAMP)

kernels: $(KERNELS_STAMP)

serve: $(KERNELS_STAMP)
	$(BIN)/switchyard serve $(ARGS)

test: $(KERNELS_STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
