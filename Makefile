# The two commands of the README. Each creates .venv on first use and
# (re)installs requirements whenever a requirements file changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= -n 2 --durations=15

.PHONY: demo test install clean

# The demo: the committed tiny dense teacher (assets/tiny_teacher, made by
# train.py: see its README) -> convert.py -> eval.py, three-way report.
DEMO_DIR ?= results/demo
DEMO_TEACHER ?= assets/tiny_teacher
# Its training tokens over both runs (assets/tiny_teacher/README.md); 0 reads
# them from the teacher's config.json (its last run only).
DEMO_TEACHER_TOKENS ?= 31948800

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

demo: $(VENV)/.installed
	$(PY) convert.py --config=configs/convert_tiny.py \
	  --config.teacher.checkpoint=$(DEMO_TEACHER) \
	  --config.teacher.train_tokens=$(DEMO_TEACHER_TOKENS) \
	  --workdir=$(DEMO_DIR)/convert
	$(PY) eval.py --config=configs/eval_tiny.py \
	  --config.checkpoint=$(DEMO_DIR)/convert \
	  --config.teacher=$(DEMO_TEACHER) --out=$(DEMO_DIR)/eval
	@echo "demo done: $(DEMO_DIR)/convert/report.md (conversion)," \
	  "$(DEMO_DIR)/eval/report.md and $(DEMO_DIR)/eval/*.png (evaluation)"

test: $(VENV)/.installed-test
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
