"""The contract that models and formats share: `Linear` and its `LinearMethod`, how tensors split
between tensor-parallel ranks, the experts of a mixture-of-experts block, the dense method, and
the pass that repacks loaded weights for the device's kernels."""
