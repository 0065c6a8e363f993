"""What the tests share, imported as `helpers.…` (pytest puts tests/ on sys.path):

- checkpoints/: writers of tiny checkpoints in each format's exact on-disk layout, and
  format_cases/, one per registered format for the format contract test;
- activation_rounding: the activation rounding of W8A8 and FP8 formats, for the dequantized
  transformers references;
- compare: relative_l2, the error each output is measured against its reference by;
- graph_checks: what torch.compile made of a model (graph breaks, recompiles, swapped kernels);
- kernel_checks: the device, dtypes, tolerances and random inputs of the kernel tests;
- tp_worker: one rank of a tensor-parallel run, a script torchrun starts, and the
  teacher-forced logits other tests compare too;
- hopper_shared_memory: a script that compiles qrt's Triton GEMMs for sm_90 and prints their
  shared memory.

tests/tiny_tokenizer.py stays beside the tests: tests/producers imports it from there and hashes
it into the producer kit's cache key.
"""
