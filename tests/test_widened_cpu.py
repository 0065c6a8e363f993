"""Dense bf16/fp16 GEMMs widened to float32 for many rows (widened_cpu.py), on random inputs."""

import pytest
import torch
import torch.nn.functional as F

from qrt.kernels.widened_cpu import MIN_ROWS_WIDENED, widened_products

widened_product = torch.ops.qrt.widened_linear


def _inputs(rows: int, dtype: torch.dtype, seed: int, n: int = 96, k: int = 160):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, MIN_ROWS_WIDENED - 1, MIN_ROWS_WIDENED, 77])
def test_matches_the_float64_product_within_one_rounding(rows, dtype):
    x, weight = _inputs(rows, dtype, seed=rows)
    exact = x.double() @ weight.double().t()  # [rows, N]
    with widened_products():
        got = widened_product(x.view(1, rows, -1), weight).view(rows, -1)
    assert got.dtype == dtype
    # One rounding to the model dtype (2**-8 of the value for bf16, 2**-11 for fp16), plus the
    # float32 sum's error, bounded by K ulps of float32 on the sum of |products|.
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    magnitude = x.double().abs() @ weight.double().abs().t()
    bound = exact.abs() * ulp + magnitude * x.shape[1] * 2.0**-24
    assert torch.all((got.double() - exact).abs() <= bound)


def test_many_rows_are_computed_in_float32_and_few_in_the_model_dtype():
    # The two paths sum in different orders, so each is recognised by its bits (at this shape; at
    # some smaller ones ATen's bf16 GEMM sums as the float32 one does).
    many_x, weight = _inputs(MIN_ROWS_WIDENED, torch.bfloat16, seed=1, n=3072, k=576)
    wide = F.linear(many_x.float(), weight.float()).bfloat16()
    assert not torch.equal(F.linear(many_x, weight), wide)  # else this test could not tell them apart
    few_x = many_x[:3]
    with widened_products():
        assert torch.equal(widened_product(many_x, weight), wide)
        assert torch.equal(widened_product(few_x, weight), F.linear(few_x, weight))
    # Outside it (a decode step's calls): never widened.
    assert torch.equal(widened_product(many_x, weight), F.linear(many_x, weight))


def test_a_dynamic_row_count_chooses_per_call_in_one_compiled_graph():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lambda x, weight: widened_product(x, weight), fullgraph=True)
    _, weight = _inputs(1, torch.bfloat16, seed=2)
    # Traced and run within widened_products, as graph_runner traces and runs a prompt graph. (At
    # 32 rows of this shape the two paths' bits differ; at 25 they happen to agree.)
    with widened_products():
        for rows in (4, MIN_ROWS_WIDENED + 9, 7, 2 * MIN_ROWS_WIDENED):
            x, _ = _inputs(rows, torch.bfloat16, seed=rows)
            x = x.view(1, rows, -1)
            torch._dynamo.mark_dynamic(x, 1, min=2, max=4096)
            expected = (F.linear(x.float(), weight.float()).bfloat16() if rows >= MIN_ROWS_WIDENED
                        else F.linear(x, weight))
            assert torch.equal(compiled(x, weight), expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("rows", [1, 2 * MIN_ROWS_WIDENED])
def test_a_graph_of_static_rows_keeps_the_model_dtype_gemm(rows):
    # A decode or verify graph: its rows must give the bits of the graphs of one slot.
    torch._dynamo.reset()
    x, weight = _inputs(rows, torch.bfloat16, seed=3, n=3072, k=576)
    compiled = torch.compile(lambda x, weight: widened_product(x, weight), fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x, weight), F.linear(x, weight))
