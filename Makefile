# Two commands on a fresh machine with Python 3.11 and make:  make demo  and  make test
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0

.PHONY: demo test lint bench clean

# torch first, pinned: the local CPU wheel; the project's own floor (torch>=2.4) is then already met.
$(VENV)/.installed: pyproject.toml setup.py $(wildcard quantizers/_gguf_kernels*.[ch] quantizers/_matmul_kernels*.[ch] modelkit/storage/_*.c)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[all,dev]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m modelkit demo

test: $(VENV)/.installed
	$(PY) -m pytest -n 2 --dist loadgroup

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache build *.egg-info
