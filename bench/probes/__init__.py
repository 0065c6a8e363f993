"""Kernel and library options timed side by side at fixed shapes, outside any model: the evidence
behind the choices the docs record (which kernel a format runs on the CPU, which grammar engine)."""
