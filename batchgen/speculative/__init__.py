"""Speculative decoding (vLLM's ngram method): drafts proposed from a sequence's own tokens,
verified in one forward, entered through one seam (`seam.SpecSeam`, `Engine.spec`)."""
