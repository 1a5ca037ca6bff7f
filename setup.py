"""The one compiled part: GGUF block quantization kernels (quantizers/_gguf_kernels.c).

Everything else is configured in pyproject.toml. The extension is optional: where no C compiler
is found the install still succeeds and gguf_blocks.py quantizes with eager torch (same bytes,
slower; `modelkit.quantizers.gguf_blocks.ACCELERATED` tells which).
"""
from setuptools import Extension, setup

KERNELS = Extension(
    "modelkit.quantizers._gguf_kernels",
    sources=["quantizers/_gguf_kernels.c"],
    depends=["quantizers/_gguf_kernels_generic.h", "quantizers/_gguf_kernels_avx2.h",
             "quantizers/_gguf_kernels_kquants.h", "quantizers/_gguf_kernels_imatrix.h"],
    # Byte-identical to gguf-py needs IEEE float32 as written: no fused multiply-add (GCC fuses
    # by default where the CPU has FMA), no fast-math reassociation.
    extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"],
    optional=True,
)

setup(ext_modules=[KERNELS])
