"""The contract every registered format keeps, checked on a tiny checkpoint in its on-disk form
(tests/helpers/checkpoints/format_cases/): compiled output equal to the eager reference, one graph
per role, no recompiles over 32 decode steps, the expected kernel on the CPU and, with the CUDA
layouts and pass list, on CUDA (its Triton kernels running under the interpreter), and errors that
name the file and tensor when a tensor is missing or misshapen."""

import math

import pytest
import torch
from helpers.checkpoints.format_cases import CASES, registry_ids
from helpers.checkpoints.tiny import edited_copy, random_ids
from helpers.compare import relative_l2
from helpers.graph_checks import no_recompiles
from safetensors import safe_open

from qrt import runtime
from qrt.checkpoint.config import DeviceConfig
from qrt.errors import CheckpointError
from qrt.passes.backend import QrtBackend
from qrt.passes.manager import passes_for
from qrt.runtime.graph_runner import own_copy

DECODE_STEPS = 32
MAX_SEQ_LEN = 128  # as conftest's `compiled`, whose models the online cases share
# Compiled kernels against the eager reference ops: the same weights and the same activation
# rounding, so only summation order differs, except:
# - block fp8 on the CPU runs bf16-rounded dequantized weights;
# - the CPU int8-activation kernel returns its integer sums rounded to bf16 where the reference keeps
#   them exact, which moves some activations downstream across int8 rounding edges: the two runs
#   carry different draws of the activation rounding noise (about 1-2% of the logits each).
_INT8_ACTIVATIONS = 0.05
# - a case loaded in bf16 runs the same kernels eager and compiled, but Inductor fuses the norms,
#   the rotary embedding and the residual adds, rounding their bf16 results in other places than
#   eager's op-by-op code: measured 0.6% of the logits.
_BF16_MODEL = 0.02
TOLERANCE = {"compressed-tensors:float-quantized": 1e-2, "online:w8a8": _INT8_ACTIVATIONS,
             "compressed-tensors:int W8A8": _INT8_ACTIVATIONS, "stored:qqq": _INT8_ACTIVATIONS,
             "compressed-tensors:mxfp4-pack-quantized": _BF16_MODEL}
# Batch 2: the forward graph is compiled for one batch size, and other tests score pairs.
CONTRACT_IDS = random_ids(shape=(2, 12))


@pytest.fixture(scope="module")
def case_folder(tmp_path_factory, llama_dir):
    root = tmp_path_factory.mktemp("formats")
    made = {}

    def get(name):
        if name not in made:
            write = CASES[name].write
            made[name] = llama_dir if write is None else root / name.replace(":", "-").replace(" ", "-")
            if write is not None:
                write(made[name])
        return made[name]

    return get


@pytest.fixture(scope="module")
def compiled_case(case_folder, compiled):
    """The compiled model of a case; conftest's `compiled` caches them for the whole session."""
    return lambda name: compiled(case_folder(name), CASES[name].quant, CASES[name].dtype)


def test_every_registered_format_has_a_case():
    missing = registry_ids() - set(CASES)
    assert not missing, ("registered formats without a contract case in tests/helpers/checkpoints/format_cases/: "
                         f"{sorted(missing)}")
    assert set(CASES) - {"none"} <= registry_ids(), "a case names a format the registry no longer has"


# Compiled by default: one case per CPU kernel; these run a kernel another case compiles (their
# loaders run by default in the eager tests below), and compile in `make test-slow`. QQQ runs
# qrt.int8_linear_cpu (online:w8a8 compiles it); marlin-24, gguf, GPTQ, AWQ and compressed-tensors'
# int weight-only the int4 pack kernel (online:int4 compiles it); online:int8 the int8 pack kernel
# (online:int4's int8 lm_head compiles it); bitsandbytes and the NVFP4 formats (ModelOpt's two
# among them) qrt::lut4_linear's reference in fp32 (stored:mxfp4 compiles it); compressed-tensors'
# MXFP4 (bf16) qrt's lut4 CPU kernel, which tests/test_lut4_kernels.py compiles fullgraph.
COMPILED_IN_SLOW = {"side-file:hf_quant_config.json", "compressed-tensors:int W8A8", "online:int4-g128",
                    "stored:qqq", "compressed-tensors:marlin-24", "stored:gguf", "stored:bitsandbytes",
                    "compressed-tensors:nvfp4-pack-quantized", "stored:modelopt-nvfp4", "stored:modelopt-w4a16_nvfp4",
                    "stored:awq", "stored:gptq", "online:int8", "compressed-tensors:mxfp4-pack-quantized",
                    "compressed-tensors:int weight-only"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in COMPILED_IN_SLOW else n
                                  for n in sorted(CASES)])
def test_compiled_equals_eager_in_one_graph_per_role_with_the_cpu_kernels(name, case_folder, compiled_case):
    case = CASES[name]
    model = compiled_case(name)
    eager = runtime.compile_model(case_folder(name), case.quant, compile=False, progress=False,
                                  max_seq_len=MAX_SEQ_LEN, dtype=case.dtype)
    with torch.no_grad():
        error = relative_l2(model(CONTRACT_IDS), eager(CONTRACT_IDS))
    assert error < TOLERANCE.get(name, 1e-4), error
    model.generate([3, 4, 5], max_new_tokens=2, stop_at_eos=False)
    with no_recompiles(model):
        model.generate(list(range(20, 31)), max_new_tokens=DECODE_STEPS, stop_at_eos=False)
    assert model.compile_report() == {"prefill": 1, "decode": 1, "forward": 1}
    layers = model.model.config.num_layers
    for role in model.compile_report():  # the roles that compiled
        (graph,) = model.backends[role].log.graphs
        assert {c.kernel for c in graph.kernel_choices} == case.cpu_kernels, role
        swap = graph.passes[0]
        # Each role compiles one decoder-layer body, which every layer calls.
        assert swap.code_before.count("# ---- subgraph ") == 1, role
        assert f"called {layers}x per run" in swap.code_before, role
        for kernel in case.cpu_kernels:  # every choice made is in the graph that runs
            assert swap.ops_after.get(kernel, 0) == sum(c.kernel == kernel for c in graph.kernel_choices), (role, kernel)


@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_layouts_kernels_and_passes(name, case_folder):
    """The loader passes' CUDA layouts, the kernels recorded for them, the swap and fusion passes of
    the CUDA pass list, and the Triton kernels' output against the reference ops on those layouts."""
    case = CASES[name]
    eager = runtime.compile_model(case_folder(name), case.quant, compile=False, progress=False, max_seq_len=MAX_SEQ_LEN,
                                  device_config=DeviceConfig("cpu", kernel_device="cuda", dtype=case.dtype))
    recorded = {p.kernel for m in eager.model.modules() if getattr(m, "quant_method", None) is not None
                for p in m.parameters(recurse=False) if getattr(p, "kernel", "aten.linear") != "aten.linear"}
    assert recorded == case.cuda_kernels
    backend = QrtBackend("cuda-layouts", inductor=False, device="cuda")
    traced = torch.compile(_fresh_forward(name), backend=backend, fullgraph=True)
    with torch.no_grad():
        got, expected = traced(eager.model, CONTRACT_IDS), eager.model(CONTRACT_IDS)
    (graph,) = backend.log.graphs
    assert [record.name for record in graph.passes] == [p.name for p in passes_for("cuda")]
    assert {c.kernel for c in graph.kernel_choices} == case.cuda_kernels
    fusion = next(record for record in graph.passes if record.name == "fuse_act_quant")
    assert (fusion.changed > 0) == case.fuses_on_cuda
    assert relative_l2(got, expected) < TOLERANCE.get(name, 1e-4)


def _forward(model, ids):
    return model(ids)


def _fresh_forward(name: str):
    """_forward with a code object and name of its own (own_copy): Dynamo caches compiled graphs
    per code object, so each case's model neither recompiles nor evicts another's."""
    return own_copy(_forward, "cuda_" + "".join(ch if ch.isalnum() else "_" for ch in name))


def _breakable_tensor(folder) -> str:
    """The largest tensor of layer 0's q_proj: the one that carries the layer's weights in every format."""
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = [n for n in f.keys() if n.startswith("model.layers.0.self_attn.q_proj.")]
        return max(names, key=lambda n: math.prod(f.get_slice(n).get_shape()))


@pytest.mark.parametrize("name", sorted(CASES))
def test_missing_and_misshapen_tensors_are_named(name, case_folder, tmp_path):
    if name == "stored:gguf":
        pytest.skip("a GGUF file is edited by its writer: tests/test_gguf.py::test_a_missing_or_misshapen_gguf_tensor_is_named")
    case, folder = CASES[name], case_folder(name)
    tensor = _breakable_tensor(folder)
    missing = edited_copy(folder, tmp_path / "missing", tensors=lambda state: state.pop(tensor))
    with pytest.raises(CheckpointError) as err:
        runtime.compile_model(missing, case.quant, compile=False, progress=False, max_seq_len=MAX_SEQ_LEN)
    assert str(missing) in str(err.value) and "missing" in str(err.value)
    assert "model.layers.0.self_attn.qkv_proj" in str(err.value)

    def shrink(state):
        t = state[tensor]
        state[tensor] = t.narrow(0, 0, t.shape[0] - 1).contiguous() if t.shape[0] > 1 else t.reshape(-1)[:-1]

    misshapen = edited_copy(folder, tmp_path / "misshapen", tensors=shrink)
    with pytest.raises(CheckpointError) as err:
        runtime.compile_model(misshapen, case.quant, compile=False, progress=False, max_seq_len=MAX_SEQ_LEN)
    assert f"tensor '{tensor}'" in str(err.value) and "shape" in str(err.value)
