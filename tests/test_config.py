"""Named configs: every one constructs and round-trips through transformers' config classes."""
from dataclasses import replace

import pytest

from lit_qlora.config import NAMES, Config
from lit_qlora.convert import to_hf_config
from lit_qlora.families import SPECS


def test_every_named_config_constructs():
    assert len(NAMES) > 50
    for name in NAMES:
        c = Config.from_name(name)
        assert c.name == name and c.hf_architecture in SPECS
        assert c.n_head % c.n_query_groups == 0 and c.rope_n_elem % 2 == 0 and c.rope_n_elem > 0
    with pytest.raises(Exception, match="did you mean"):
        Config.from_name("Llama-2-7b")


@pytest.mark.parametrize("name", NAMES)
def test_named_config_round_trips_through_transformers(name):
    import transformers

    ours = Config.from_name(name)
    d = to_hf_config(ours)
    hf = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    back = Config.from_hf_config(hf.to_dict() | {"architectures": d["architectures"]})
    # hf_extra may gain defaults (e.g. GPT-NeoX attention_bias=True): equal when the exports are equal
    assert replace(back, name=name, hf_extra={}) == replace(ours, hf_extra={})
    assert to_hf_config(back) == to_hf_config(ours)
    # the transformers side sees the same model
    assert hf.vocab_size == ours.vocab_size and hf.hidden_size == ours.n_embd and hf.num_hidden_layers == ours.n_layer
    assert hf.num_attention_heads == ours.n_head
    kv = getattr(hf, "num_key_value_heads", None) or getattr(hf, "num_kv_heads", None)
    if ours.hf_architecture == "GPTNeoXForCausalLM":
        kv = hf.num_attention_heads
    elif ours.hf_architecture == "FalconForCausalLM" and not hf.new_decoder_architecture:
        kv = 1 if hf.multi_query else hf.num_attention_heads
    assert kv == ours.n_query_groups
    assert (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads) == ours.head_size
    rope = hf.rope_parameters if hasattr(hf, "rope_parameters") else {"rope_theta": hf.rope_theta}
    if "full_attention" in rope:  # one set per layer type (Gemma 3)
        assert rope["sliding_attention"]["rope_theta"] == ours.rope_local_base
        rope = rope["full_attention"]
    assert rope["rope_theta"] == ours.rope_base
    assert rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)) == ours.rotary_percentage
    if ours.rope_scaling:
        assert rope["rope_type"] == ours.rope_scaling.get("rope_type", "llama3")
        assert rope["factor"] == ours.rope_scaling["factor"]
        for key in ("short_factor", "long_factor", "original_max_position_embeddings"):  # longrope
            assert rope.get(key) == ours.rope_scaling.get(key), key
    assert hf.tie_word_embeddings == ours.tie_embeddings


def test_an_unknown_hf_architecture_in_our_config_is_refused(tmp_path):
    """Found by the file fuzzer: a flipped byte in model_config.json's hf_architecture ('LlamaForCaus`lLM') loaded."""
    import json

    from lit_qlora.utils import UserError

    config = Config.from_name(sorted(NAMES)[0])
    path = tmp_path / "model_config.json"
    config.save(path)
    data = json.loads(path.read_text())
    for damaged in ("LlamaForCaus`lLM", {}, ["LlamaForCausalLM"]):  # (seed 23018: an object there was a TypeError)
        data["hf_architecture"] = damaged
        path.write_text(json.dumps(data))
        with pytest.raises(UserError, match="hf_architecture"):
            Config.from_file(path)


@pytest.mark.parametrize("field, value", [
    ("moe_intermediate_size", []),  # found by the file fuzzer (seed 9100): a list where a size belongs loaded
    ("moe_n_expert", -1), ("moe_top_k", 1.5), ("post_norms", "yes"), ("qk_norm", "per-head"),
    ("attn_softcap", 0), ("final_softcap", float("nan")), ("rope_local_base", "10000"), ("attention_scale", -1.0),
    ("layer_types", ["sliding_attention"]), ("layer_types", ["sliding_attention", "linear_attention"]),
    ("nope_layers", [5]), ("moe_dense_layers", [0.5]), ("norm_fp32_scale", None), ("attn_sinks", 1),
    ("moe_bias", "true"), ("moe_mxfp4", None), ("moe_swiglu_limit", 0), ("moe_swiglu_alpha", "1.702"),
    ("norm_eps", 2.5)])  # found by the file fuzzer (seed 11016): an epsilon that rescales every activation loaded
def test_every_field_of_our_model_config_is_checked(tmp_path, field, value):
    """Each field of model_config.json that changes the math is refused in one line naming it when its value is of
    the wrong type or out of range (a 2-layer config: layer lists have 2 entries, layer numbers are 0 or 1)."""
    import json

    from lit_qlora.utils import UserError

    path = tmp_path / "model_config.json"
    Config(n_layer=2).save(path)
    Config.from_file(path)  # the pristine file loads
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=field) as e:
        Config.from_file(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("key, value", [("rms_norm_eps", 2.5), ("rms_norm_eps", 0.5), ("rms_norm_eps", 0)])
def test_a_norm_epsilon_no_model_has_is_refused_in_config_json(tmp_path, key, value):
    """config.json's rms_norm_eps of 2.5 (the fuzzer, seed 11016) loaded as a valid model: refused in one line naming
    the file and the field; 1e-5 and 1e-12 (BERT-like) load."""
    import json

    from helpers import TINY_HF_CONFIGS

    from lit_qlora.utils import UserError

    cfg = {**TINY_HF_CONFIGS["llama"], "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    for ok in (1e-5, 1e-12):
        Config.from_hf_config({**cfg, key: ok})
    (tmp_path / "config.json").write_text(json.dumps({**cfg, key: value}))
    with pytest.raises(UserError, match=key) as e:
        Config.from_hf_config(tmp_path / "config.json")
    assert "\n" not in str(e.value) and str(tmp_path / "config.json") in str(e.value)


# keras-team/keras-hub: keras_hub/src/models/gemma3/gemma3_presets.py, the text-only presets' "params" (Google's
# count, independent of the config.json copies the entries come from; its embedding has 262,144 rows where the
# published 4B / 12B / 27B configs have 262,208)
KERAS_GEMMA3_PARAMS = {"gemma-3-270m": 268098176, "gemma-3-270m-it": 268098176, "gemma-3-1b-it": 999885952,
                       "gemma-3-4b-pt": 3880099328, "gemma-3-4b-it": 3880099328, "gemma-3-12b-pt": 11765788416,
                       "gemma-3-12b-it": 11765788416, "gemma-3-27b-pt": 27009002240, "gemma-3-27b-it": 27009002240}


@pytest.mark.parametrize("name", list(KERAS_GEMMA3_PARAMS))
def test_published_gemma3_configs_read_as_transformers_reads_them(name):
    """Each published Gemma 3 config.json among the named configs (sources in lit_qlora/config.py) gives the layer
    kinds, window, RoPE bases and scaling, head size, query scale and tying transformers' config class gives; our
    parameter count is the one of transformers' model built from it (on the meta device: nothing allocated) and, but
    for the embedding rows Keras leaves out, Keras' own count."""
    import torch
    import transformers

    from lit_qlora.checkpoint import lit_param_shapes
    from lit_qlora.config import _HF_CONFIGS

    published = dict(_HF_CONFIGS[name])
    ours, theirs = Config.from_hf_config(published), transformers.Gemma3TextConfig(**published)
    assert replace(Config.from_name(name), name=ours.name) == ours  # the name is the published model
    assert (ours.n_layer, ours.n_embd, ours.n_head, ours.n_query_groups, ours.head_size, ours.intermediate_size,
            ours.vocab_size, ours.block_size) == (
        theirs.num_hidden_layers, theirs.hidden_size, theirs.num_attention_heads, theirs.num_key_value_heads,
        theirs.head_dim, theirs.intermediate_size, theirs.vocab_size, theirs.max_position_embeddings)
    assert ours.layer_types == theirs.layer_types and ours.sliding_window_size == theirs.sliding_window
    rope = theirs.rope_parameters
    assert (ours.rope_base, ours.rope_local_base) == (rope["full_attention"]["rope_theta"],
                                                      rope["sliding_attention"]["rope_theta"])
    assert ours.rope_scaling == (None if rope["full_attention"]["rope_type"] == "default" else
                                 {"rope_type": "linear", "factor": rope["full_attention"]["factor"]})
    assert ours.attention_scale == theirs.query_pre_attn_scalar ** -0.5 and ours.tie_embeddings
    n = sum(s.numel() for s in lit_param_shapes(ours).values())
    with torch.device("meta"):
        assert n == sum(p.numel() for p in transformers.Gemma3ForCausalLM(theirs).parameters())
    assert n - (ours.vocab_size - 262144) * ours.n_embd == KERAS_GEMMA3_PARAMS[name]


def _published_names():
    from lit_qlora.config import _HF_CONFIGS

    return list(_HF_CONFIGS)


@pytest.mark.parametrize("name", _published_names())
def test_every_published_config_is_the_model_transformers_builds_from_it(name):
    """Each named config copied from a published config.json (sources in lit_qlora/config.py) is what reading that
    config.json gives, and has exactly the parameter count of the model transformers builds from the same dict (on
    the meta device: nothing allocated), so a mistyped shape, tying or layer count cannot hide behind our own
    reading of it."""
    import torch
    import transformers

    from lit_qlora.checkpoint import lit_param_shapes
    from lit_qlora.config import _HF_CONFIGS

    published = dict(_HF_CONFIGS[name])
    # (gpt-oss: the folder's MXFP4 storage is the folder's; the model, built dense, is the same)
    ours = replace(Config.from_hf_config(dict(published)), moe_mxfp4=False)
    assert replace(Config.from_name(name), name=ours.name) == ours
    published.pop("quantization_config", None)
    model_type = getattr(transformers, published["architectures"][0]).config_class.model_type
    theirs = transformers.AutoConfig.for_model(model_type, **published)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(theirs)
    assert sum(s.numel() for s in lit_param_shapes(ours).values()) == sum(p.numel() for p in model.parameters())
