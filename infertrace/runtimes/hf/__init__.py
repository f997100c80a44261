"""``--runtime hf``: HF transformers as a recorded runtime, the third convention (``dense``): the requests run
as one padded ``[B, T]`` batch with a 2-D ``attention_mask`` (left or right padding), ``position_ids`` from the
mask, HF's own ``DynamicCache``; each step records HF's own tensors (``runtime.HfRuntime``)."""
