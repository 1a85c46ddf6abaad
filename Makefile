# megatron_patches: `make demo` and `make test` are all a fresh machine needs.
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# The CPU build of torch that lies on these machines' disk; installed only when the
# environment has no torch at all (an existing torch, CUDA or NPU, is never replaced).
TORCH_CPU ?= torch==2.13.0
NPROC ?= 4
MEGATRON ?=
PYTEST_ARGS ?=

.PHONY: install test test-all demo bench patch unpatch patch-status clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install --quiet "$(TORCH_CPU)"
	$(VPY) -m pip install --quiet -e ".[test]"
	@touch $@

install: $(VENV)/.installed

# The CI suite: real tiny-GPT trainings on CPU (several ranks via torchrun), under ~15 minutes.
test: install
	$(VPY) -m pytest -q -m "not slow and not bench" $(PYTEST_ARGS) tests

# Everything, the slow and benchmark-marked tests included.
test-all: install
	$(VPY) -m pytest -q $(PYTEST_ARGS) tests

# A tiny GPT on $(NPROC) CPU ranks (TP=2 x DP=2), a NaN injected into one tensor-parallel
# weight on rank 1 at step 12: the guard catches it, names it, skips the step; training goes on.
demo: install
	rm -rf runs/demo
	$(VPY) -m torch.distributed.run --nproc-per-node $(NPROC) -m megatron_patches.tiny_gpt \
		--tp 2 --steps 30 --out runs/demo \
		--inject "nan:step=12,param=decoder.layers.1.mlp.linear_fc1.weight,rank=1"
	$(VPY) -m megatron_patches report runs/demo

bench: install
	$(VPY) scripts/bench_overhead.py --out bench.json

patch: install
	@test -n "$(MEGATRON)" || { echo "usage: make patch MEGATRON=/path/to/Megatron-LM"; exit 2; }
	$(VPY) scripts/megatron_patch.py apply --megatron "$(MEGATRON)"

unpatch:
	@test -n "$(MEGATRON)" || { echo "usage: make unpatch MEGATRON=/path/to/Megatron-LM"; exit 2; }
	$(PYTHON) scripts/megatron_patch.py revert --megatron "$(MEGATRON)"

patch-status:
	@test -n "$(MEGATRON)" || { echo "usage: make patch-status MEGATRON=/path/to/Megatron-LM"; exit 2; }
	$(PYTHON) scripts/megatron_patch.py status --megatron "$(MEGATRON)"

clean:
	rm -rf $(VENV) runs build *.egg-info bench.json
