# The two set-up commands of the README. Both work on a fresh machine: they make .venv and install into it.
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test test-fast lint-imports
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,cpu]'
	touch $@

# Serves the built-in tiny MiniMax-M3 model on CPU (written on first use; no downloads).
serve: install
	$(VENV)/bin/m3serve serve --device cpu --host $(HOST) --port $(PORT)

# Installs what the tests need (Python packages, Debian's prometheus for the metrics test) and runs them all.
test: install
	@command -v prometheus >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq prometheus >/dev/null) || echo "prometheus not installed: the metrics test will fail"
	$(PY) -m pytest -q --durations=25

lint-imports: install
	$(VENV)/bin/lint-imports
