"""GGUF block types q8_0, q4_0, q4_1, q5_0, q5_1: llama.cpp's block quantization (C kernels, or vectorized torch).

Each row (the last dimension, GGML's ne[0]) is cut into blocks of 32 weights; each block stores
its own fp16 scale (and minimum) followed by the packed values. Byte layouts, little-endian, as
`block_q*` in ggml-common.h:

    q8_0  34 B: d f16 | qs 32 x int8                         w = d * q
    q4_0  18 B: d f16 | qs 16 B (low nibbles: w[0:16], high: w[16:32])   w = d * (q - 8)
    q4_1  20 B: d f16 | m f16 | qs 16 B                         w = d * q + m
    q5_0  22 B: d f16 | qh u32 (bit i = bit 4 of q[i]) | qs 16 B   w = d * (q - 16)
    q5_1  24 B: d f16 | m f16 | qh u32 | qs 16 B                 w = d * q + m

Quantization reproduces gguf-py's reference `gguf.quants.quantize` byte for byte (the same
float32 operations in the same order: a division stays a division, nothing is fused), and
dequantization reproduces `gguf.quants.dequantize` bit for bit; tests/test_quant_gguf.py checks
both with hypothesis.

Two implementations of quantize, with the same bytes:
- "avx2" / "generic": the C kernels in _gguf_kernels.c, which read each block once and write its
  bytes once (eager torch needs 7 to 9 passes over the data per type). Built at install time where
  a C compiler is found; "avx2" where the CPU has it. `IMPLEMENTATIONS[0]` is the one used.
- "torch": whole-tensor eager torch (the reference, and the fallback without the extension):
  blocks are a reshape, a tensor is cut into chunks of 16,384 blocks (2 MiB of float32: fewer
  torch calls, intermediates still in cache).
Either way torch's thread count of worker threads take shares of the tensor (the C kernels
release the GIL); no Python loop ever runs per block. Tensors holding NaN or infinity are refused.

Quantized tensors are `QuantizedTensor(layout="gguf", parts={"qdata": uint8 (rows, row bytes)},
params={"ggml_type": "Q4_0"})`, the form modelkit's GGUF converter reads and writes natively.
The K-quants (q2_k .. q6_k, super-blocks of 256) have their kernels in gguf_arrays; `apply`,
`quantized_tensor` and `dequantize_layout` here take them too.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from modelkit.checkpoint import LazyTensor, QuantizedTensor
from modelkit.errors import ConfigError, FormatError, MissingDependencyError, UnsupportedConversionError
from modelkit.quantizers import _modules
from modelkit.quantizers.gguf_arrays import (  # noqa: F401  (the configs are this module's too)
    BLOCK,
    KERNEL_ISAS,
    KERNEL_TYPES,
    BlockConfig,
    Q4_0Config,
    Q4_1Config,
    Q5_0Config,
    Q5_1Config,
    Q8_0Config,
    dequantize_kquants,
    in_threads,
    quantize_array,
    quantize_kquants,
    row_type,
    run_kernels,
    shares,
)
from modelkit.quantizers.gguf_recipes import checkpoint_types
from modelkit.quantizers.imatrix import read_importance
from modelkit.storage.memory import empty_bytes

# The implementations quantize can use here, fastest first ("torch" is always there; the C kernels
# where the extension was built).
IMPLEMENTATIONS: tuple[str, ...] = (*KERNEL_ISAS, "torch")

_CHUNK_BLOCKS = 16384       # 512 Ki floats (2 MiB) per chunk: measured best on a 2 MiB-L2 EPYC (8192: +10%, 65536: +30%)
_ROUND = 0.49999997         # float32(0.5 - 2**-25): trunc(|x| + this) == gguf-py's np_roundf(x) for |x| < 2**22


@dataclass(frozen=True)
class BlockType:
    """One GGUF block type: its name in ggml (`GGMLQuantizationType` member) and block geometry."""

    name: str                                       # "Q4_0"
    type_size: int                                  # bytes per block of BLOCK weights
    quantize: Callable[[torch.Tensor, torch.Tensor, _Workspace], bool]     # torch path; False: NaN or inf seen
    dequantize: Callable[[torch.Tensor], torch.Tensor]
    bits: int                                       # bits of each quantized value

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.type_size / BLOCK


class _Workspace:
    """Scratch tensors for one chunk of blocks, reused chunk after chunk by one thread."""

    def __init__(self, n: int) -> None:
        self.f = torch.empty(n, BLOCK)
        self.i = torch.empty(n, BLOCK, dtype=torch.int32)
        self.h = torch.empty(n, BLOCK // 2, dtype=torch.int32)
        self.lo = torch.empty(n, 1)
        self.hi = torch.empty(n, 1)
        self.inv = torch.empty(n, 1)

    def rows(self, n: int) -> _Workspace:
        """A view of the first n blocks (the last chunk is shorter)."""
        if n == self.f.shape[0]:
            return self
        view = object.__new__(_Workspace)
        for name, value in vars(self).items():
            setattr(view, name, value[:n])
        return view


def _inverse(d: torch.Tensor, ws: _Workspace) -> torch.Tensor:
    """id = where(d == 0, 0, 1 / d), as gguf-py computes it (1 / +-0 is +-inf, mapped to 0)."""
    return torch.reciprocal(d, out=ws.inv).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def _put_half(out: torch.Tensor, value: torch.Tensor) -> None:
    """Write float32 (n, 1) values as f16 (round to nearest even) into (n, 2) uint8 columns."""
    out.view(torch.float16).copy_(value)


def _finite(*reductions: torch.Tensor) -> bool:
    """Whether per-block maxima / minima are finite: amax and amin propagate NaN, so this is
    whether the blocks themselves are (a check on 1/32 of the data)."""
    return all(bool(torch.isfinite(r).all()) for r in reductions)


def _signed_absmax(x: torch.Tensor, ws: _Workspace) -> torch.Tensor | None:
    """Each block's value of largest magnitude, the first one where several tie (gguf-py's argmax).

    max and min decide it unless they tie in magnitude (+m and -m both present, or an all-zero
    block where the sign of zero matters); those few blocks are settled with argmax.
    None if a block holds NaN or infinity.
    """
    torch.amax(x, -1, keepdim=True, out=ws.hi)
    torch.amin(x, -1, keepdim=True, out=ws.lo)
    if not _finite(ws.hi, ws.lo):
        return None
    value = torch.where(-ws.lo > ws.hi, ws.lo, ws.hi)
    ties = (ws.hi == -ws.lo).view(-1)
    if bool(ties.any()):
        rows = ties.nonzero().view(-1)
        first = x[rows].abs().argmax(-1, keepdim=True)          # argmax returns the first maximum
        value[rows] = x[rows].gather(-1, first)
    return value


def _pack_nibbles(q: torch.Tensor, ws: _Workspace, out: torch.Tensor) -> None:
    """(n, 32) int32 levels 0..15 -> (n, 16) bytes: low nibble from w[0:16], high from w[16:32]."""
    torch.add(q[:, :BLOCK // 2], q[:, BLOCK // 2:], alpha=16, out=ws.h)      # lo | hi << 4: no carries
    out.copy_(ws.h)


_BIT_WEIGHTS = torch.arange(BLOCK, dtype=torch.int32)


def _pack_high_bits(q: torch.Tensor, out: torch.Tensor) -> None:
    """qh: bit i of a little-endian u32 is bit 4 of q[i] (np.packbits(..., bitorder="little"))."""
    bits = (q >> 4).bitwise_left_shift_(_BIT_WEIGHTS)
    word = bits.sum(-1, keepdim=True, dtype=torch.int32)      # distinct bits: the sum is their OR
    out.copy_(word.view(torch.uint8))


def _levels(f: torch.Tensor, ws: _Workspace, top: int) -> torch.Tensor:
    """trunc(f) clipped to 0..top as int32: gguf-py's .astype(uint8).clip(0, top) for f in (-1, 2 * top)."""
    return ws.i.copy_(f.clamp_(max=top))


def _q8_0(x: torch.Tensor, out: torch.Tensor, ws: _Workspace) -> bool:
    f = torch.abs(x, out=ws.f)
    amax = torch.amax(f, -1, keepdim=True, out=ws.hi)
    if not _finite(amax):
        return False
    d = amax.div_(127)                                              # d = max|x| / 127
    f.mul_(_inverse(d, ws)).add_(_ROUND)                            # |x * id| + (0.5 - 2**-25)
    sign = torch.bitwise_and(x.view(torch.int32), -0x80000000, out=ws.i)
    f.view(torch.int32).bitwise_or_(sign)                           # copysign: roundf(x * id) after trunc
    out[:, 2:].view(torch.int8).copy_(f)                            # float -> int8 truncates
    _put_half(out[:, :2], d)
    return True


def _q4_0(x: torch.Tensor, out: torch.Tensor, ws: _Workspace) -> bool:
    if (value := _signed_absmax(x, ws)) is None:
        return False
    d = value.div_(-8)                                              # d = max / -8
    torch.mul(x, _inverse(d, ws), out=ws.f).add_(8.5)
    _pack_nibbles(_levels(ws.f, ws, 15), ws, out[:, 2:])
    _put_half(out[:, :2], d)
    return True


def _q4_1(x: torch.Tensor, out: torch.Tensor, ws: _Workspace) -> bool:
    lo = torch.amin(x, -1, keepdim=True, out=ws.lo)
    hi = torch.amax(x, -1, keepdim=True, out=ws.hi)
    if not _finite(lo, hi):
        return False
    d = hi.sub_(lo).div_(15)                                        # d = (max - min) / 15
    torch.sub(x, lo, out=ws.f).mul_(_inverse(d, ws)).add_(0.5)
    _pack_nibbles(_levels(ws.f, ws, 15), ws, out[:, 4:])
    _put_half(out[:, :2], d)
    _put_half(out[:, 2:4], lo)
    return True


def _q5_0(x: torch.Tensor, out: torch.Tensor, ws: _Workspace) -> bool:
    if (value := _signed_absmax(x, ws)) is None:
        return False
    d = value.div_(-16)                                             # d = max / -16
    torch.mul(x, _inverse(d, ws), out=ws.f).add_(16.5)
    q = _levels(ws.f, ws, 31)
    _pack_high_bits(q, out[:, 2:6])
    _pack_nibbles(q.bitwise_and_(0x0F), ws, out[:, 6:])
    _put_half(out[:, :2], d)
    return True


def _q5_1(x: torch.Tensor, out: torch.Tensor, ws: _Workspace) -> bool:
    lo = torch.amin(x, -1, keepdim=True, out=ws.lo)
    hi = torch.amax(x, -1, keepdim=True, out=ws.hi)
    if not _finite(lo, hi):
        return False
    d = hi.sub_(lo).div_(31)                                        # d = (max - min) / 31
    torch.sub(x, lo, out=ws.f).mul_(_inverse(d, ws)).add_(0.5)
    q = _levels(ws.f, ws, 31)
    _pack_high_bits(q, out[:, 4:8])
    _pack_nibbles(q.bitwise_and_(0x0F), ws, out[:, 8:])
    _put_half(out[:, :2], d)
    _put_half(out[:, 2:4], lo)
    return True


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The f16 at byte `start` of each block, as (n, 1) float32."""
    return blocks[:, start:start + 2].clone(memory_format=torch.contiguous_format).view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) bytes -> (n, 32) values 0..15: low nibbles first, then high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) bytes of a little-endian u32 -> (n, 32) values 0 or 16 (bit i -> value i)."""
    word = qh.clone(memory_format=torch.contiguous_format).view(torch.int32)        # (n, 1), aligned
    return ((word >> _BIT_WEIGHTS) & 1).to(torch.uint8) << 4


def _dq8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _half(b, 0)


def _dq4_0(b: torch.Tensor) -> torch.Tensor:
    return _half(b, 0) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _dq4_1(b: torch.Tensor) -> torch.Tensor:
    return _half(b, 0) * _nibbles(b[:, 4:]).float() + _half(b, 2)


def _dq5_0(b: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(b[:, 6:]) | _high_bits(b[:, 2:6])).to(torch.int8) - 16
    return _half(b, 0) * q.float()


def _dq5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:]) | _high_bits(b[:, 4:8])
    return _half(b, 0) * q.float() + _half(b, 2)


BLOCK_TYPES: dict[str, BlockType] = {t.name.lower(): t for t in (
    BlockType("Q8_0", 34, _q8_0, _dq8_0, 8),
    BlockType("Q4_0", 18, _q4_0, _dq4_0, 4),
    BlockType("Q4_1", 20, _q4_1, _dq4_1, 4),
    BlockType("Q5_0", 22, _q5_0, _dq5_0, 5),
    BlockType("Q5_1", 24, _q5_1, _dq5_1, 5),
)}


def block_type(name: str) -> BlockType:
    """The BlockType called `name` ("q4_0" or "Q4_0")."""
    found = BLOCK_TYPES.get(name.lower())
    if found is None:
        from modelkit.errors import did_you_mean

        raise ConfigError(f"unknown GGUF block type {name!r}; known: {', '.join(BLOCK_TYPES)}"
                          f"{did_you_mean(name.lower(), BLOCK_TYPES)}")
    return found


def _check_rows(shape: tuple[int, ...], kind: BlockType) -> None:
    if not shape or shape[-1] % BLOCK:
        raise ConfigError(f"{kind.name} needs rows whose length is a multiple of {BLOCK} (the block size); "
                          f"the tensor is {list(shape)}: keep it in float (skip it) or pick another scheme")


def quantize(tensor: torch.Tensor, type_name: str, *, threads: int | None = None,
             implementation: str | None = None) -> torch.Tensor:
    """Quantize a float tensor to GGUF blocks along its last dimension.

    Args:
        tensor: Any shape whose last dimension is a multiple of 32; cast to float32 first,
            as gguf-py does.
        type_name: "q8_0", "q4_0", "q4_1", "q5_0" or "q5_1".
        threads: Worker threads (default: torch's intra-op thread count).
        implementation: "avx2", "generic" or "torch" (default: the fastest available,
            IMPLEMENTATIONS[0]); all give the same bytes.

    Returns:
        uint8 (rows, bytes per row): rows = all leading dimensions, the same bytes and shape
        that `gguf.quants.quantize` gives for the tensor viewed as (rows, last dimension).

    Raises:
        ConfigError: the last dimension is not a multiple of 32, the type or implementation is
            unknown here, or the tensor holds NaN or infinity.

    Example:
        >>> w = torch.randn(4, 64)
        >>> quantize(w, "q8_0").shape          # 2 blocks of 34 bytes per row
        torch.Size([4, 68])
    """
    kind = block_type(type_name)
    implementation = implementation or IMPLEMENTATIONS[0]
    if implementation not in IMPLEMENTATIONS:
        raise ConfigError(f"GGUF quantization implementation {implementation!r} is not available here; "
                          f"available: {', '.join(IMPLEMENTATIONS)}")
    shape = tuple(tensor.shape)
    _check_rows(shape, kind)
    rows = math.prod(shape[:-1])
    blocks = tensor.detach().to("cpu", torch.float32).contiguous().view(-1, BLOCK)   # (rows * nb, 32)
    out = torch.from_numpy(empty_bytes(blocks.shape[0] * kind.type_size)).view(blocks.shape[0], kind.type_size)   # huge pages
    workers = threads or torch.get_num_threads()
    run = _run_torch if implementation == "torch" else _run_kernels
    if not run(kind, blocks, out, workers, implementation):
        bad = int((~torch.isfinite(blocks)).any(-1).nonzero()[0])
        raise ConfigError(f"cannot quantize to {kind.name}: the tensor of shape {list(shape)} holds NaN or infinity "
                          f"(row {bad * BLOCK // shape[-1]}); fix the weights, or keep this tensor in float (skip it)")
    return out.view(rows, shape[-1] // BLOCK * kind.type_size)


def _run_kernels(kind: BlockType, blocks: torch.Tensor, out: torch.Tensor, workers: int, isa: str) -> bool:
    """The C kernels (modelkit.quantizers.gguf_arrays.run_kernels: one share of blocks per thread)."""
    return run_kernels(kind.name.lower(), blocks.view(-1).numpy(), out.view(-1).numpy(), workers, isa)


def _run_torch(kind: BlockType, blocks: torch.Tensor, out: torch.Tensor, workers: int, _: str) -> bool:
    """Eager torch over chunks of _CHUNK_BLOCKS; each thread takes a contiguous run of chunks."""
    def work(start: int, stop: int) -> bool:
        ws = _Workspace(_CHUNK_BLOCKS)
        for chunk in range(start, stop, _CHUNK_BLOCKS):
            end = min(chunk + _CHUNK_BLOCKS, stop)
            if not kind.quantize(blocks[chunk:end], out[chunk:end], ws.rows(end - chunk)):
                return False
        return True

    parts = shares(blocks.shape[0], workers, 1, step=_CHUNK_BLOCKS)
    # Each op single-threaded inside our threads: torch's intra-op threads would split every
    # small op again and wait on each other at each one (slow on a busy machine).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:     # torch releases the GIL inside each op, so the threads overlap
        return in_threads(work, parts)
    finally:
        torch.set_num_threads(previous)


def dequantize(data: torch.Tensor, type_name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """GGUF block bytes (rows, bytes per row) back to float32, as `gguf.quants.dequantize` gives them.

    Args:
        data: uint8 with a last dimension that is a whole number of blocks.
        type_name: The block type.
        shape: The logical shape to return (default: rows x weights per row).
    """
    kind = block_type(type_name)
    data = data.to("cpu", torch.uint8)
    if data.ndim == 0 or data.shape[-1] % kind.type_size:
        raise FormatError("<tensor>", f"{kind.name} data rows of {list(data.shape)} bytes are not whole "
                                      f"{kind.type_size}-byte blocks")
    row_weights = data.shape[-1] // kind.type_size * BLOCK
    values = kind.dequantize(data.reshape(-1, kind.type_size))             # (rows * nb, 32)
    values = values.reshape(*data.shape[:-1], row_weights)
    if shape is not None:
        if math.prod(shape) != values.numel():
            raise FormatError("<tensor>", f"{kind.name} data holds {values.numel()} weights, not {list(shape)}")
        values = values.reshape(shape)
    return values


def dequantize_layout(q: QuantizedTensor) -> torch.Tensor:
    """Layout "gguf": block bytes in parts["qdata"], the block type in params["ggml_type"]; with
    params["transposed"], the blocks run along the rows of the transposed matrix (GPT-2's Conv1D weights
    as llama.cpp stores them) and the values come back in `q.shape`."""
    if q.params.get("transposed"):
        stored = replace(q, shape=tuple(reversed(q.shape)),
                                     params={k: v for k, v in q.params.items() if k != "transposed"})
        return dequantize_layout(stored).T.contiguous()
    ggml_type = str(q.params.get("ggml_type", ""))
    if ggml_type.lower() in BLOCK_TYPES:
        return dequantize(q.parts["qdata"].load(), ggml_type, q.shape).to(q.dtype.torch)
    if ggml_type.lower() in KERNEL_TYPES and KERNEL_ISAS:     # llama.cpp's to_float, bit for bit
        try:
            values = dequantize_kquants(q.parts["qdata"].load().numpy(), ggml_type)
            return torch.from_numpy(values).reshape(q.shape).to(q.dtype.torch)
        except (ConfigError, RuntimeError) as e:             # bytes that do not fit the type or the shape
            raise FormatError(q.source or "<tensor>", f"cannot dequantize {ggml_type}: {e}") from e
    # Other block types (i-quants; K-quants without the extension) only come from GGUF files: gguf-py dequantizes them.
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize
    except ModuleNotFoundError as e:
        raise MissingDependencyError(f"GGUF type {ggml_type} needs the gguf package: pip install 'modelkit[gguf]'") from e
    if ggml_type not in GGMLQuantizationType.__members__:
        raise FormatError(q.source or "<tensor>", f"unknown GGUF block type {ggml_type!r}")
    try:
        values = gguf_dequantize(q.parts["qdata"].load().numpy(), GGMLQuantizationType[ggml_type])
        return torch.from_numpy(values.astype("float32", copy=False)).reshape(q.shape).to(q.dtype.torch)
    except NotImplementedError as e:
        raise UnsupportedConversionError(f"gguf {ggml_type}", "float", "gguf-py cannot dequantize this type yet") from e
    except (ValueError, RuntimeError) as e:        # block bytes that do not fit the type or the shape
        raise FormatError(q.source or "<tensor>", f"cannot dequantize {ggml_type} ({type(e).__name__}: {e})") from e

def quantized_tensor(weight: torch.Tensor, type_name: str, *, scheme: str | None = None,
                     importance: np.ndarray | None = None) -> QuantizedTensor:
    """`weight` as a QuantizedTensor of GGUF blocks (the form the GGUF writer stores natively), quantized under
    `importance` (one float per column, llama.cpp's imatrix entry) when given."""
    if type_name.lower() in KERNEL_TYPES or importance is not None:
        name = type_name.upper()
        qdata = torch.from_numpy(quantize_array(weight.detach().to("cpu", torch.float32).numpy(), type_name.lower(),
                                                importance=importance))
    else:
        name = block_type(type_name).name
        qdata = quantize(weight, name)
    return QuantizedTensor(scheme=scheme or name.lower(), layout="gguf", shape=tuple(weight.shape),
                           dtype=weight.dtype if weight.dtype.is_floating_point else torch.float32,
                           parts={"qdata": LazyTensor.of(qdata)}, params={"ggml_type": name})


def apply(model: nn.Module, config: BlockConfig) -> nn.Module:
    """Return a copy of `model` whose Linear and Embedding weights are GGUF blocks of `config.scheme` (a K type's
    weights whose rows are not whole super-blocks: llama.cpp's fallback type, gguf_arrays.row_type), or, for a
    recipe (q4_k_m ...), of the type llama.cpp's rules pick for the weight's llama.cpp name (a model without a
    llama.cpp layout: the recipe's base type and fallbacks); under `config.imatrix`'s entries (by the weights'
    GGUF names) when it names an importance matrix."""
    base = config.block_type
    if base not in KERNEL_TYPES:
        block_type(base)
    chosen = _recipe_types(model, config.recipe) if config.recipe else None
    gguf_names = _gguf_names(model) if config.imatrix else {}
    importance = read_importance(config.imatrix) if config.imatrix else None

    def convert(name: str, module: nn.Module) -> nn.Module | None:
        weight = module.weight.detach()
        if chosen is not None and f"{name}.weight" in chosen:
            type_name = chosen[f"{name}.weight"]
            type_name = None if type_name == "f16" else type_name   # llama.cpp's F16 fallback: the layer stays float
        else:
            type_name = row_type(base, weight.shape[-1]) if weight.ndim == 2 else None
        if type_name is None:
            _modules.log_kept(name, f"rows of {weight.shape[-1]} weights are not whole {BLOCK}-weight blocks"
                              if chosen is None else f"llama.cpp's {config.recipe.upper()} keeps it as it is")
            return None
        vector = None
        if importance is not None:
            weight_name = f"{name}.weight"
            vector = importance.for_weight(gguf_names.get(weight_name, weight_name), weight.shape[-1])
        try:
            quantized = quantized_tensor(weight, type_name, importance=vector)   # a fallback type names itself
        except ConfigError as e:               # NaN / inf weights: say which module
            raise ConfigError(f"{name}.weight: {e}") from e
        return _modules.quantized_module(module, quantized)

    return _modules.replace(model, config, convert, kinds=(nn.Linear, nn.Embedding))


def _gguf_names(model: nn.Module) -> dict[str, str]:
    """The model's parameter names -> the names its GGUF file gives them (llama.cpp's, for a model whose family
    has a llama.cpp layout; the names themselves otherwise), to find their importance matrix entries."""
    from modelkit.models import arch_spec, gguf_conventions

    try:
        rules = gguf_conventions(arch_spec(model))
    except ConfigError:                 # not a registered model: its names are the GGUF names
        return {}
    return dict(rules.names) if rules is not None else {}


def _recipe_types(model: nn.Module, recipe: str) -> dict[str, str | None]:
    """State-dict name -> type under `recipe`, from the llama.cpp layout of the model's architecture."""
    from modelkit.checkpoint import Checkpoint

    types, _ = checkpoint_types(Checkpoint.from_module(model), recipe)
    return types


def from_affine(q: QuantizedTensor) -> QuantizedTensor | None:
    """The same weights as Q4_0 blocks when that is exact, else None.

    Symmetric int4 with groups of 32 along the rows and fp16 scales (int4 and GPTQ at
    group_size 32) is Q4_0 by another name: d = scale and each nibble = q + 8, so the
    dequantized values are bit for bit the same. This lets GGUF files (and llama.cpp) hold them.
    """
    params = q.params
    if (q.layout != "affine" or int(params.get("bits", 0)) != 4 or not params.get("symmetric", False)
            or int(params.get("group_size", 0)) != BLOCK or len(q.shape) != 2 or "zero_point" in q.parts):
        return None
    scale = q.parts["scale"].load()
    if scale.dtype != torch.float16:
        return None
    packed = q.parts["qdata"].load()                                         # (rows, cols / 2), low nibble first
    values = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(q.shape[0], -1).to(torch.int16)
    nibbles = ((values + 8) & 0x0F).to(torch.uint8).reshape(-1, BLOCK)      # two's complement -> q + 8
    blocks = torch.empty(nibbles.shape[0], 18, dtype=torch.uint8)            # block: d f16 | 16 B nibbles
    blocks[:, :2].view(torch.float16).copy_(scale.reshape(-1, 1))
    blocks[:, 2:] = nibbles[:, :BLOCK // 2] | (nibbles[:, BLOCK // 2:] << 4)
    return QuantizedTensor(scheme=q.scheme, layout="gguf", shape=q.shape, dtype=q.dtype,
                           parts={"qdata": LazyTensor.of(blocks.reshape(q.shape[0], -1))},
                           params={"ggml_type": "Q4_0"}, source=q.source)
