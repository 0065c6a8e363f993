"""bench/profiles/profile_decode.py, bench/profiles/profile_compile.py, bench/context.py,
bench/probes/decode_attention.py and bench/probes/structured_mask.py: their bookkeeping on made-up
timers and event names, and one end-to-end run each on a tiny random Llama (or the kernel alone),
so they cannot rot."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.profiles.profile_compile import PHASES, phases
from bench.profiles.profile_decode import kind_of
from helpers.checkpoints.tiny import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def test_compile_phases_subtract_the_timers_nested_inside_them():
    timers = {
        "_compile.compile_inner": 100.0, "OutputGraph.call_user_compiler": 90.0,
        "create_aot_dispatcher_function": 88.0, "compile_fx_inner": 60.0, "GraphLowering.run": 25.0,
        "mm_template_autotuning": 4.0, "addmm_template_autotuning": 6.0,
        "GraphLowering.compile_to_module": 30.0, "GraphLowering.codegen": 22.0,
    }
    got = phases(timers, freeze_s=7.0, load_s=2.0, warmup_s=103.0)
    assert list(got) == list(PHASES)
    assert got == {"load": 2.0, "Dynamo": 10.0, "qrt passes + backend": 2.0, "AOTAutograd": 21.0, "freeze": 7.0,
                   "Inductor lowering": 15.0, "autotune": 10.0, "Inductor codegen": 22.0,
                   "C++ compile + load": 8.0, "other": 8.0}


@pytest.mark.parametrize("name, kind", [
    ("graph_1_gemm_m1n3072k576_kernel", "matmul"),
    ("mkldnn::_linear_pointwise", "matmul"),
    ("qrt::int4pack_linear", "matmul"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("graph_1_cpp_fused__to_copy_add_embedding_mean_mul_pow_rsqrt_2", "fused elementwise"),
    ("## Call CompiledFxGraph None ##", "wrapper (Python)"),
    ("TorchDynamo Cache Lookup", "wrapper (Python)"),
    ("aten::argmax", "other ATen"),
])
def test_profile_events_are_sorted_into_kinds(name, kind):
    assert kind_of(name) == kind


@pytest.fixture(scope="module")
def one_layer_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("profile") / "tiny-llama"
    make_checkpoint(folder, "llama", dtype=torch.bfloat16, num_hidden_layers=1)  # 1 layer: compiles faster
    return folder


def run_bench(module: str, *args, tmp_path) -> str:
    # Autotuning off: it would time GEMMs for seconds; the bandwidth cache stays in tmp_path.
    env = {**os.environ, "QRT_AUTOTUNE": "0", "QRT_CACHE_DIR": str(tmp_path / "qrt-cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.bench  # the script end to end, about 25 s: `make test-bench`, which CI runs after `make test`
def test_profile_decode_accounts_for_the_whole_step(one_layer_llama, tmp_path):
    out = run_bench("bench.profiles.profile_decode", str(one_layer_llama), "--steps", "8", tmp_path=tmp_path)
    assert re.search(r"decode step: [\d.]+ ms without the profiler", out)
    assert re.search(r"this step reaches \d+% of it", out)
    shares = dict(re.findall(r"^(matmul|attention|fused elementwise|wrapper \(Python\)|other ATen|outside any kernel)"
                             r"\s+[\d.]+\s+(\d+)%$", out, re.M))
    assert {"matmul", "attention", "wrapper (Python)", "outside any kernel"} <= set(shares), out
    # The kinds split the profiled step: their shares add up to it, give or take rounding (and
    # nothing is left over when the events' self times exceed the step's wall time).
    assert 95 <= sum(int(share) for share in shares.values()) <= 110, out
    assert re.search(r"attention: [\d.]+ ms a step for [\d.]+ MB of K and V .*, [\d.]+× the time", out), out
    assert re.search(r"outside kernels .*: [\d.]+ ms, \d+% of the profiled step", out), out
    unprofiled = re.search(r"outside kernels without the profiler .*: ([\d.]+) ms, (\d+)% of the step", out)
    step_ms = float(re.search(r"decode step: ([\d.]+) ms without the profiler", out).group(1))
    assert unprofiled and float(unprofiled.group(1)) <= step_ms, out


def test_kv_bytes_per_step_counts_every_layers_k_and_v(one_layer_llama):
    from bench.roofline import kv_bytes_per_step
    from qrt import runtime

    model = runtime.compile_model(one_layer_llama, compile=False, progress=False, max_seq_len=64)
    attention = model.model.model.layers[0].self_attn
    per_entry = 2 * attention.num_kv_heads * attention.head_dim * attention.k_cache.element_size()  # K and V
    assert kv_bytes_per_step(model.model, 10) == 10 * per_entry
    attention.sliding_window = 4  # a sliding-window layer reads at most its window
    assert kv_bytes_per_step(model.model, 10) == 4 * per_entry


@pytest.mark.bench  # one tiny model compiled once, then loaded at a second context: about 30 s
def test_context_bench_times_each_context_with_one_cache(one_layer_llama, tmp_path):
    out = run_bench("bench.context", "--model", str(one_layer_llama), "--quant", "bf16", "--engines", "qrt",
                    "--contexts", "8,40", "--new-tokens", "4", "--runs", "1", tmp_path=tmp_path)
    assert "a KV cache of 45 entries for every context" in out, out
    assert re.search(r"^qrt bf16\s+[\d.]+ \[[\d.]+–[\d.]+\]\s+[\d.]+ \[[\d.]+–[\d.]+\]\s+[\d.]+$", out, re.M), out


@pytest.mark.bench  # kernel calls only, a few seconds
def test_decode_attention_bench_checks_then_times_the_kernel(tmp_path):
    from qrt.kernels import native_cpu

    if native_cpu.why_not_wanted() is not None:
        pytest.skip(native_cpu.why_not_wanted())
    out = run_bench("bench.probes.decode_attention", "--contexts", "16,300", "--layers", "2", "--rounds", "1",
                    tmp_path=tmp_path)
    rows = re.findall(r"^\s+(16|300)\s+(\d+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+$", out, re.M)
    assert rows == [("16", "12"), ("300", "230")], out  # K+V KB: 2 x 3 heads x C x 64 x 2 bytes


@pytest.mark.bench  # two compiles in subprocesses, about 30 s
def test_profile_compile_shows_the_warm_start_served_from_the_cache(one_layer_llama, tmp_path):
    out = run_bench("bench.profiles.profile_compile", str(one_layer_llama), tmp_path=tmp_path)
    rows = {m[0].strip(): (float(m[1]), float(m[2]))
            for m in re.findall(r"^([A-Za-z+ ]+?)\s+(-?[\d.]+)\s+(-?[\d.]+)$", out, re.M)}
    assert set(PHASES) | {"total"} <= set(rows), out
    cold, warm = rows["C++ compile + load"]
    assert warm < cold, out  # the generated kernels were compiled once, then loaded from the cache
    assert all(rows[phase][0] >= 0 for phase in PHASES if phase != "other"), out


@pytest.mark.bench  # the default model's tokenizer and a few masks, a few seconds
def test_structured_mask_bench_masks_every_row(tmp_path):
    out = run_bench("bench.probes.structured_mask", "--batch", "2", "--steps", "4", tmp_path=tmp_path)
    timing = r"vocabulary [\d.]+ s, schema [\d.]+ s, batch 2: \d+ µs per step \(p90 \d+\), \d+ µs per row$"
    assert re.search(r"^llguidance, " + timing, out, re.M), out
    # The other engines are measured where installed, and say so where not.
    for engine in ("xgrammar", "outlines-core"):
        assert re.search(rf"^{engine}, " + timing, out, re.M) or f"{engine}: not installed, skipped" in out, out


@pytest.mark.bench  # kernel calls only, a few seconds
def test_superblock_probe_checks_then_times_both_kernels_on_every_type(tmp_path):
    from qrt.kernels import native_cpu

    if native_cpu.why_not_wanted() is not None:
        pytest.skip(native_cpu.why_not_wanted())
    out = run_bench("bench.probes.cpu_superblock_options", "--shapes", "128x512", "--rounds", "1", "--in-cache",
                    tmp_path=tmp_path)
    rows = re.findall(r"^(Q\w+)\s+128x512\s+\d+\s+[\d.]+\s+([\d.]+)\s+\d+\s+[\d.]+\s+([\d.]+)\s+[\d.]+$", out, re.M)
    held = {name: (float(now), float(before)) for name, now, before in rows}
    assert set(held) == {"Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"}, out
    assert held["Q6_K"][0] == 1.0 and held["Q6_K"][1] > 1.4  # the file's bytes, against a byte a code before


@pytest.mark.bench  # transformers twice and a server on the tiny chat model: about a minute
def test_prompt_scores_probe_compares_every_path_and_the_server_bit_for_bit(chat_llama_dir, tmp_path):
    out = run_bench("bench.probes.prompt_scores", str(chat_llama_dir), "--tokens", "80", "--small-chunk", "16",
                    tmp_path=tmp_path)
    rows = dict(re.findall(r"^(qrt serve, [^\n]+?request)\s+[\d.]+\s+[\d.]+\s+(yes|no)$", out, re.M))
    # A float32 model: the served scores are the engine's, whatever the batch.
    assert rows == {"qrt serve, one prompt a request": "yes", "qrt serve, 4 prompts in a request": "yes"}, out
    assert "qrt engine, chunks of 16" in out and "transformers bf16" in out
