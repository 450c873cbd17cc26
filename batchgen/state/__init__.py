"""Per-sequence state of non-attention mixers (conv windows, SSM / linear-attention states):
the layout probed from the model, the preallocated pool, the slot allocator the KV manager
drives, and the transformers Cache seam through which HF's own mixer code reads and writes it."""
