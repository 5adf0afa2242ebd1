"""The SGLang plugin's command (what ``update_weights_from_tensor`` carries) and its refusals.

No SGLang needed: the command is m2nkit's own JSON in a tensor name
(``m2nkit.engine.plugins.sglang``); the round itself is tested against SGLang's
real model classes in ``tests/integration/test_sglang_plugin.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from m2nkit.engine.plugins.sglang import LOADER, SGLangClient, command_tensors, read_command


def test_command_is_one_empty_uint8_tensor_named_by_its_json():
    named = command_tensors({"op": "update", "call": 3, "worker": 1, "replicas": 1,
                             "update_info": {"round": 2, "version": "v2"}})
    (name, tensor), = named
    assert tensor.dtype == torch.uint8 and tensor.numel() == 0
    assert json.loads(name) == {"m2nkit": 1, "op": "update", "call": 3, "worker": 1,
                                "replicas": 1, "update_info": {"round": 2, "version": "v2"}}
    assert read_command(named) == json.loads(name)


@pytest.mark.parametrize("named,needle", [
    ([("model.embed_tokens.weight", torch.zeros(2))], "is not an m2nkit command"),
    ([("a", torch.zeros(1)), ("b", torch.zeros(1))], "takes one m2nkit command tensor, got ['a', 'b']"),
    (command_tensors({"op": "load", "call": 1, "worker": 0, "replicas": 1}),
     "op 'load' is not one of init, start, update, finish, shutdown"),
    (command_tensors({"op": "start", "call": 1, "worker": -1, "replicas": 1}),
     "command field 'worker' must be an int >= 0, got -1"),
])
def test_anything_else_is_refused_by_name(named, needle):
    with pytest.raises(ValueError) as e:
        read_command(named)
    assert needle in str(e.value)


class _Server:
    tp_size = 2

    def __init__(self, loaders):
        self.custom_weight_loader = loaders


def test_client_refuses_a_server_without_the_loader_before_sending():
    """SGLang ends its scheduler on an unknown load_format (NotImplementedError inside the
    dispatch): the client must not send one."""
    from m2nkit.engine.clients import WeightSyncError

    with pytest.raises(WeightSyncError) as e:
        SGLangClient([_Server([LOADER]), _Server([])])
    assert f"SGLang server 1 was not started with --custom-weight-loader {LOADER}" in str(e.value)
    assert SGLangClient([_Server([LOADER])] * 2).get_world_size() == 4


def test_sglang_destination_names_the_spec_and_refuses_unknown_architectures():
    from _paths import ORACLE
    from m2nkit.adapters.sglang import sglang_destination

    config = json.loads((ORACLE / "tiny-qwen3" / "checkpoint" / "config.json").read_text())
    builder = sglang_destination(config, "sglang:ep=0,tp=2")
    assert (builder.spec, builder.num_workers) == ("sglang:tp=2,dp=1", 2)
    with pytest.raises(ValueError, match="checked against SGLang's own loaders for Llama"):
        sglang_destination({"architectures": ["PhiForCausalLM"]}, "sglang:tp=2")
