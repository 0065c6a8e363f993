"""Tensor parallelism at tp=2 on the CPU: two gloo ranks started by torchrun, one thread each,
whose all-reduces go through shared memory (and through gloo with QRT_SHM_ALLREDUCE=0).

Every registered format (the contract cases of helpers/checkpoints/format_cases) and the
architectures whose layouts differ (KV heads split or replicated, q/k/v fused on disk, Gemma 2's
soft-caps) load sharded with logits matching tp=1 and identical greedy tokens; a compiled model
keeps one graph per role with no recompiles on either rank; a combination that cannot be split is
refused before any weight is read; a failing rank makes every rank exit; each rank holds about half
the weights."""

import json
import math
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from bench.tools.random_llama import write_random_llama
from bench.tp import torchrun_localhost
from helpers.checkpoints import marlin24, tiny, w8a8
from helpers.checkpoints.architectures import make_arch_checkpoint
from helpers.checkpoints.format_cases import CASES
from helpers.checkpoints.fp8 import make_fp8_checkpoint
from helpers.checkpoints.integer import make_int_checkpoint
from helpers.checkpoints.moe import make_moe_checkpoint
from helpers.checkpoints.tiny import make_checkpoint, random_ids
from helpers.compare import relative_l2
from helpers.tp_worker import teacher_forced_logits
from test_format_contract import TOLERANCE

from qrt import runtime
from qrt.checkpoint.source import SafetensorsCheckpoint
from qrt.checkpoint.config import DeviceConfig, LoadConfig
from qrt.errors import ConfigError, UnsupportedError
from qrt.checkpoint.loader import load_model
from qrt.formats.resolve import resolve_scheme
from qrt.kernels import native_cpu
from qrt.layers.tensor_parallel import Parallelism
from qrt.runtime.registry import ModelRegistry

# Ranks on one host all-reduce through shared memory, with qrt's library; through gloo without it.
HOST_ALL_REDUCE = "shm" if native_cpu.available() else "gloo"

WORKER = Path(__file__).parent / "helpers" / "tp_worker.py"
TIMEOUT_S = 300  # every torchrun below ends well within this, or the test fails
IDS = random_ids(0, (2, 12)).tolist()
PROMPT = list(range(20, 31))
STEPS = 12


@contextmanager
def shapes_that_split_in_two():
    """The format cases' tiny shapes, widened so that tp=2 splits every layer on whole groups,
    packed words and blocks: heads of 64 (QQQ and marlin-24 permute runs of 64 output channels),
    o_proj and down_proj with 128 and 256 input channels per rank."""
    wide = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    with pytest.MonkeyPatch.context() as patch:
        for shapes in (tiny.TINY, w8a8.QQQ_TINY, marlin24.MARLIN24_TINY):
            for key, value in wide.items():
                patch.setitem(shapes, key, value)
        yield


def torchrun_two(program: list[str], env=None) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 PROGRAM…` on 127.0.0.1, one thread per rank."""
    return torchrun_localhost(2, program, {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, TIMEOUT_S)


def torchrun(jobs: list[dict], folder: Path, env=None) -> subprocess.CompletedProcess:
    """The worker over `jobs` on two ranks; its results land in folder/results.pt."""
    jobs_path = folder / "jobs.json"
    jobs_path.write_text(json.dumps(jobs))
    return torchrun_two([str(WORKER), str(jobs_path), str(folder / "results.pt")], env)


def run_sharded(jobs, folder, env=None) -> dict:
    done = torchrun(jobs, folder, env)
    assert done.returncode == 0, done.stderr[-6000:]
    return torch.load(folder / "results.pt")


def job(name, path, quant=None, compile=False, dtype=None) -> dict:
    return dict(name=name, path=str(path), quant=quant, compile=compile, ids=IDS, prompt=PROMPT, steps=STEPS,
                dtype=dtype)


def single_rank(path, quant=None, prompt=PROMPT, dtype=None):
    model = runtime.compile_model(path, quant, compile=False, progress=False, max_seq_len=128, dtype=dtype)
    with torch.no_grad():
        logits = model(torch.tensor(IDS))
    return logits, model.generate(prompt, max_new_tokens=STEPS, stop_at_eos=False)


@pytest.fixture(scope="module")
def format_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-formats")
    folders = {}
    with shapes_that_split_in_two():
        baseline = root / "llama"
        make_checkpoint(baseline, "llama")
        for name, case in CASES.items():
            folder = baseline if case.write is None else root / name.replace(":", "-").replace(" ", "-")
            if case.write is not None:
                case.write(folder)
            folders[name] = folder
    return folders


# Sharding changes only the summation order, except where activations are quantized per token at
# run time: a row-parallel rank quantizes its part of each input row, with that part's range (as
# vLLM does), so the two runs carry different draws of the activation rounding noise, which is
# bounded here by about the size of that rounding itself; greedy tokens of a random tiny model,
# whose top logits nearly tie, may part ways.
# Elsewhere an fp32 model sharded in two sums each row-parallel output in two halves and adds
# them: a rounding of about 2**-24 per add on sums of a few hundred terms, a relative error of
# order 1e-7 on the logits, compounded over the layers; 1e-5 leaves room for that and nothing else.
# Block fp8 (compressed-tensors float-quantized) quantizes activations per group of 128 at run time.
# tp=2 splits on whole groups, so each group gets the scale it gets at tp=1, but its inputs differ
# in their last bits (summation order), which now and then moves one value across an e4m3 rounding
# edge: a step of up to 1/16 of that value. One such flip moved the logits by 3.2e-4 here, and the
# greedy tokens of the random tiny model parted after it; 1e-2 is the format contract's bound.
SUMMATION_ORDER = 1e-5
ACTIVATIONS_ROUNDED_AT_RUN_TIME = {"stored:fp8": 0.08, "online:fp8": 0.08, "online:w8a8": 0.04,
                                   "compressed-tensors:float-quantized": 1e-2}


# A model loaded in bf16 rounds each rank's row-parallel partial sums to bf16 before they are
# added, where tp=1 rounds the whole sum once: its logits move by a bf16 step or two (measured on
# the MXFP4 case: 0.6% relative, at most 0.0078 on logits near 0.8, whose step is 0.0039). The
# random tiny model's top two logits are often that close (one step apart at the 11th token of
# that case), so tp=2's greedy tokens may leave tp=1's, but only at a step where tp=1 itself
# rates the two tokens within two bf16 steps of each other.
BF16_STEPS_OF_A_TIE = 2


def parts_only_at_a_tie(folder, case, expected: list[int], got: list[int]) -> bool:
    """Whether `got` equals `expected` (tp=1's greedy tokens after PROMPT), or first differs at a
    step where tp=1's logit for got's token is within BF16_STEPS_OF_A_TIE bf16 steps of its
    logit for expected's."""
    step = next((i for i, (ours, theirs) in enumerate(zip(expected, got)) if ours != theirs), None)
    if step is None:
        return True
    model = runtime.compile_model(folder, case.quant, compile=False, progress=False, max_seq_len=128, dtype=case.dtype)
    with torch.no_grad():  # the logits that chose expected[step]: [V]
        logits = teacher_forced_logits(model, PROMPT + expected[:step], len(PROMPT))[-1]
    top = logits[expected[step]].item()
    bf16_step = 2.0 ** (math.floor(math.log2(abs(top))) - 7)  # bf16 keeps 7 fraction bits
    return top - logits[got[step]].item() <= BF16_STEPS_OF_A_TIE * bf16_step


# The tests that read the one two-rank torchrun of every format case, architecture and GPTQ layout
# (the `sharded` fixture, about 30 s) run in `make test-slow`, to keep the quick loop in its budget.
@pytest.mark.slow
def test_every_format_shards_with_logits_and_greedy_tokens_of_one_rank(format_folders, sharded):
    failures = []
    for name, folder in format_folders.items():
        logits, tokens = single_rank(folder, CASES[name].quant, dtype=CASES[name].dtype)
        got = sharded[name]
        error = relative_l2(got["logits"], logits)
        if name in ACTIVATIONS_ROUNDED_AT_RUN_TIME:
            if error > ACTIVATIONS_ROUNDED_AT_RUN_TIME[name]:
                failures.append(f"{name}: logits off by {error:.2e}")
        elif CASES[name].dtype == "bfloat16":
            if error > TOLERANCE[name] or not parts_only_at_a_tie(folder, CASES[name], tokens, got["tokens"]):
                failures.append(f"{name}: logits off by {error:.2e}, tokens {got['tokens']} vs {tokens}")
        elif error > TOLERANCE.get(name, SUMMATION_ORDER) or got["tokens"] != tokens:
            failures.append(f"{name}: logits off by {error:.2e}, tokens {got['tokens']} vs {tokens}")
        # Every rank computes the same logits, bit for bit (the tokens are rank 0's, broadcast).
        if not torch.equal(got["ranks"][0]["logits"], got["ranks"][1]["logits"]):
            failures.append(f"{name}: the ranks' logits differ")
        # Both ranks are on this host's CPU: their all-reduces go through shared memory (gloo where
        # qrt's library, which holds the shared-memory all-reduce, is not built).
        if [rank["all_reduce_path"] for rank in got["ranks"]] != [HOST_ALL_REDUCE] * 2:
            failures.append(f"{name}: all-reduces through {[rank['all_reduce_path'] for rank in got['ranks']]}")
    assert not failures, "\n".join(failures)


def test_switched_off_shared_memory_the_ranks_reduce_through_gloo_alike(format_folders, tmp_path):
    got = run_sharded([job("none", format_folders["none"])], tmp_path, env={"QRT_SHM_ALLREDUCE": "0"})["none"]
    logits, tokens = single_rank(format_folders["none"])
    assert [rank["all_reduce_path"] for rank in got["ranks"]] == ["gloo", "gloo"]
    assert relative_l2(got["logits"], logits) < SUMMATION_ORDER
    assert got["tokens"] == tokens
    assert torch.equal(got["ranks"][0]["logits"], got["ranks"][1]["logits"])


@pytest.fixture(scope="module")
def arch_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-archs")
    folders = {"qwen2 kv=2": root / "qwen2", "qwen2 kv=1": root / "qwen2-kv1", "phi3": root / "phi3",
               "gemma2": root / "gemma2", "mixtral": root / "mixtral", "qwen2_moe": root / "qwen2_moe"}
    for moe in ("mixtral", "qwen2_moe"):  # each rank holds its part of every expert's intermediate features
        make_moe_checkpoint(folders[moe], moe, seed=3)
    make_checkpoint(folders["qwen2 kv=2"], "qwen2", seed=1)
    make_checkpoint(folders["qwen2 kv=1"], "qwen2", seed=2, num_key_value_heads=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(tiny.TINY, "intermediate_size", 256)
        make_arch_checkpoint(folders["phi3"], "phi3")
        make_arch_checkpoint(folders["gemma2"], "gemma2")
    return folders


@pytest.fixture(scope="module")
def gptq_in_order_folders(tmp_path_factory):
    """GPTQ without act-order, with the g_idx (k // G) that GPTQModel writes for every layer."""
    root = tmp_path_factory.mktemp("tp-gptq")
    folders = {}
    with shapes_that_split_in_two():
        for sym in (True, False):
            name = f"gptq g32 {'sym' if sym else 'asym'}"
            config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": sym}
            folders[name] = root / name.replace(" ", "-")
            make_int_checkpoint(folders[name], "gptq", config, bits=4, group_size=32, sym=sym, seed=5)
    return folders


# int4 compiled: quantized layers on ATen's int4 kernel, an int8 lm_head, a bf16 embedding. With a
# one-token prompt (a decode step) only the decode graph, the hot loop, compiles on each rank:
# prefill and forward would be two more compiles in the default test run.
COMPILED = "compiled online:int4"
ONE_TOKEN = [PROMPT[0]]


@pytest.fixture(scope="module")
def sharded(format_folders, arch_folders, gptq_in_order_folders, llama_172mb, tmp_path_factory):
    """One torchrun run at tp=2 of every format case and architecture, and one compiled model.
    The memory test's model loads second: after a tiny model, which brings in what the first
    load imports, and before the others, while the peak RSS is still its own."""
    jobs = [job("none", format_folders["none"]), memory_job(llama_172mb)]
    jobs += [job(name, folder, CASES[name].quant, dtype=CASES[name].dtype) for name, folder in format_folders.items()
             if name != "none"]
    jobs += [job(name, folder) for name, folder in {**arch_folders, **gptq_in_order_folders}.items()]
    jobs.append(dict(job(COMPILED, format_folders["online:int4"], "int4", compile=True), forward=False,
                     prompt=ONE_TOKEN, again_prompt=[PROMPT[1]]))
    return run_sharded(jobs, tmp_path_factory.mktemp("tp-run"))


@pytest.mark.slow
def test_architectures_shard_kv_heads_split_replicated_and_fused_on_disk(arch_folders, sharded):
    for name, folder in arch_folders.items():
        logits, tokens = single_rank(folder)
        got = sharded[name]
        assert relative_l2(got["logits"], logits) < SUMMATION_ORDER, name
        assert got["tokens"] == tokens, name
        assert torch.equal(got["ranks"][0]["logits"], got["ranks"][1]["logits"]), name
    # Qwen2 with one KV head: both ranks hold it whole (q/k/v rows: 2 q heads + k + v of 16).
    shapes = [rank["shapes"] for rank in sharded["qwen2 kv=1"]["ranks"]]
    assert [s["model.layers.0.self_attn.qkv_proj.weight"] for s in shapes] == [[64, 64], [64, 64]]
    assert [s["model.layers.0.self_attn.o_proj.weight"] for s in shapes] == [[64, 32], [64, 32]]
    assert [s["model.embed_tokens.weight"] for s in shapes] == [[192, 64], [192, 64]]  # 300 padded to 2 x 192
    # Qwen2-MoE: 6 experts of 64 intermediate features, 32 on each rank; the router whole on both.
    shapes = [rank["shapes"] for rank in sharded["qwen2_moe"]["ranks"]]
    assert [s["model.layers.0.mlp.experts.gate_up_proj.weight"] for s in shapes] == [[6, 64, 64]] * 2
    assert [s["model.layers.0.mlp.experts.down_proj.weight"] for s in shapes] == [[6, 64, 32]] * 2
    assert [s["model.layers.0.mlp.gate.weight"] for s in shapes] == [[6, 64]] * 2


@pytest.mark.slow
def test_gptq_without_act_order_shards_its_group_indices(gptq_in_order_folders, sharded):
    # Each rank holds the groups of its own input channels and numbers them from 0; the stored
    # g_idx numbers them from the layer's first group. Loaded one after another in one process.
    for name, folder in gptq_in_order_folders.items():
        logits, tokens = single_rank(folder)
        got = sharded[name]
        assert relative_l2(got["logits"], logits) < 1e-5, name
        assert got["tokens"] == tokens, name


@pytest.mark.slow
def test_compiled_sharded_model_keeps_one_graph_per_role_on_every_rank(format_folders, sharded):
    _, tokens = single_rank(format_folders["online:int4"], "int4", prompt=ONE_TOKEN)
    got = sharded[COMPILED]
    assert got["tokens"] == tokens
    # One prefill graph (a one-token prompt runs in it, padded) and one decode graph, also after
    # decoding again under fail_on_recompile.
    for rank in got["ranks"]:
        assert rank["report"] == {"prefill": 1, "decode": 1, "forward": 0}, rank["report"]


# ---- refusals: from the headers and the config alone, before any weight is read ---------------
def _load_as_rank(folder, tp: int, quant=None, rank=0):
    checkpoint = SafetensorsCheckpoint(folder)
    model_cls = ModelRegistry.resolve(checkpoint.hf_config, source=checkpoint.config_path)
    scheme = resolve_scheme(checkpoint.hf_config, quant, checkpoint.config_path, checkpoint.folder)
    return load_model(model_cls, checkpoint, scheme, LoadConfig(progress=False), DeviceConfig(),
                      Parallelism(tp, rank, None))


def test_a_g_idx_that_contradicts_no_act_order_is_refused_at_tp2(tmp_path):
    # desc_act false, but the group indices move channels between groups: a rank that holds only
    # its own channels' groups cannot run them, and says what to change.
    folder = tmp_path / "gptq"
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    with shapes_that_split_in_two():
        make_int_checkpoint(folder, "gptq", config, bits=4, group_size=32, act_order=True)
    with pytest.raises(UnsupportedError, match=r"o_proj.g_idx: the group indices reorder input channels across "
                                               r"groups.*set desc_act/actorder in the config.*or run with tp=1"):
        _load_as_rank(folder, 2, rank=1)


def test_heads_that_do_not_split_are_refused_with_the_largest_tp_that_works(llama_dir):
    with pytest.raises(UnsupportedError, match=r"num_attention_heads: cannot shard 4 heads split evenly between 3 "
                                               r"ranks.*largest tp that works is 2"):
        _load_as_rank(llama_dir, 3)


def test_groups_that_a_split_would_cut_are_refused_before_reading(tmp_path, monkeypatch):
    # The suite's tiny shapes: down_proj has 160 input channels, 80 per rank, not whole groups of 32.
    folder = tmp_path / "gptq"
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    make_int_checkpoint(folder, "gptq", config, bits=4, group_size=32)
    from qrt.checkpoint import safetensors_files

    def no_reads(*args, **kwargs):
        raise AssertionError("a weight was read before the refusal")

    monkeypatch.setattr(safetensors_files.StoredTensor, "_rows", no_reads)
    with pytest.raises(UnsupportedError, match=r"mlp.down_proj: split into 2 parts of 80 input features, "
                                               r"'model.layers.0.mlp.down_proj.(qzeros|scales)' does not divide on whole "
                                               r"entries.*largest tp this layer allows is 1"):
        _load_as_rank(folder, 2)


@pytest.mark.parametrize("family", ["hf-fp8-block", "ct-fp8-block"])
def test_block_fp8_rows_that_split_a_block_take_that_blocks_scale(tmp_path, family):
    # Blocks of 32 rows; k_proj and v_proj have 32 rows (2 KV heads of 16), so each rank holds half
    # a block of each, and the ranks' q/k/v layers start their k and v rows mid-block. Each rank's
    # dequantized weight must be its rows of tp=1's, exactly: only which grid row holds a block's
    # scale changes. (intermediate 192: the row-parallel down_proj splits on whole blocks of K.)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(tiny.TINY, "intermediate_size", 192)
        make_fp8_checkpoint(tmp_path, family)
    whole = _dequantized_linears(_load_as_rank(tmp_path, 1))
    ranks = [_dequantized_linears(_load_as_rank(tmp_path, 2, rank=rank)) for rank in (0, 1)]
    qkv = "model.layers.0.self_attn.qkv_proj"
    q_rows, kv_rows = 64, 32  # q, then k and v, in tp=1's layer; each rank has half of each
    assert [rank[qkv][1] for rank in ranks] == [(16, 32)] * 2, "expected a scale row per 16 rows at tp=2"
    assert whole[qkv][1] == (32, 32)
    for start, rows in ((0, q_rows), (q_rows, kv_rows), (q_rows + kv_rows, kv_rows)):
        halves = [rank[qkv][0][start // 2: (start + rows) // 2] for rank in ranks]
        assert torch.equal(torch.cat(halves), whole[qkv][0][start: start + rows]), (start, rows)
    for name in ("model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.o_proj"):
        column_parallel = name.endswith("gate_up_proj")
        for rank, part in enumerate(ranks):
            expected = (whole[name][0].view(2, 2, 96, 64)[:, rank].reshape(192, 64) if column_parallel
                        else whole[name][0].chunk(2, dim=1)[rank])
            assert torch.equal(part[name][0], expected), (name, rank)


def _dequantized_linears(model) -> dict:
    """Each block-fp8 linear's dense float32 weight and the (rows, columns) its scale grid runs in."""
    from qrt.kernels.fp8_block_reference import dequantize_block_fp8
    found = {}
    for name, module in model.named_modules():
        block = getattr(module, "weight_block", None)
        if block is not None:
            scale = getattr(module, module.quant_method.cfg.scale_name).data
            found[name] = (dequantize_block_fp8(module.weight.data, scale, *block, torch.float32), block)
    return found


def test_tp_without_torchrun_names_the_command(llama_dir):
    with pytest.raises(ConfigError, match=r"torchrun --nproc-per-node 2 -m qrt generate PATH --tp 2"):
        runtime.compile_model(llama_dir, tp=2, compile=False, progress=False)


# ---- the command line -----------------------------------------------------------------------------
@pytest.mark.slow  # a torchrun run of its own; the default run is at its time budget
def test_inspect_shows_each_ranks_shard_shapes(format_folders):
    done = torchrun_two(["-m", "qrt", "inspect", str(format_folders["none"]), "--tp", "2", "--tensors", "0"])
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.count("checkpoint:") == 1  # rank 0 describes the checkpoint once
    rank0, rank1 = out.index("rank 0 of 2"), out.index("rank 1 of 2")
    assert rank0 < rank1  # the ranks' tables in rank order, not interleaved
    # heads of 64: q/k/v rows 2 q heads + k + v of one head each; o_proj 128 of 256 input channels
    for table in (out[rank0:rank1], out[rank1:]):
        assert re.search(r"model\.layers\.0\.self_attn\.qkv_proj\s+bf16\s+256x256\s+column", table), table
        assert re.search(r"model\.layers\.0\.self_attn\.o_proj\s+bf16\s+256x128\s+row", table), table


@pytest.mark.slow  # compiles three graphs on each rank
def test_dump_lists_the_collectives_of_each_rank(format_folders, tmp_path):
    done = torchrun_two(["-m", "qrt", "dump", str(format_folders["none"]), "--tp", "2", "--no-cache",
                         "--out", str(tmp_path / "dump"), "--decode-steps", "2"])
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        index = (tmp_path / "dump" / f"rank{rank}" / "index.md").read_text()
        assert f"tensor parallel: rank {rank} of 2" in index
        assert "graphs compiled: {'prefill': 1, 'decode': 1, 'forward': 1}" in index, index
        assert "ok: 2 decode steps under torch.compiler.set_stance('fail_on_recompile'), no recompiles" in index
        assert "- prefill: 1 graph(s), 0 break(s)" in index and "- decode: 1 graph(s), 0 break(s)" in index
        # each role: two all-reduces in the layer body, one for the embedding (through shared
        # memory: both ranks are on this host; gloo's, each waited for, without qrt's library), one
        # gather of the logits (gloo's, waited for)
        collectives = ("shm_all_reduce x3, wait_tensor x1" if HOST_ALL_REDUCE == "shm"
                       else "all_reduce x3, wait_tensor x4")
        for role in ("prefill", "decode", "forward"):
            assert f"- {role} graph 0: all_gather_into_tensor x1, {collectives}" in index, index


# ---- faults -------------------------------------------------------------------------------------
def test_a_failing_rank_makes_every_rank_exit_with_its_error(format_folders, tmp_path):
    """Rank 1 gets a checkpoint with a tensor of the wrong shape; rank 0 would wait for it in its
    first collective. torchrun stops both and exits non-zero, with rank 1's error in the output."""
    bad = tmp_path / "bad"
    tiny.edited_copy(format_folders["none"], bad, tensors=lambda state: state.update(
        {"model.layers.1.mlp.up_proj.weight": torch.zeros(3, 3, dtype=torch.bfloat16)}))
    jobs = [job("faulty", format_folders["none"])]
    done = torchrun(jobs, tmp_path, env={"QRT_TP_TEST_BAD_RANK_PATH": str(bad)})
    assert done.returncode != 0
    assert "model.layers.1.mlp.up_proj.weight" in done.stderr, done.stderr[-3000:]


def test_a_world_size_other_than_tp_is_refused(llama_dir):
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match=r"tp=3, but the process group has 1 ranks"):
            runtime.compile_model(llama_dir, tp=3, compile=False, progress=False)
    finally:
        torch.distributed.destroy_process_group()


# ---- memory -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_172mb(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-172mb")
    write_random_llama(folder, dict(hidden_size=768, num_hidden_layers=6, intermediate_size=2048,
                                     num_attention_heads=12, num_key_value_heads=4, vocab_size=32000,
                                     max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False))
    return folder


def memory_job(folder) -> dict:
    return dict(job("memory", folder), ids=[[1, 2, 3]], prompt=[1, 2, 3], steps=1)


@pytest.mark.slow  # reads the `sharded` torchrun too
def test_each_rank_holds_its_share_of_the_weights(llama_172mb, sharded, llama_dir, tmp_path):
    """A 172 MB bf16 Llama: what loading it adds to a process's RSS (peak after loading minus RSS
    before) is at least 40% of the weights smaller on each rank at tp=2 than in one process at
    tp=1 (half the weights, less what every process holds whole: norms, transients, allocator
    slack). Each rank reads its part of each tensor, so no rank ever holds a whole one."""
    weights_mib = sum(f.stat().st_size for f in llama_172mb.glob("*.safetensors")) / 2**20
    (jobs_path := tmp_path / "one.json").write_text(json.dumps([job("warm-up", llama_dir), memory_job(llama_172mb)]))
    alone = subprocess.run([sys.executable, str(WORKER), str(jobs_path), str(tmp_path / "one.pt")], timeout=TIMEOUT_S,
                           capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert alone.returncode == 0, alone.stderr[-3000:]
    (one,) = torch.load(tmp_path / "one.pt")["memory"]["ranks"]
    one_mib = (one["rss_kib"] - one["rss_before_kib"]) / 1024
    assert one_mib > 0.9 * weights_mib, (one_mib, weights_mib)  # the whole model: a check of the measure
    for rank in sharded["memory"]["ranks"]:
        rank_mib = (rank["rss_kib"] - rank["rss_before_kib"]) / 1024
        assert one_mib - rank_mib > 0.4 * weights_mib, (one_mib, rank_mib, weights_mib)
