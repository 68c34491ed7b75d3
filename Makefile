# Two commands do all set-up on a fresh Linux machine with Python 3.11:
#   make demo   - virtualenv, install, start the dashboard on sample_runs/
#   make test   - virtualenv, install, run the whole test suite
# A torch you installed yourself (a CUDA build, say) is kept: the venv sees system site-packages,
# and torch==2.13.0 (the CPU wheel) is installed only when no torch is importable.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ampwatch-installed

.PHONY: install demo test bench samples

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/streamlit run app

test: install
	$(PY) -m pytest -q -p no:cacheprovider

bench: install
	$(PY) bench/overhead.py

samples: install
	$(VENV)/bin/ampwatch demo --out sample_runs
