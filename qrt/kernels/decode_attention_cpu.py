"""qrt's AVX-512 decode attention (csrc/decode_attention_cpu.cpp) in place of
`qrt::decode_attention` (decode_attention_reference.py).

Per (row, KV head, chunk of 128 entries) one thread reads each K and V row once for all the
query heads that share it, from the cache as it lies (bf16 rows multiplied as bf16 pairs; fp16,
fp32, or e4m3 bytes widened to fp32), and the thread that finishes a (row, KV head)'s last chunk
merges its chunks in a fixed order. A row's result depends on its own extent only, never on its
batch, on the thread count or on which thread merges.

Attention sinks (gpt-oss: a logit per query head in the softmax's denominator) join the merge of
each (row, KV head)'s chunks.

Numerics: fp32 throughout, as the reference; they differ in summation order, the chunked merge
and a polynomial exp (within 2 ulp of expf), then agree on the rounding to the model dtype.
"""

from . import native_cpu
from .choices import Kernel, declare
from .decode_attention_reference import KV_CACHE

_SUPPORTED_HEAD_DIM_MAX = 512
_SUPPORTED_GROUP_MAX = 16


def _accepts(head_dim: int = 0, group: int = 1, **facts) -> bool:
    return (head_dim % 16 == 0 and 0 < head_dim <= _SUPPORTED_HEAD_DIM_MAX and group <= _SUPPORTED_GROUP_MAX
            and native_cpu.available())


declare(Kernel(
    "qrt_cpu.decode_attention", devices=("cpu",), serves=("qrt.decode_attention",), replaces="qrt.decode_attention",
    layout=KV_CACHE, recorded_as="attention_kernel", preference=-10, accepts=_accepts,
    why="CPU: qrt's AVX-512 kernel, each K/V row read once in place for the query heads sharing it"))
