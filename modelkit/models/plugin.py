"""What a model module declares besides how to build and train itself: plain data, in the model's terms.

Converters, quantizers and the pipeline read these through the registry (`modelkit.models`) and do
the generic work themselves (building Keras layers, slicing tensors, exporting graphs). A model
module never imports them: it sits below them (tests/test_architecture.py).

The names every model module defines (`PLUGIN_NAMES`; None where a model has no such thing):

- ``CONFIG``, ``MODEL``, ``TASK``, ``TRAINING``, ``example_inputs``: see `modelkit.models`
- ``keras_layers(config) -> KerasLayout | None``: the equivalent Keras Sequential, layer by layer
- ``onnx_axes(config) -> dict[int, Axis]``: input axes left free beyond the batch axis (axis 0)
- ``prune_groups(config) -> list[PruneGroup] | None``: the units structured pruning may remove
- ``DISTILL``: a `DistillDefaults` (temperature and alpha measured for this model)
- ``STUDENT``: config values of the default distillation student (``--student NAME`` alone)
- ``QUALITY``: a `QualityBar` the trained model must reach (`modelkit demo` checks it)
- ``GGUF``: a `GGUFLayout` when the model follows a llama.cpp architecture's conventions (so
  llama.cpp runs the file), or None for modelkit's generic GGUF layout
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# A plugin's TASK and TRAINING are built from these (they import torch, so they load on first use:
# `import modelkit.models` stays light). `from modelkit.models.plugin import ClassificationTask` works.
_TASK_TYPES = ("ClassificationTask", "LanguageModelTask", "TrainDefaults")


def __getattr__(name: str) -> Any:
    if name in _TASK_TYPES:
        from modelkit.models import _tasks

        return getattr(_tasks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class NoTorch:
    """The base of a zoo model's class where torch is not installed: the model's module still imports, so its
    config and Keras layout (plain data: what the TF.js and HDF5 writers need) work on a slim install, and
    building the model says what to install."""

    arch: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from modelkit.errors import MissingDependencyError

        raise MissingDependencyError(f"building the {self.arch} model needs torch: pip install 'modelkit[torch]'")


PLUGIN_NAMES = ("CONFIG", "MODEL", "TASK", "TRAINING", "example_inputs", "keras_layers", "onnx_axes",
                "prune_groups", "DISTILL", "STUDENT", "QUALITY", "GGUF")

# How a torch weight becomes its Keras counterpart (the hdf5 converter implements each by name).
KerasTransform = Literal["same", "dense_kernel", "conv_kernel", "dense_after_flatten"]


@dataclass(frozen=True)
class KerasWeight:
    """One torch tensor stored as one Keras weight.

    Args:
        tensor: The state_dict name ("net.0.weight").
        keras: The Keras weight name ("kernel", "bias").
        transform: "same"; "dense_kernel" (out, in) -> (in, out); "conv_kernel" (out, in, kh, kw) ->
            (kh, kw, in, out) (and (out, in, k) -> (k, in, out) for Conv1D); "dense_after_flatten": a Dense kernel after Flatten, whose rows torch
            orders (C, H, W) and Keras (H, W, C); `flatten` gives (C, H, W).
        flatten: (channels, height, width) of the map flattened before this layer, for "dense_after_flatten".
    """

    tensor: str
    keras: str
    transform: KerasTransform = "same"
    flatten: tuple[int, int, int] | None = None


# The registered model a Keras topology read from a file builds (models/keras_graph.py; its ArchSpec config is
# {"topology": the Keras model config, "weights": "tfjs" | "keras3"}): what the tfjs and hdf5 readers name.
KERAS_TOPOLOGY_MODEL = "keras"

# Keras class of each layer kind (KerasLayer.kind is the class in snake case, as Keras names layers).
KERAS_CLASSES = {"dense": "Dense", "conv1d": "Conv1D", "conv2d": "Conv2D", "max_pooling1d": "MaxPooling1D",
                 "max_pooling2d": "MaxPooling2D", "average_pooling1d": "AveragePooling1D",
                 "average_pooling2d": "AveragePooling2D", "flatten": "Flatten", "dropout": "Dropout",
                 "activation": "Activation", "softmax": "Softmax", "batch_normalization": "BatchNormalization",
                 "layer_normalization": "LayerNormalization", "embedding": "Embedding",
                 # read only: the classes a file's topology may use that modelkit builds (models/keras_graph.py)
                 "input_layer": "InputLayer", "depthwise_conv2d": "DepthwiseConv2D", "reshape": "Reshape",
                 "global_average_pooling1d": "GlobalAveragePooling1D", "global_average_pooling2d": "GlobalAveragePooling2D",
                 "global_max_pooling1d": "GlobalMaxPooling1D", "global_max_pooling2d": "GlobalMaxPooling2D",
                 "relu": "ReLU", "leaky_relu": "LeakyReLU", "add": "Add", "subtract": "Subtract", "multiply": "Multiply",
                 "average": "Average", "maximum": "Maximum", "minimum": "Minimum", "concatenate": "Concatenate"}


@dataclass(frozen=True)
class KerasLayer:
    """One Keras layer: its class in snake case ("dense", "conv2d", "max_pooling2d", "flatten"), weights,
    and the arguments Keras builds it with, as its config JSON spells them ({"units": 16,
    "activation": "relu"}); Keras fills in its defaults for the rest."""

    kind: str
    weights: tuple[KerasWeight, ...] = ()
    config: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class KerasLayout:
    """The Keras Sequential a model equals: its layers in order, its input shape (without the batch
    axis, channels_last) and how to build it, for the file's note. `input_dtype` is the Keras input's
    dtype (int32 for token ids); `unmapped` names tensors Keras has no variable for (BatchNorm's
    num_batches_tracked), kept in the file's lossless group only."""

    layers: tuple[KerasLayer, ...]
    description: str
    input_shape: tuple[int, ...] = ()
    input_dtype: str = "float32"
    unmapped: tuple[str, ...] = ()

    def keras_json(self, name: str = "sequential") -> dict[str, Any]:
        """The model's architecture as Keras 3's `model.to_json()` writes it: `keras.models.model_from_json`
        builds it, and its layer names (dense, dense_1, conv2d, ...) are the ones the HDF5 converter's
        `.weights.h5` layout uses, so `load_weights` fills it."""
        counts: dict[str, int] = {}
        layers = [{"module": "keras.layers", "class_name": "InputLayer", "registered_name": None,
                   "config": {"batch_shape": [None, *self.input_shape], "dtype": self.input_dtype, "sparse": False,
                              "name": "input_layer"}}]
        for layer in self.layers:
            n = counts[layer.kind] = counts.get(layer.kind, -1) + 1
            layers.append({"module": "keras.layers", "class_name": KERAS_CLASSES[layer.kind], "registered_name": None,
                           "config": {"name": layer.kind if n == 0 else f"{layer.kind}_{n}", "trainable": True,
                                      "dtype": "float32", **layer.config}})
        return {"module": "keras", "class_name": "Sequential", "registered_name": None,
                "config": {"name": name, "trainable": True, "dtype": "float32", "layers": layers}}


@dataclass(frozen=True)
class Axis:
    """A free input axis of an exported graph: its name and, if bounded, its largest size."""

    name: str
    max: int | None = None


@dataclass(frozen=True)
class PruneSlice:
    """Where one tensor holds the units of a pruning group.

    Args:
        tensor: The state_dict name.
        dim: The dimension the units run along (0: output rows; 1: input columns of the next layer).
        width: Consecutive entries per unit along `dim` (head_dim rows per attention head; the 16
            pooled pixels one channel owns after a flatten).
        score: Whether this slice's L2 norm ranks the units (the product over scored slices).
        start: Where the units begin along `dim`, in a tensor that fuses several projections (phi3's
            qkv_proj: q rows, then k, then v); the entries outside `start` .. `start + length` are kept.
            Slices of one tensor in one group are cut together, so each `start` is a position in the
            tensor as the group finds it.
        length: How many entries along `dim` the units fill from `start` (None: to the end).
    """

    tensor: str
    dim: int
    width: int = 1
    score: bool = False
    start: int = 0
    length: int | None = None


@dataclass(frozen=True)
class PruneGroup:
    """Units structured pruning removes together, from every tensor that holds them.

    Groups are applied in order, each on the tensors the previous ones already shrank.

    Args:
        slices: Every tensor holding the units, with its dimension.
        config_key: The config field that counts the units kept (the total over buckets).
        index: Which entry of a list-valued config field (mlp's `hidden[i]`); None for a plain field.
        buckets: The units fall in this many equal runs that each keep the same count (query heads
            per key/value head, so grouped-query attention stays uniform).
        pinned: Config values written explicitly once the group is applied (head_dim, which a config
            would otherwise derive from hidden_size / num_attention_heads).
        also_counts: Other config fields that count the same units, with the number each unit adds
            ({"num_key_value_heads": 1} when whole heads of multi-head attention go with their keys and values).
        kept: Why these units stay: a group the family cannot prune into a config transformers accepts
            (GPT-2's heads) declares this one line instead of slices, and the prune report prints it.
    """

    slices: tuple[PruneSlice, ...]
    config_key: str
    index: int | None = None
    buckets: int = 1
    pinned: dict[str, Any] = field(default_factory=dict, hash=False)
    also_counts: dict[str, int] = field(default_factory=dict, hash=False)
    kept: str = ""


@dataclass(frozen=True)
class GGUFLayout:
    """How the GGUF converter stores a model so that llama.cpp runs it.

    Args:
        architecture: llama.cpp's architecture whose conventions apply. "llama": Hugging Face Llama
            tensor names and config fields (hidden_size, num_key_value_heads, rope_theta, ...) become
            llama.cpp's names and `llama.*` hyperparameters, Q/K rows permuted for its RoPE.
        tokenizer: "bytes": token id == byte value, written as a 256-token byte vocabulary.
        bos_id: The token llama.cpp puts before a prompt's first (it adds none by default).
        eos_id: The token that ends generation.
    """

    architecture: Literal["llama"]
    tokenizer: Literal["bytes"]
    bos_id: int
    eos_id: int


@dataclass(frozen=True)
class DistillDefaults:
    """Distillation temperature and soft-target weight measured for a model."""

    temperature: float = 4.0
    alpha: float = 0.9


@dataclass(frozen=True)
class QualityBar:
    """The figure a trained model must reach: `split`'s `metric` against `bar`, higher or lower being better."""

    split: str
    metric: str
    bar: float
    direction: Literal["higher", "lower"] = "higher"

    def met(self, value: float) -> bool:
        return value >= self.bar if self.direction == "higher" else value <= self.bar


@dataclass(frozen=True)
class HFFamily:
    """A Hugging Face transformers model family (a `save_pretrained` folder's config.json `model_type`)
    and how llama.cpp stores it in GGUF, as plain data. A family module declares `FAMILY = HFFamily(...)`
    and nothing else: the shared mechanics (building transformers' module, the hyperparameter rules,
    the GGUF writer and reader) read it. See docs/models.md.

    Args:
        model_types: config.json `model_type` values this family accepts ("llama"; "gemma3_text", "gemma3").
        hf_class: transformers' causal-LM class ("LlamaForCausalLM"), written to `architectures`.
        architecture: llama.cpp's architecture name (`general.architecture`, the key prefix).
        tensors: Hugging Face name -> llama.cpp name; "{n}" is the block number. Names missing here
            (buffers, ...) are refused when writing GGUF unless `dropped` matches them.
        hparams: llama.cpp key suffix ("context_length") -> config.json key: the values copied as they are.
            Derived values (head dims, rope dimension count and base, rope scaling, vocabulary size) are
            computed by the shared rules in modelkit.models._hf.
        rope_permute: Q/K rows reordered from Hugging Face's rotate-half layout to ggml's pairs (llama, mistral).
        norm_offset: Added to every `norm.weight` in GGUF (Gemma stores weight - 1; llama.cpp wants weight).
        transposed: Hugging Face names ("{n}" as above) stored as Conv1D (in, out): transposed for GGUF (GPT-2).
        dropped: Regular expressions of Hugging Face names that are not weights (GPT-2's attn.bias masks).
        head_dims: Always write attention.key_length / value_length (Gemma), not only when head_dim
            differs from hidden_size / heads.
        text_config: config.json key holding the language model's config in a multimodal folder
            (gemma3's "text_config"); the family reads the text part only.
        query_scale_27b: Gemma: llama.cpp scales queries by 1/sqrt(head_dim), except in models with this
            many blocks (the 27B ones), by 1/sqrt(hidden_size / heads); config.json's query_pre_attn_scalar
            must be that value (a GGUF cannot hold another), and a config rebuilt from a GGUF gets it back.
        float_modules: Module names (fnmatch patterns) that `modelkit quantize` keeps in float by default
            for the module schemes (int4, int8, gptq, int8-dynamic): the token embeddings, which
            transformers cannot load as a compressed nn.Embedding, and the output head, which
            llm-compressor's recipes leave in float too. `--skip` adds to them.
        prunable: Structured pruning applies (modelkit.models._hf_prune.prune_groups reads the layout from
            `tensors`): separate q/k/v/o and gate/up/down projections with Llama's names, Phi-3's fused
            qkv_proj and gate_up_proj, or GPT-2's Conv1D blocks.
    """

    model_types: tuple[str, ...]
    hf_class: str
    architecture: str
    tensors: dict[str, str] = field(hash=False)
    hparams: dict[str, str] = field(hash=False)
    rope_permute: bool = False
    norm_offset: float = 0.0
    transposed: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    head_dims: bool = False
    text_config: str | None = None
    query_scale_27b: int | None = None
    float_modules: tuple[str, ...] = ("model.embed_tokens", "lm_head")
    prunable: bool = False


def _sequence_axis(config: Any) -> dict[int, Axis]:
    return {1: Axis("sequence")}


def _no_layout(config: Any) -> None:
    return None


def _token_ids(batch_size: int = 2, *, seed: int = 0, seq_len: int = 16) -> Any:
    """Token ids below 256 (every family's vocabulary is larger): (B, T) int64."""
    import torch

    return torch.randint(0, 256, (batch_size, seq_len), generator=torch.Generator().manual_seed(seed))


def hf_plugin_defaults() -> dict[str, Any]:
    """What a Hugging Face family module gets for the zoo's plugin names it does not declare: its config
    is the config.json dict, transformers builds the module (modelkit.models.build), nothing is trained
    (TASK, TRAINING, QUALITY None), no Keras layout, pruning groups when the family is `prunable` (the
    registry binds modelkit.models._hf_prune.prune_groups to it), the sequence axis free in ONNX, and its GGUF
    conventions are the FAMILY's own (GGUF None)."""
    return {"CONFIG": dict, "MODEL": None, "TASK": None, "TRAINING": None, "example_inputs": _token_ids,
            "keras_layers": _no_layout, "onnx_axes": _sequence_axis, "prune_groups": _no_layout,
            "DISTILL": DistillDefaults(), "STUDENT": {}, "QUALITY": None, "GGUF": None}
