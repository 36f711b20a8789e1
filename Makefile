# The two commands of the README. Each creates .venv on first use and
# (re)installs requirements whenever a requirements file changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= -n 2 --durations=15

.PHONY: test install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: requirements.txt | $(PY)
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

$(VENV)/.installed-test: requirements.txt requirements-test.txt $(VENV)/.installed
	$(PY) -m pip install --quiet -r requirements-test.txt
	touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed-test
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
