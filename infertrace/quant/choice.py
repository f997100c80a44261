"""Which kernel computes a quantised linear layer, torch-free: the table and the rule
:func:`infertrace.quant.source.choose_kernel` applies, with the activation dtype by name, so that
``infertrace check`` (a torch-free layer) can ask it which kernels a trace may record.

``dense`` for float types; for a GGUF block type the kernel :data:`FAST_KERNELS` names (measured in
``benchmarks/quant_kernels.py``) when the matrix packs into the int4 tile (out % 16, in % 32), else
``dequant``; a type without a decoder has none.
"""

from __future__ import annotations

#: GGUF float tensor types (read as dense matrices)
FLOAT_TYPES = ("F32", "F16", "BF16")
#: GGUF block types with a decoder (:data:`infertrace.quant.blocks.DECODERS`; a test keeps the two equal)
QUANT_TYPES = ("Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")
#: kernel per (type, activation dtype name) where one measured faster than ``dequant`` (benchmarks/README.md);
#: with float32 activations every int4 kernel is slower (torch's fp32 int4 matmul is ~10-40x its bf16 one)
FAST_KERNELS: dict[tuple[str, str], str] = {
    **{(t, "bfloat16"): "int4pack" for t in ("Q4_0", "Q4_1", "Q4_K")},
    **{(t, "bfloat16"): "int4x2" for t in ("Q5_0", "Q5_1", "Q5_K", "Q8_0")},
    ("Q6_K", "bfloat16"): "int4pair16",
}


def kernel_for(type_name: str, act_dtype: str, shape: tuple[int, int]) -> str | None:
    """The kernel for a ``[out, in]`` matrix of GGUF type ``type_name`` with ``act_dtype`` activations
    (``"float32"``, ``"bfloat16"``, ``"float16"``); None when the type has no kernel."""
    if type_name in FLOAT_TYPES:
        return "dense"
    if type_name not in QUANT_TYPES:
        return None
    k = FAST_KERNELS.get((type_name, act_dtype), "dequant")
    if k != "dequant" and (shape[0] % 16 or shape[1] % 32):  # the int4 packing's tile
        return "dequant"
    return k


def possible_kernels(type_name: str, act_dtype: str) -> set[str]:
    """Every kernel :func:`kernel_for` returns for the type and dtype, whatever the shape (empty: no kernel)."""
    return {k for k in (kernel_for(type_name, act_dtype, (16, 32)), kernel_for(type_name, act_dtype, (1, 1))) if k}
