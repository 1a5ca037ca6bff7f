"""The reference models: shapes, names, configs, determinism, generation."""
from __future__ import annotations

import pytest
import torch

from modelkit.errors import ConfigError, UnknownModelError
from modelkit.models import arch_spec, build, build_from_spec, config_from_dict, load_model_module, zoo_models
from modelkit.models.tinylm import TinyLMConfig, apply_rotary, generate, rotary_tables


def test_forward_shapes(model_name, small_model):
    inputs = load_model_module(model_name).example_inputs(3)
    out = small_model(inputs)
    if model_name == "tinylm":
        assert out.shape == (3, inputs.shape[1], 256)
    else:
        assert out.shape == (3, small_model.config.num_classes)


def test_same_seed_same_weights(model_name):
    a = build(model_name, seed=7).state_dict()
    b = build(model_name, seed=7).state_dict()
    c = build(model_name, seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].dtype.is_floating_point and a[k].std() > 0)


def test_arch_spec_rebuilds_the_same_shapes(model_name, small_model):
    rebuilt = build_from_spec(arch_spec(small_model))
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in small_model.state_dict().items()}


def test_mlp_is_linear_relu_linear_relu_linear_30_20():
    model = build("mlp")
    kinds = [type(m).__name__ for m in model.net]
    assert kinds == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert [m.out_features for m in model.net if isinstance(m, torch.nn.Linear)] == [30, 20, 2]


def test_tinylm_uses_hugging_face_llama_names_and_size():
    model = build("tinylm")
    names = set(model.state_dict())
    for expected in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                     "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
                     "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                     "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                     "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
                     "model.layers.0.mlp.down_proj.weight"):
        assert expected in names
    params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= params <= 5_000_000
    cfg = model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads              # grouped-query attention
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size)


def test_tinylm_is_causal():
    model = build("tinylm", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2}, seed=0).eval()
    x = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 256
    with torch.no_grad():
        assert torch.allclose(model(x)[0, :8], model(y)[0, :8], atol=1e-6)
        assert not torch.allclose(model(x)[0, 8:], model(y)[0, 8:])


def test_rotary_matches_complex_rotation_of_half_split_pairs():
    """HF's rotate-half RoPE: feature i pairs with i + d/2, rotated by position * theta^(-2i/d)."""
    cfg = TinyLMConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    cos, sin = rotary_tables(cfg, 5, torch.device("cpu"))
    x = torch.randn(1, 1, 5, 8)
    got = apply_rotary(x, cos, sin)
    half = 4
    angles = torch.arange(5)[:, None] * (10000.0 ** (-torch.arange(half) / half))[None, :]
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angles), angles)
    assert torch.allclose(got, torch.cat((z.real, z.imag), -1), atol=1e-5)


@pytest.mark.parametrize("values, message", [
    ({"hidden_size": 30, "num_attention_heads": 4}, "not divisible"),
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, "not a multiple"),
    ({"hiden_size": 64}, "did you mean 'hidden_size'"),
    ({"num_hidden_layers": 0}, "positive"),
])
def test_bad_tinylm_configs_are_config_errors(values, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict("tinylm", values)


def test_unknown_model_suggests_a_name():
    with pytest.raises(UnknownModelError, match="did you mean 'cnn'"):
        build("cnm")


def test_generate_is_deterministic_and_respects_length():
    model = build("tinylm", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16}, seed=0)
    greedy = generate(model, b"def ", max_new_bytes=40)              # longer than the window: context is cropped
    assert len(greedy) == 40 and greedy == generate(model, b"def ", max_new_bytes=40)
    sampled = generate(model, b"def ", max_new_bytes=20, temperature=1.0, top_k=5, seed=1)
    assert len(sampled) == 20 and sampled == generate(model, b"def ", max_new_bytes=20, temperature=1.0, top_k=5, seed=1)


def test_every_registered_model_builds_with_defaults():
    for name in zoo_models():
        assert build(name).config == load_model_module(name).CONFIG()


def test_declared_tensor_facts_name_real_tensors_and_dims(model_name):
    """keras_layers and prune_groups name state_dict tensors of the model, along dims it has, in whole units."""
    module = load_model_module(model_name)
    config = module.CONFIG()
    shapes = {k: tuple(v.shape) for k, v in module.MODEL(config).state_dict().items()}
    layout = module.keras_layers(config)
    if layout is not None:
        mapped = [w.tensor for layer in layout.layers for w in layer.weights]
        assert sorted(mapped) == sorted(shapes)                 # every tensor once, nothing else
    for group in module.prune_groups(config) or []:
        assert any(part.score for part in group.slices)
        units = {shapes[part.tensor][part.dim] // part.width for part in group.slices}
        assert len(units) == 1 and all(shapes[p.tensor][p.dim] % p.width == 0 for p in group.slices)
        assert next(iter(units)) % group.buckets == 0


def test_declared_keras_layout_of_mlp_follows_its_widths():
    layout = load_model_module("mlp").keras_layers(config_from_dict("mlp", {"hidden": [8, 4]}))
    assert [layer.weights[0].tensor for layer in layout.layers] == ["net.0.weight", "net.2.weight", "net.4.weight"]
    assert "Dense(8, activation='relu'), Dense(4, activation='relu'), Dense(2)" in layout.description
