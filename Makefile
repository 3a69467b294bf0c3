# Two entry points (README): `make reproduce` runs the workflow, `make test` runs the tests.
# Both create the virtual environment on first use from the pins in pyproject.toml.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Python 3.11 exactly (pyproject.toml: >=3.11,<3.12). Checked before any target that needs it
# runs: PYTHON, which makes the virtual environment, or the environment's own once it exists.
PYTHON_USED := $(if $(wildcard $(PY)),$(PY),$(PYTHON))
PYTHON_FOUND := $(shell $(PYTHON_USED) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
ifneq ($(filter-out clean docker,$(or $(MAKECMDGOALS),venv)),)
ifneq ($(PYTHON_FOUND),3.11)
$(error $(PYTHON_USED) is $(if $(PYTHON_FOUND),Python $(PYTHON_FOUND),no Python that runs), but slapo-ae needs Python 3.11 ($(if $(wildcard $(PY)),make clean and then )make PYTHON=python3.11 <target>))
endif
endif

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
# DeepSpeed compiles its CPU ops on first use into this cache instead of at install time.
export DS_BUILD_OPS := 0
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions

.PHONY: venv lint test reproduce clean docker docker-test

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[all,lint]'
	touch $@

# One python and one ninja for every target: DeepSpeed's JIT builds are then judged current by
# the same ninja the workflow's jobs use.
VENV_PATH = PATH="$(CURDIR)/$(VENV)/bin:$$PATH"
SNAKEMAKE = $(VENV)/bin/snakemake --workflow-profile workflow/profiles/default
# GPUs Snakemake may hand out at once (0 without GPUs); evaluated when a recipe runs.
GPUS = $(shell $(PY) -m slapo_ae.gpus)

# The linter and the dependency contract of pyproject.toml (workflow -> slapo_ae -> slapo).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

test: lint
	$(VENV_PATH) $(PY) -m pytest

# The evaluation workflow for the profile that fits this machine (cpu when no GPU is visible),
# then the report; pass e.g. SNAKEMAKE_ARGS="--config profile=paper". Snakemake parses
# --config and --configfile before the workflow can check them, so they are checked first.
# `--resources=gpus=N` in one word: spaced, --resources would take the targets that follow as
# resources; a --resources of SNAKEMAKE_ARGS comes later and wins.
reproduce: $(STAMP)
	@$(PY) workflow/check_args.py $(SNAKEMAKE_ARGS)
	$(VENV_PATH) $(SNAKEMAKE) --resources=gpus=$(GPUS) $(SNAKEMAKE_ARGS)
	$(VENV_PATH) $(SNAKEMAKE) --report report.html $(SNAKEMAKE_ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache .snakemake

# The image on the paper's CUDA 11.7 base (needs Docker Hub, PyPI and PyTorch's wheel index).
docker:
	docker build -f docker/Dockerfile -t slapo-ae .

# The CPU image from a local Debian base, built and run offline (root; docs/docker.md).
docker-test:
	bash docker/ci_test.sh
