# megatron_patches: `make demo` and `make test` are all a fresh machine needs.
# One environment per Python line: the defaults give Python 3 (3.11 here) with megatron-core 0.16.1;
# `make test PYTHON=python3.12 VENV=.venv312` gives 3.12 with megatron-core 0.19.x.
PYTHON ?= python3
# A pythonX.Y that does not run as named (absent, or a pyenv shim of a version not selected) is
# looked up through pyenv: make test PYTHON=python3.12 works on a pyenv machine.
ifneq ($(shell $(PYTHON) -c 'print(1)' 2>/dev/null),1)
override PYTHON := $(or $(shell v=$$(pyenv versions --bare 2>/dev/null | grep -E '^$(patsubst python%,%,$(PYTHON))(\.|$$)' | tail -n 1); \
	[ -n "$$v" ] && PYENV_VERSION=$$v pyenv which $(PYTHON) 2>/dev/null),$(PYTHON))
endif
VENV ?= .venv
VPY := $(VENV)/bin/python
# torch is installed only when the environment has none (an existing torch, CUDA or NPU, is never
# replaced). On Python 3.11 the CPU build on these machines' disk; elsewhere the registry's build.
TORCH_CPU ?= torch==2.13.0
TORCH_OTHER ?= torch
# A megatron-core release to pin instead of the newest this Python can install, e.g. 0.18.2.
MEGATRON_CORE ?=
NPROC ?= 4
MEGATRON ?=
PYTEST_ARGS ?=
# A seed (or "random") runs the tests in one shuffled order (tests/conftest.py); empty: file order.
TEST_SEED ?=

.PHONY: install test test-fast test-all test-bridge layout-matrix demo bench bench-rollback campaign gpu-check patch unpatch patch-status clean

# One stamp per megatron-core request: asking for another release installs it.
STAMP := $(VENV)/.installed-$(or $(MEGATRON_CORE),newest)

$(STAMP): setup.py
	@$(PYTHON) -m megatron_patches.versions $(MEGATRON_CORE) >/dev/null
	$(PYTHON) -m venv --system-site-packages $(VENV)
	@echo "installing torch if absent, then megatron-core and the test extras into $(VENV) (several minutes on a new machine)"
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install --progress-bar on \
		"$$($(VPY) -c 'import sys; print("$(TORCH_CPU)" if sys.version_info[:2] == (3, 11) else "$(TORCH_OTHER)")')"
	$(VPY) -m pip install --quiet -e ".[test]" "$$($(VPY) -m megatron_patches.versions $(MEGATRON_CORE))"
	@rm -f $(VENV)/.installed*
	@touch $@
	@$(VPY) -c "from importlib.metadata import version; print('$(VENV): megatron-core', version('megatron-core'))"

install: $(STAMP)

# The CI suite: real tiny-GPT trainings on CPU (several ranks forked from pytest, or under
# torchrun where the launcher is the subject). On the 0.17+ lines it leaves out the tests marked
# one_line (see tests/conftest.py). The 15 slowest tests are listed at the end (CI's time budget).
# TEST_SEED=<seed> runs them in the order that seed draws (printed at the end; CI's 3.12 leg does).
test: install
	MEGATRON_PATCHES_TEST_SEED=$(TEST_SEED) $(VPY) -m pytest -q -m "not slow and not bench" --durations=15 $(PYTEST_ARGS) tests

# Units and one-rank runs forked from pytest: no test of several ranks (multiproc) or of a fresh
# process (process), none slow; under 3 minutes on the 3.11 leg here.
test-fast: install
	$(VPY) -m pytest -q -m "not slow and not bench and not multiproc and not process" $(PYTEST_ARGS) tests

# Everything, the slow and benchmark-marked tests included, then Megatron-Bridge's leg (test-bridge).
test-all: install
	MEGATRON_PATCHES_EVERY_LINE=1 $(VPY) -m pytest -q $(PYTEST_ARGS) tests
	$(MAKE) test-bridge

# Megatron-Bridge's pretraining loop (docs/bridge.md): its own environment $(BRIDGE_VENV) (Python 3.12,
# Bridge 0.6.2, 8.8 GB; built once by scripts/install_bridge_cpu.sh, about 4 minutes here), then
# tests/trainings/test_bridge.py. Not part of `make test` or CI: the install alone would take CI past its budget.
BRIDGE_VENV ?= .venv-bridge
test-bridge:
	bash scripts/install_bridge_cpu.sh $(BRIDGE_VENV)
	MEGATRON_PATCHES_EVERY_LINE=1 $(BRIDGE_VENV)/bin/python -m pytest -q $(PYTEST_ARGS) tests/trainings/test_bridge.py

# Megatron-LM's own loop on every layout (TP2, TP2 + sequence parallel, TP2 + bf16 + distributed
# optimizer + overlap, PP2 x VPP2, TP2 x PP2, TP2 x DP2) with Megatron's check on and off: a NaN in
# one rank's gradient, a NaN in one module's output, a rollback. Needs megatron-core 0.17+ (its
# packaged loop: make layout-matrix PYTHON=python3.12 VENV=.venv312) or MEGATRON_LM_DIR; ~6 minutes.
layout-matrix: install
	$(VPY) -m pytest -q -m "layout_matrix or not slow" $(PYTEST_ARGS) tests/trainings/test_layouts.py

# A tiny GPT on $(NPROC) CPU ranks (TP=2 x DP=2), no checkpoint flag. Step 12: a NaN in one
# tensor-parallel gradient on rank 1; the guard catches it, names it, skips the step. Step 20: a NaN
# written into a weight on rank 2, held there for good; rolled back in memory to the newest
# certified snapshot. Training goes on to step 30.
demo: install
	rm -rf runs/demo
	$(VPY) -m torch.distributed.run --nproc-per-node $(NPROC) -m megatron_patches.tiny_gpt \
		--tp 2 --steps 30 --out runs/demo \
		--inject "nan:step=12,param=decoder.layers.1.mlp.linear_fc1.weight,rank=1" \
		--inject "nan:step=20,phase=param,param=decoder.layers.0.mlp.linear_fc2.weight,rank=2"
	$(VPY) -m megatron_patches report runs/demo

bench: install
	$(VPY) scripts/bench_overhead.py --out bench.json

# A persistent fault rolled back in process vs by exit 84 and a restart, and the snapshots' step-time
# cost, through Megatron-LM's packaged loop (megatron-core 0.17+: PYTHON=python3.12 VENV=.venv312).
bench-rollback: install
	$(VPY) scripts/bench_rollback.py --out bench_rollback.json

# The fault campaign scored by harm (issue 55): every fault kind x scope x target x seed of the
# drills' menu, each a branch of one clean warm-up, on the harness layouts (LAYOUTS, default all:
# 1rank dp2 tp2 pp2), with the defaults and every detector, plus fault-free controls; writes
# docs/campaign.jsonl (the code commit in its meta) and the table in docs/reliability.md. Hours on
# 2 CPU cores: CAMPAIGN_ARGS=--budget-minutes N cuts each layout (the file says which cells ran).
LAYOUTS ?= 1rank dp2 tp2 pp2
campaign: install
	nice -n 10 $(VPY) scripts/fault_campaign.py --layouts $(LAYOUTS) --out runs/campaign $(CAMPAIGN_ARGS)

# The device check (8 minutes at most): nccl, bf16, drills, guard on/off, the bench; results in
# runs/gpu_check. GPU_CHECK_ARGS=--dry-run runs it on the CPU.
gpu-check: install
	PYTHON=$(VPY) bash scripts/gpu_check.sh $(GPU_CHECK_ARGS)

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
	rm -rf $(VENV) runs build *.egg-info bench.json bench_rollback.json
