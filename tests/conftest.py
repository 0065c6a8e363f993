"""Shared fixtures: tiny checkpoints and compiled models, made once per session because
compiling dominates the suite's time on two cores."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

# Every test process starts with an empty compile cache of qrt's own, in a folder of its own, so
# that a test sees a model compiled or loaded as its own process made it. The converted default
# model is reused from the user's cache when it is there (converting it again costs seconds and
# tests nothing new).
_user_cache = Path(os.environ.get("QRT_CACHE_DIR") or "~/.cache/qrt").expanduser()
_run_cache = Path(tempfile.mkdtemp(prefix="qrt-test-cache-"))
atexit.register(shutil.rmtree, _run_cache, ignore_errors=True)
if (_user_cache / "models").is_dir():
    (_run_cache / "models").symlink_to((_user_cache / "models").resolve())
os.environ["QRT_CACHE_DIR"] = str(_run_cache)

# Inductor's caches (generated code, compiled C++ kernels, FX and AOTAutograd graphs) are shared by
# the workers of a run and kept between runs, in the user's cache folder (QRT_TEST_INDUCTOR_CACHE
# names another), as Inductor keeps its own in /tmp by default: the suites compile the same tiny
# models in many processes, and Inductor keys each entry on the graph's own contents, so a hit is
# the code a cold compile would have made. Dynamo still traces, and qrt's passes still run, in
# every process. A warm folder takes about a quarter of a cold one's time to compile the producers'
# GPTQ variants (35 s against 135 on the AVX2 EPYC). Past TEST_INDUCTOR_CACHE_LIMIT it is emptied
# before a run; the workers of pytest-xdist inherit the variable from the process that starts them.
TEST_INDUCTOR_CACHE_LIMIT = 8 << 30  # bytes
if "QRT_TEST_INDUCTOR_CACHE" not in os.environ:
    os.environ["QRT_TEST_INDUCTOR_CACHE"] = str(_user_cache / "test-inductor")
_inductor_cache = Path(os.environ["QRT_TEST_INDUCTOR_CACHE"])
if "PYTEST_XDIST_WORKER" not in os.environ and _inductor_cache.is_dir():
    if sum(f.stat().st_size for f in _inductor_cache.rglob("*") if f.is_file()) > TEST_INDUCTOR_CACHE_LIMIT:
        shutil.rmtree(_inductor_cache, ignore_errors=True)
_inductor_cache.mkdir(parents=True, exist_ok=True)
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ["QRT_TEST_INDUCTOR_CACHE"]

# Under pytest-xdist (`make test` runs two workers), the cores are shared out among the workers:
# two workers each running two OpenMP threads on two cores spend their time spinning against each
# other. Set before torch is imported, so that torch and every process a test starts inherit it.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _cores = len(os.sched_getaffinity(0))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# Triton kernels run on the CPU only in interpreter mode, which must be chosen before triton is
# first imported: here, before any test module imports a kernel file.
import torch  # noqa: E402  (importing torch does not import triton)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Autotuning decode's matmuls costs seconds per compiled model; the suite compiles dozens.
# tests/test_compile.py covers the autotuned path once.
os.environ.setdefault("QRT_AUTOTUNE", "0")

import pytest

from helpers.checkpoints.tiny import make_checkpoint
from qrt import runtime


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_checkpoint(folder, "llama")
    return folder


@pytest.fixture(scope="session")
def chat_llama_dir(tmp_path_factory):
    """The tiny Llama with a byte-level tokenizer and a ChatML template: text in, text out."""
    from tiny_tokenizer import write_tokenizer

    folder = tmp_path_factory.mktemp("tiny-chat-llama")
    make_checkpoint(folder, "llama", seed=3, max_position_embeddings=2048)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def chat_model(chat_llama_dir):
    """chat_llama_dir compiled with four KV-cache slots of 2048 tokens: what tests/test_server.py
    serves, so that its server process finds these graphs in the run's compile cache."""
    return runtime.compile_model(chat_llama_dir, progress=False, max_seq_len=2048, max_batch_size=4)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    make_checkpoint(folder, "qwen2", seed=1)
    return folder


@pytest.fixture(scope="session")
def tied_llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-tied")
    make_checkpoint(folder, "llama", seed=2, tie=True)
    return folder


@pytest.fixture(scope="session")
def hf_model():
    """transformers' model for a checkpoint folder, cached per folder."""
    import transformers

    cache = {}

    def load(folder):
        if folder not in cache:
            cache[folder] = transformers.AutoModelForCausalLM.from_pretrained(
                str(folder), dtype=torch.float32).eval()
        return cache[folder]

    return load


def _lost_its_graphs(model) -> bool:
    """True when a Dynamo reset (torch._dynamo.explain makes one) discarded the graphs `model` had
    traced: its next call would compile again, which tests of recompiles must not see. (Graphs
    loaded from the compile cache were never Dynamo's.)"""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return any(any(not report.loaded for report in backend.log.graphs)
               and not _debug_get_cache_entry_list(model.graph_functions[role]._torchdynamo_orig_callable)
               for role, backend in model.backends.items())


@pytest.fixture(scope="session")
def compiled():
    """compile_model(folder, quant) cached per (folder, quant): each compile costs seconds."""
    cache = {}

    def get(folder, quant=None, dtype=None):
        key = (str(folder), quant, dtype)
        if key not in cache or _lost_its_graphs(cache[key]):
            cache[key] = runtime.compile_model(folder, quant=quant, dtype=dtype, progress=False, max_seq_len=128)
        return cache[key]

    return get


@pytest.hookimpl(trylast=True)  # after `-m` has deselected what this run leaves out
def pytest_collection_modifyitems(items):
    """Under pytest-xdist, which deals out whole files (or xdist_group groups) in the order in
    which `items` first names them (--no-loadscope-reorder): tests marked runs_first first, the
    others after them, each part with the files that hold more tests first. A file of minutes
    dealt out last would leave one worker running it alone."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    by_size = [item for tests in sorted(files.values(), key=len, reverse=True) for item in tests]
    items[:] = sorted(by_size, key=lambda item: item.get_closest_marker("runs_first") is None)
