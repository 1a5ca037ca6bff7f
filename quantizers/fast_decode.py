"""One decode step of a Llama block stack at batch 1 in one call of the packed-weight kernels.

A decode step of a ~100M-parameter model spends as much time in ~40 small torch ops per block (norms,
rotary, SDPA, SwiGLU, the cache writes) and in Python dispatch as in its weight products. `DecodePlan`
runs the whole stack in C instead (_matmul_kernels_decode.h): the same kernels as fast_linear.matmul
for the products (q/k/v in one job on activations rounded once, gate/up in one job with their SwiGLU),
attention over the static key/value cache one head per task, and the pool's threads kept polling
between the step's jobs. It applies when every product of every block is a quantized Linear the
kernels read, or int8-dynamic's (its activations rounded per row); `plan` returns None otherwise, and the
caller runs its torch path.

`DecodePlan.forward` is the many-token counterpart on the same plan (_matmul_kernels_forward.h): B sequences
of T tokens in one call, with causal attention over their own tokens (tinylm's forward pass,
quantizers/fast_forward.py) or over a cache slot it fills (the decoders' prefill).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from modelkit.errors import ConfigError
from modelkit.quantizers import fast_linear

logger = logging.getLogger("modelkit.quantizers")


def _weight_fields(layer: nn.Module, keep: list[torch.Tensor]) -> list[int] | None:
    """The C plan's fields of one product (DECODE_WEIGHT_FIELDS int64), or None when no kernel reads it.
    A Linear product on packed weights says how its activations are rounded (ROWWISE_ACTIVATIONS: QuantizedLinear
    per block of 32, int8-dynamic's DynamicInt8Linear one scale per row); other layers do not say."""
    rowwise = getattr(type(layer), "ROWWISE_ACTIVATIONS", None)
    if rowwise is None:
        return None
    packed = layer.packed()
    if packed is None:
        return None
    keep.append(packed)          # the plan holds the addresses of its buffers: they live as long as the plan
    bias = layer.bias
    if bias is not None:
        bias = bias.detach().to(torch.float32).contiguous()
        keep.append(bias)
    return [*fast_linear.weight_args(packed), 0 if bias is None else bias.data_ptr(), packed.rows, packed.cols,
            int(rowwise)]


def _norm(module: nn.Module, size: int, keep: list[torch.Tensor]) -> tuple[int, float] | None:
    """(address of an RMSNorm's float32 weight, its eps), or None when it is not one (tinylm's RMSNorm names
    its eps `eps`, transformers' LlamaRMSNorm and its copies `variance_epsilon`)."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or weight.shape != (size,) or eps is None:
        return None
    weight = weight.detach().contiguous()
    keep.append(weight)
    return weight.data_ptr(), float(eps)


@dataclass(frozen=True)
class Geometry:
    """The attention and MLP widths the step checks every product against."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    def __post_init__(self) -> None:
        if min(self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate) < 1 or self.heads % self.kv_heads \
                or self.head_dim % 2:
            raise ConfigError(f"{self}: every width positive, heads a multiple of kv_heads, head_dim even")


class DecodePlan:
    """Addresses and shapes of a block stack's weights for `_kernels.decode` (see the module docstring)."""

    def __init__(self, plan: torch.Tensor, keep: list[torch.Tensor], geometry: Geometry, eps: float,
                 final_norm: int, head: torch.Tensor | None, head_module: nn.Module, vocab: int) -> None:
        self.plan, self.keep, self.geometry, self.eps = plan, keep, geometry, eps
        self.final_norm, self.head, self.head_module, self.vocab = final_norm, head, head_module, vocab
        self.head_address = 0 if head is None else head.data_ptr()
        self.plan_address, self.layers = plan.data_ptr(), len(plan)
        self.cache: tuple[Any, ...] = ()

    def bind(self, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             embeddings: torch.Tensor | None = None) -> None:
        """Use these rotary tables (window, head_dim), caches (layers, slots, kv_heads, window, head_dim) and
        (optionally) float embedding table (vocab, hidden) for the steps that follow (kept alive here); all
        float32, contiguous."""
        g = self.geometry
        for t in (cos, sin, keys, values, *([] if embeddings is None else [embeddings])):
            if t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu:
                raise ConfigError("a decode step needs contiguous float32 CPU tensors")
        if keys.ndim != 5:
            raise ConfigError(f"a decode step on a cache of {tuple(keys.shape)} does not fit this plan "
                              "(layers, slots, kv heads, window, head size)")
        layers, slots, _, window, _ = keys.shape
        if keys.shape != values.shape or layers != self.layers or keys.shape[2:] != (g.kv_heads, window, g.head_dim) \
                or cos.shape != (window, g.head_dim) or sin.shape != cos.shape:
            raise ConfigError(f"a decode step on a cache of {tuple(keys.shape)} does not fit this plan")
        if embeddings is not None and (embeddings.ndim != 2 or embeddings.shape[1] != g.hidden):
            raise ConfigError(f"an embedding table of {tuple(embeddings.shape)} for a hidden size of {g.hidden}")
        self.bound = (cos, sin, keys, values, embeddings)            # kept alive: the addresses below are theirs
        per_slot = g.kv_heads * window * g.head_dim
        self.cache = (slots, window, per_slot, cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(),
                      0 if embeddings is None else embeddings.data_ptr(), 0 if embeddings is None else len(embeddings))

    def step(self, token: int | torch.Tensor, pos: int, slot: int, *, isa: str | None = None,
             threads: int | None = None) -> torch.Tensor:
        """The logits (vocab,) after feeding `token` (a row of the bound embedding table, or its embedding: hidden
        float32 values, contiguous) at position `pos`; writes its keys and values at `pos` of cache `slot`.

        Args:
            isa: A name of fast_linear.ISAS; default the chosen one.
            threads: Threads sharing each product; default torch's number.
        """
        isa = isa or fast_linear.ISA
        if isa is None:
            raise ConfigError("the packed-weight kernels are not available (modelkit was built without a C compiler)")
        if not self.cache:
            raise ConfigError("bind() the caches before a decode step")
        # A step streams every weight through the CPU's caches, so each torch call after it runs cold (~30 us):
        # the checks here are on Python ints where they can be.
        slots, window, per_slot, cos, sin, keys, values, table, rows = self.cache
        g = self.geometry
        if isinstance(token, int):
            if not 0 <= token < rows:
                raise ConfigError(f"token {token} is not a row of the bound embedding table ({rows} rows)")
            x = table + 4 * token * g.hidden
        elif token.dtype != torch.float32 or not token.is_contiguous() or token.shape != (g.hidden,):
            raise ConfigError(f"a decode step's input is {g.hidden} float32 values")
        else:
            x = token.data_ptr()
        if not 0 <= slot < slots or not 0 <= pos < window:
            raise ConfigError(f"position {pos} of slot {slot} is outside a cache of {slots} slots of {window}")
        out = torch.empty(self.vocab if self.head is not None else g.hidden)
        fast_linear.kernels().decode(
            isa, threads or torch.get_num_threads(), self.plan_address, self.layers, x, pos, g.hidden, g.heads,
            g.kv_heads, g.head_dim, g.intermediate, self.eps, cos + 4 * pos * g.head_dim, sin + 4 * pos * g.head_dim,
            keys + 4 * slot * per_slot, values + 4 * slot * per_slot, slots * per_slot, window, self.final_norm,
            self.head_address, out.data_ptr())
        return out if self.head is not None else self.head_module(out)


    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, start: int = 0, slot: int | None = None,
                into: tuple[torch.Tensor, torch.Tensor] | None = None, last_only: bool = False, isa: str | None = None,
                threads: int | None = None) -> torch.Tensor:
        """The logits of B sequences of T tokens in one call of the kernels (_matmul_kernels_forward.h): (B, T, vocab),
        or (B, vocab) of each sequence's last token with `last_only`.

        Args:
            x: The tokens' embeddings, (B, T, hidden) float32, contiguous, on CPU.
            cos, sin: Rotary tables (positions, head_dim) covering positions start..start+T-1 (float32, contiguous).
            start: The position of each sequence's first token (only with `slot`).
            slot: None: each sequence attends to its own tokens alone (a forward pass); else the bound cache's slot
                (B 1) whose positions start..start+T-1 are written, each token attending from position 0 (prefill).
            into: (keys, values), each (layers, B, kv_heads, T, head_dim) float32, contiguous: a forward pass (start 0,
                no `slot`) that also writes every token's keys (after the rotary) and values there.
            isa, threads: As in `step`.
        """
        isa = isa or fast_linear.ISA
        if isa is None:
            raise ConfigError("the packed-weight kernels are not available (modelkit was built without a C compiler)")
        g = self.geometry
        if x.dtype != torch.float32 or not x.is_contiguous() or not x.is_cpu or x.ndim != 3 or x.shape[2] != g.hidden:
            raise ConfigError(f"a fused forward's input is (sequences, tokens, {g.hidden}) float32 values, contiguous")
        B, T = x.shape[0], x.shape[1]
        keys = values = layer_stride = window = 0
        if slot is not None:
            if not self.cache:
                raise ConfigError("bind() the caches before a prefill into them")
            slots, window, per_slot, *_, keys, values, _, _ = self.cache
            if B != 1 or not 0 <= slot < slots or not 0 <= start or start + T > window:
                raise ConfigError(f"{B} sequence(s) of {T} tokens from position {start} into slot {slot} of a cache of "
                                  f"{slots} slots of {window}")
            keys, values, layer_stride = keys + 4 * slot * per_slot, values + 4 * slot * per_slot, slots * per_slot
        elif start:
            raise ConfigError("a forward pass without a cache starts at position 0")
        elif into is not None:
            shape = (self.layers, B, g.kv_heads, T, g.head_dim)
            if any(t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu or t.shape != shape for t in into):
                raise ConfigError(f"a forward pass writes its keys and values into two {shape} float32 CPU tensors, "
                                  "contiguous")
            keys, values = into[0].data_ptr(), into[1].data_ptr()
            layer_stride, window = B * g.kv_heads * T * g.head_dim, T
        if cos.dtype != torch.float32 or not cos.is_contiguous() or cos.shape != sin.shape or sin.dtype != torch.float32 \
                or not sin.is_contiguous() or cos.ndim != 2 or cos.shape[1] != g.head_dim or len(cos) < start + T:
            raise ConfigError(f"rotary tables of {tuple(cos.shape)} for positions {start}..{start + T - 1} of head size "
                              f"{g.head_dim} (float32, contiguous)")
        rows = B if last_only else B * T
        out = torch.empty(rows, self.vocab if self.head is not None else g.hidden)
        fast_linear.kernels().forward(
            isa, threads or torch.get_num_threads(), self.plan_address, self.layers, x.data_ptr(), B, T, start, g.hidden,
            g.heads, g.kv_heads, g.head_dim, g.intermediate, self.eps, cos.data_ptr() + 4 * start * g.head_dim,
            sin.data_ptr() + 4 * start * g.head_dim, keys, values, layer_stride, window, self.final_norm, self.head_address,
            out.data_ptr(), last_only)
        if self.head is None:
            out = self.head_module(out)
        return out if last_only else out.view(B, T, -1)


def _shapes(g: Geometry) -> tuple[tuple[int, int], ...]:
    """(out, in) features of q, k, v, o, gate, up, down."""
    q, kv = g.heads * g.head_dim, g.kv_heads * g.head_dim
    return ((q, g.hidden), (kv, g.hidden), (kv, g.hidden), (g.hidden, q), (g.intermediate, g.hidden),
            (g.intermediate, g.hidden), (g.hidden, g.intermediate))


def plan(blocks: Sequence[Sequence[nn.Module]], final_norm: nn.Module, head: nn.Module, geometry: Geometry) -> DecodePlan | None:
    """A DecodePlan for the blocks, each (attention norm, q, k, v, o, MLP norm, gate, up, down), or those and
    (query norm, key norm), RMSNorms of head_dim applied to each head before the rotary (Qwen3); then the
    final norm and the output head. None when the kernels are not built or a product or norm is not one the
    step computes (the caller then runs its own path); every norm must share one eps. The plan reads the
    weights' memory as it is now: build another after replacing a layer's tensors."""
    if fast_linear.kernels() is None:
        return None
    g = geometry
    keep: list[torch.Tensor] = []
    rows, eps = [], set()
    for i, block in enumerate(blocks):
        attn_norm, q, k, v, o, mlp_norm, gate, up, down, *head_norms = block
        fields: list[int] = []
        for layer, shape in zip((q, k, v, o, gate, up, down), _shapes(g), strict=True):
            found = _weight_fields(layer, keep)
            if found is None:
                logger.debug("no fused decode: block %d has a product the kernels do not read (%s)", i, type(layer).__name__)
                return None
            if tuple(found[-3:-1]) != shape:
                raise ConfigError(f"block {i}: a product of shape {tuple(found[-3:-1])} where {geometry} needs {shape}")
            fields += found
        if len(head_norms) not in (0, 2):
            raise ConfigError(f"block {i}: {len(block)} modules; a block is 9, or 11 with its query and key norms")
        norms = [_norm(n, g.hidden, keep) for n in (attn_norm, mlp_norm)] + [_norm(n, g.head_dim, keep) for n in head_norms]
        if None in norms:
            logger.debug("no fused decode: block %d's norms are not float32 RMSNorms", i)
            return None
        rows.append(fields + [n[0] for n in norms] + [0] * (4 - len(norms)))
        eps.update(n[1] for n in norms)
    final = _norm(final_norm, g.hidden, keep)
    if final is None or len(eps | {final[1]}) != 1:
        logger.debug("no fused decode: the final norm differs from the blocks' norms")
        return None
    head_fields = _weight_fields(head, keep)
    if head_fields is not None and head_fields[-2] != g.hidden:
        raise ConfigError(f"an output head of {head_fields[-2]} input features after a hidden size of {g.hidden}")
    head_tensor = None if head_fields is None else torch.tensor(head_fields, dtype=torch.int64)
    vocab = head_fields[-3] if head_fields is not None else 0
    table = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), fast_linear.kernels().DECODE_LAYER_FIELDS)
    return DecodePlan(table, keep, g, final[1], final[0], head_tensor, head, vocab)


def row_reader(embed: nn.Module) -> Callable[[int], torch.Tensor]:
    """token -> its embedding (hidden float32 values, contiguous) for a table too large to dequantize whole.

    A GGUF table's row is dequantized from its block bytes in numpy (q8_0, q4_0) or the C K-quant
    dequantizer: ~10 us, where the layer's own lookup (torch ops, after a step has streamed the weights
    through the caches) took 0.3-0.8 ms a token on llama-100m's 32000 x 768 table. Other tables: the layer."""
    def by_layer(token: int) -> torch.Tensor:
        return embed(torch.tensor([token]))[0].to(torch.float32).contiguous()

    qdata = getattr(embed, "qdata", None)
    if getattr(embed, "layout", None) != "gguf" or not isinstance(qdata, torch.Tensor) or qdata.ndim != 2 \
            or embed.params.get("transposed") or embed.weight_dtype != torch.float32:
        return by_layer
    kind, rows = str(embed.params.get("ggml_type", "")).lower(), qdata.numpy()
    if kind in ("q8_0", "q4_0"):
        size = 34 if kind == "q8_0" else 18
        if rows.shape[1] % size:
            return by_layer
        blocks = rows.reshape(len(rows), -1, size)

        def legacy(token: int) -> torch.Tensor:
            b = blocks[token]
            scale = b[:, :2].copy().view(np.float16).astype(np.float32)                 # (blocks, 1)
            if kind == "q8_0":
                values = b[:, 2:].view(np.int8).astype(np.float32)
            else:      # q4_0: low nibbles are weights 0-15 of a block, high nibbles 16-31; each minus 8
                values = np.concatenate((b[:, 2:] & 15, b[:, 2:] >> 4), axis=1).astype(np.float32) - 8.0
            return torch.from_numpy((values * scale).reshape(-1))

        return legacy
    from modelkit.quantizers.gguf_arrays import KERNEL_TYPES, dequantize_kquants

    if kind in KERNEL_TYPES and fast_linear.kernels() is not None:
        return lambda token: torch.from_numpy(dequantize_kquants(rows[token], kind, threads=1))
    return by_layer
