# stead: every target creates/uses .venv itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
RUNSTAMP := $(VENV)/.installed

.PHONY: chromium chaos demo test stress lint typecheck proto bench bench-quick etcd slurm clean

# torch and numpy are installed in one pip command (torch==2.13.0 is the CPU wheel on this machine)
define VENV_WITH_TORCH
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q "torch==2.13.0" "numpy==2.4.6"
endef

$(RUNSTAMP): pyproject.toml
	$(VENV_WITH_TORCH)
	$(BIN)/pip install -q -e .
	touch $@

# stead with its dev extras in one install (not stead, then stead again with them: 10 s less from a fresh clone);
# it holds everything the runtime install does, so `make demo` needs nothing more
$(STAMP): pyproject.toml
	$(VENV_WITH_TORCH)
	$(BIN)/pip install -q -e ".[dev]"
	touch $(RUNSTAMP) $@

etcd:
	@command -v etcd >/dev/null 2>&1 || { \
	  echo "etcd not found: installing etcd-server with apt-get"; \
	  SUDO=$$(command -v sudo >/dev/null 2>&1 && [ "$$(id -u)" != 0 ] && echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq etcd-server >/dev/null; }
	@command -v etcd >/dev/null 2>&1 || { echo "etcd-server could not be installed"; exit 1; }

# Slurm's controller, node daemon and clients (Debian's 22.05, munge comes as a dependency but is not run) for the
# Slurm cluster on test hosts (tests/support/slurm.py); no service starts on install
SLURM_PACKAGES := slurmctld slurmd slurm-client
SLURM_FOUND := PATH="$$PATH:/usr/sbin:/sbin" command -v slurmctld >/dev/null 2>&1 && \
  PATH="$$PATH:/usr/sbin:/sbin" command -v slurmd >/dev/null 2>&1 && command -v srun >/dev/null 2>&1
slurm:
	@$(SLURM_FOUND) || { \
	  echo "Slurm not found: installing $(SLURM_PACKAGES) with apt-get"; \
	  SUDO=$$(command -v sudo >/dev/null 2>&1 && [ "$$(id -u)" != 0 ] && echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	    --no-install-recommends $(SLURM_PACKAGES) >/dev/null; }
	@$(SLURM_FOUND) || { echo "Slurm ($(SLURM_PACKAGES)) could not be installed"; exit 1; }

# Chromium renders `stead report`'s HTML headless in a test; without it that one test is skipped, saying why
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "chromium not found: installing Debian's chromium with apt-get (for the report rendering test)"; \
	  SUDO=$$(command -v sudo >/dev/null 2>&1 && [ "$$(id -u)" != 0 ] && echo sudo); \
	  { $$SUDO apt-get install -y -qq chromium >/dev/null 2>&1 || \
	    { $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }; } \
	  || echo "chromium could not be installed: the report rendering test will be skipped"; }

demo: $(RUNSTAMP)
	$(BIN)/python examples/demo.py

lint: $(STAMP)
	$(BIN)/ruff check stead tests bench examples scripts
	$(BIN)/lint-imports

# tests.support (the fake Kubernetes, the hostile RPC peers: only stead's tests use them) is typed as strictly
typecheck: $(STAMP)
	$(BIN)/mypy --strict -p stead -p tests.support

# two xdist workers that steal work from each other; the whole-job tests (tests/e2e, tests/chaos) are collected
# first (tests/conftest.py), so the last tests to run are short ones
test: $(STAMP) etcd slurm chromium lint typecheck
	$(BIN)/pytest -q -n 2 --dist worksteal

# concurrency stress: the store stress test (short bursts) and the sampler's master-restart test, hundreds of times
STRESS_COUNT ?= 200
stress: $(STAMP) etcd
	STEAD_STRESS_S=0.5 $(BIN)/pytest -q --count=$(STRESS_COUNT) -x \
	  tests/core/store/test_store_stress.py \
	  "tests/plugins/sharding/test_sharding_sampler.py::test_the_sampler_rides_out_a_master_restart"

# long runs that do not fit in `make test`: the RPC fuzz with many more cases per method, and the chaos job
# under a long seeded fault schedule on etcd (CHAOS_FAULTS faults of every kind, a 20 s etcd outage among them)
# and across three test hosts (CHAOS_HOST_FAULTS worker faults, hosts killed and cut off); and the whole-job tests
# marked `extended` (variants that tests in `make test` cover in part, kept out of its 15-minute budget)
FUZZ_EXAMPLES ?= 3000
CHAOS_FAULTS ?= 200
CHAOS_SEED ?= 1
CHAOS_HOST_FAULTS ?= 40
chaos: $(STAMP) etcd
	STEAD_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/pytest -q tests/fuzz
	STEAD_CHAOS_LONG=1 STEAD_CHAOS_FAULTS=$(CHAOS_FAULTS) STEAD_CHAOS_SEED=$(CHAOS_SEED) \
	  STEAD_CHAOS_HOST_FAULTS=$(CHAOS_HOST_FAULTS) \
	  $(BIN)/pytest -q -s --timeout=4000 tests/chaos -k long
	STEAD_EXTENDED=1 $(BIN)/pytest -q -n 2 -m extended tests

proto: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash scripts/gen_proto.sh

bench: $(STAMP) etcd
	$(BIN)/python bench/master_events.py
	-$(BIN)/python bench/recovery.py
	-$(BIN)/python bench/startup.py
	-$(BIN)/python bench/failover.py
	-$(BIN)/python bench/hosts.py
	-$(BIN)/python bench/replicas.py
	-$(BIN)/python bench/goodput.py
	-$(BIN)/python bench/scale.py
	-$(BIN)/python bench/k8s.py
	-$(BIN)/python bench/frameworks.py
	-$(BIN)/python bench/master_scale.py --etcd-max 10000

bench-quick: $(STAMP) etcd
	$(BIN)/python bench/master_events.py --quick

clean:
	rm -rf $(VENV) .stead .pytest_cache .mypy_cache .ruff_cache
