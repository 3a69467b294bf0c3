# Two entry points (README): `make reproduce` runs the workflow, `make test` runs the tests.
# Both create the virtual environment on first use from the pins in pyproject.toml.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
# DeepSpeed compiles its CPU ops on first use into this cache instead of at install time.
export DS_BUILD_OPS := 0
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions

.PHONY: venv test reproduce clean docker docker-test

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[all,lint]'
	touch $@

test: $(STAMP)
	$(PY) -m pytest

# The evaluation workflow for the profile that fits this machine (cpu when no GPU is visible);
# pass e.g. SNAKEMAKE_ARGS="--config profile=paper --resources gpus=8".
reproduce: $(STAMP)
	$(VENV)/bin/snakemake --workflow-profile workflow/profiles/default $(SNAKEMAKE_ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache

# The image on the paper's CUDA 11.7 base (needs Docker Hub, PyPI and PyTorch's wheel index).
docker:
	docker build -f docker/Dockerfile -t slapo-ae .

# The CPU image from a local Debian base, built and run offline (root; docs/docker.md).
docker-test:
	bash docker/ci_test.sh
