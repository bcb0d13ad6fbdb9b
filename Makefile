# Two entry points: `make serve` and `make test`. Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
KERNELS_STAMP := $(VENV)/.kernels
# Every package an install resolves, pinned (`make lock` writes it; docs/testing.md).
LOCK ?= constraints.txt
PIP := $(BIN)/pip install -q -c $(LOCK)
KERNEL_SOURCES := $(wildcard plugins/xeon/switchyard_xeon/kernels/*.cpp) \
	$(wildcard plugins/xeon/switchyard_xeon/kernels/*.h) \
	plugins/xeon/switchyard_xeon/isa.py plugins/xeon/setup.py

.PHONY: serve test test-isa-avx2 install kernels lock clean

$(STAMP): pyproject.toml spec/pyproject.toml engine/pyproject.toml plugins/xeon/pyproject.toml plugins/quant/pyproject.toml plugins/gaudi/pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	$(PIP) --upgrade pip
	# torch first, pinned: this version is the CPU build; anything else pulls CUDA wheels.
	$(PIP) torch==2.13.0
	# The quant plugin's fp8 extra is Intel Neural Compressor (PyTorch half), for QUANT_CONFIG.
	$(PIP) -e ./spec -e ./engine -e '.[test]' -e './plugins/quant[fp8]' -e ./plugins/gaudi
	# DeepSpeed (gaudi sharding, AutoTP) is an sdist whose setup imports torch: build it against
	# the torch above (no build isolation, which would fetch another torch), with no native ops.
	DS_BUILD_OPS=0 $(PIP) --no-build-isolation deepspeed==0.19.8
	# text-generation's metadata pins huggingface-hub<1; it works with 1.x.
	$(PIP) --no-deps text-generation==0.7.0
	$(PIP) setuptools ninja  # the kernels' build (below)
	touch $(STAMP)

# The xeon engine with its native kernels, compiled here once per ISA level (a few minutes
# on 2 cores), against the torch above: no build isolation, which would fetch another torch.
# Editing a kernel source makes the next `make serve`/`make test` build again; `switchyard
# serve` itself never compiles.
# Two builds at once wait on a flock, which the kernel releases when its holder dies, so
# a build killed half way never blocks the next one.
$(KERNELS_STAMP): $(STAMP) $(KERNEL_SOURCES)
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

# The xeon and LoRA suites again with the kernels capped at AVX2, so that a machine with
# AVX-512 or AMX runs what an AVX2-only one (a Zen 3) would. CI runs it after `test`; where
# AVX2 is already the best level (or none runs), `test` ran it and this says so.
BEST_ISA = $(BIN)/python -c 'from switchyard_xeon.isa import choose; \
	c = choose(cap=""); print(c.variant.name if c.variant else "none")'
test-isa-avx2: $(KERNELS_STAMP)
	@best=$$($(BEST_ISA)); if [ "$$best" = avx2 ] || [ "$$best" = none ]; then \
		echo "test-isa-avx2: skipped: the best kernel level here is $$best, which test ran"; \
	else echo "test-isa-avx2: tests/xeon and tests/lora on avx2 (this CPU's best: $$best)"; \
		SWITCHYARD_XEON_ISA=avx2 $(BIN)/python -m pytest tests/xeon tests/lora $(PYTEST_ARGS); fi

# Re-resolve every unpinned dependency (newest releases), write the lock from that install,
# run the suite on it, and commit the lock. torch stays pinned above.
LOCK_VENV := .venv-lock
lock:
	rm -rf $(LOCK_VENV)
	$(MAKE) --no-print-directory VENV=$(LOCK_VENV) LOCK=/dev/null $(LOCK_VENV)/.installed
	{ sed -n '/^#/p' $(LOCK); $(LOCK_VENV)/bin/pip freeze --all --exclude-editable \
		| sed 's/^torch==2.13.0+cpu$$/torch==2.13.0/'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf $(LOCK_VENV)
	$(MAKE) --no-print-directory test test-isa-avx2
	git commit -m "lock: dependencies re-resolved, suite passed" $(LOCK)

clean:
	rm -rf $(VENV)
