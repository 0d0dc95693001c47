# The two commands a new user runs: `make demo` and `make test`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test typecheck bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	# torch first: on this kind of machine torch==2.13.0 is a local CPU build; a bare `torch`
	# requirement would otherwise pull a multi-GB CUDA build.
	$(VPY) -m pip install -q "torch==2.13.0" || $(VPY) -m pip install -q "torch>=2.4"
	$(VPY) -m pip install -q -c constraints.txt -e ".[test,frameworks]"
	# torchdata (Accelerate's stateful dataloader, used by tests) without its dependencies, so that
	# it cannot replace the pinned torch
	$(VPY) -m pip install -q --no-deps "torchdata==0.11.0"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VPY) examples/run_demo.py
	OMP_NUM_THREADS=1 $(VPY) examples/tiers_demo.py

# mypy over core/ and plugins/ (configured in pyproject.toml), through a tree of symlinks laid out as
# the installed package `unickpt` (mypy cannot follow setuptools' editable import hook)
typecheck: $(STAMP)
	rm -rf build/mypy && mkdir -p build/mypy/unickpt
	ln -s "$(CURDIR)"/core/* "$(CURDIR)"/plugins/* build/mypy/unickpt/
	$(VPY) -m mypy

test: typecheck
	OMP_NUM_THREADS=1 $(VPY) -m pytest -q tests

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(VPY) benchmarks/save_load.py

clean:
	rm -rf $(VENV) *.egg-info build .pytest_cache
