"""The compiled parts: GGUF block quantization kernels (quantizers/_gguf_kernels.c), matrix
products on packed quantized weights (quantizers/_matmul_kernels.c), and the transposes of the Keras
layouts (modelkit/storage/_transpose.c).

Everything else is configured in pyproject.toml. The extensions are optional: where no C compiler
is found the install still succeeds; gguf_blocks.py then quantizes with eager torch (same bytes,
slower; `modelkit.quantizers.gguf_blocks.ACCELERATED` tells which), quantized layers compute by
dequantizing one layer at a time (`modelkit.quantizers.fast_linear.ISA` is None), and transposes run
in numpy tiles (`modelkit.storage.transpose.ACCELERATED`).
"""
from setuptools import Extension, setup

KERNELS = Extension(
    "modelkit.quantizers._gguf_kernels",
    sources=["quantizers/_gguf_kernels.c"],
    depends=["quantizers/_gguf_kernels_generic.h", "quantizers/_gguf_kernels_avx2.h",
             "quantizers/_gguf_kernels_kquants.h", "quantizers/_gguf_kernels_imatrix.h",
             "quantizers/_gguf_kernels_kquants_avx2.h"],
    # Byte-identical to gguf-py needs IEEE float32 as written: no fused multiply-add (GCC fuses
    # by default where the CPU has FMA), no fast-math reassociation.
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"],
    optional=True,
)

MATMUL = Extension(
    "modelkit.quantizers._matmul_kernels",
    sources=["quantizers/_matmul_kernels.c"],
    depends=["quantizers/_matmul_kernels_x86.h", "quantizers/_matmul_kernels_kquants.h", "quantizers/_matmul_kernels_decode.h",
             "quantizers/_matmul_kernels_forward.h"],
    # No -march: the SIMD kernels carry target attributes and are picked at run time.
    extra_compile_args=["-O3"],
    optional=True,
)

TRANSPOSE = Extension(
    "modelkit.storage._transpose",
    sources=["modelkit/storage/_transpose.c"],
    extra_compile_args=["-O3"],          # SSE2 (x86-64's base instruction set) where the compiler has it
    optional=True,
)

setup(ext_modules=[KERNELS, MATMUL, TRANSPOSE])
