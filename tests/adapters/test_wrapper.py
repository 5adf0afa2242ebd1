"""The wrapper mechanism (families/wrapper.py) on its own: what composing a family does.

Qwen3-VL's modules are its first users (tests/adapters/test_qwen3_vl.py pins them to
vLLM); here the rules every wrapper relies on are checked on small inputs: the sub-config
view, the prefix maps (and their refusal), the repeated tower rows, and a text family
with skipped (MTP) layers moved under the wrapper's prefix.
"""

from __future__ import annotations

import json
from dataclasses import replace

from _paths import CONFIGS
import pytest

from m2nkit.adapters.config_wires import ConfigJson, skipped_layer_wires
from m2nkit.adapters.families.deepseek_v3 import FAMILY as DEEPSEEK_V3
from m2nkit.adapters.families.expand import expand
from m2nkit.adapters.families.kinds import REPLICATED
from m2nkit.adapters.families.qwen3 import FAMILY as QWEN3
from m2nkit.adapters.families.qwen3_vl import VISION
from m2nkit.adapters.families.table import Param
from m2nkit.adapters.families.wrapper import Part, SubConfig, Tower, wrapper_family

PREFIXES = ({"model.": "language_model.model.", "lm_head.": "language_model.lm_head."},
            {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."})


def test_sub_config_reads_inherited_keys_at_the_top_first():
    config = {"tie_word_embeddings": True, "text_config": {"hidden_size": 8,
                                                           "tie_word_embeddings": False}}
    view = SubConfig(config, "text_config", ("tie_word_embeddings",))
    assert view["hidden_size"] == view.hidden_size == 8
    assert view.get("tie_word_embeddings") is True        # the wrapper's word, as vLLM's
    assert SubConfig({"text_config": {"tie_word_embeddings": False}}, "text_config",
                     ("tie_word_embeddings",)).get("tie_word_embeddings") is False
    assert view.get("missing", 3) == 3 and "missing" not in view


def test_a_row_outside_the_prefix_maps_is_refused_naming_it():
    odd = replace(QWEN3, params=QWEN3.params + (Param("extra.weight", REPLICATED, ("H",)),))
    with pytest.raises(ValueError, match=r"table name 'extra.weight' starts with none of the "
                                         r"prefixes \['lm_head.', 'model.'\]"):
        wrapper_family("X", Part(odd, "text_config", *PREFIXES), ())


def test_a_placeholder_used_twice_is_refused():
    twice = replace(VISION, name="second tower", hf_prefix="model.audio.", vllm_prefix="audio.")
    with pytest.raises(ValueError, match=r"placeholder \{B\} of second tower is used twice"):
        wrapper_family("X", Part(QWEN3, "text_config", *PREFIXES), (VISION, twice))


def test_tower_rows_repeat_in_place_by_their_counts():
    tower = Tower("t", (Param("a.weight", REPLICATED, ("tH",)),
                        Param("b.{B}.weight", REPLICATED, ("tH",)),
                        Param("b.{B}.bias", REPLICATED, ("tH",)),
                        Param("c.weight", REPLICATED, ("tH",))),
                  symbols=lambda c: {"tH": c["h"], "tn": c["n"]}, keys={"tH": "h", "tn": "n"},
                  config_key="tower_config", hf_prefix="model.tower.", vllm_prefix="tower.",
                  repeats={"B": "tn"})
    fam = wrapper_family("X", Part(QWEN3, "text_config", *PREFIXES), (tower,))
    config = {"tower_config": {"h": 4, "n": 2},
              "text_config": {"hidden_size": 8, "num_attention_heads": 2, "head_dim": 4,
                              "num_key_value_heads": 1, "vocab_size": 16,
                              "num_hidden_layers": 1, "intermediate_size": 8}}
    s = fam.sizes(config)
    assert (s.tH, s.tn, s.H) == (4, 2, 8) and s.label("tH") == "tower_config.h=4"
    names = [n for n, _ in expand(fam, config, s).params]
    assert names[:6] == ["tower.a.weight", "tower.b.0.weight", "tower.b.0.bias",
                         "tower.b.1.weight", "tower.b.1.bias", "tower.c.weight"]
    assert names[6] == "language_model.model.embed_tokens.weight"
    assert "model.tower.b.1.bias" in expand(fam, config, s).feeds


def test_skipped_layers_move_under_the_wrappers_prefix():
    """A DeepSeek-V3 text model with an MTP layer (Kimi-K2.5's text table): the config-only
    listing names its tensors under the wrapper's prefix, and the skip rule still says why."""
    fam = wrapper_family("X", Part(DEEPSEEK_V3, "text_config", *PREFIXES), ())
    text = json.loads((CONFIGS / "moonshotai__Kimi-K2-Instruct" / "config.json").read_text())
    text.update(num_hidden_layers=3, first_k_dense_replace=1, num_nextn_predict_layers=1)
    config = ConfigJson({"architectures": ["X"], "text_config": ConfigJson(text)})
    wires = skipped_layer_wires(fam, config)
    assert wires[0].name == "language_model.model.layers.3.embed_tokens.weight"
    assert all(w.name.startswith("language_model.model.layers.3.") for w in wires)
    assert "multi-token-prediction layer 3" in fam.skip(config, wires[-1].name)
    assert fam.skip(config, "language_model.model.layers.2.input_layernorm.weight") is None
