"""Quantization formats: the registry (registry.py), one module per format, which registers
itself, the list of them (catalog.py), the QuantScheme a model gets (scheme.py) and how a
checkpoint and `quant=` resolve to one (resolve.py). Importing this package imports no format."""
