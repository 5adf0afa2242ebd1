"""Fixtures every integration test gets."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def _transformers_config_classes_restored():
    """Put back what vLLM changes in transformers' own config classes.

    vLLM 0.33.0 re-registers transformers' ``DeepseekV3Config`` for the
    ``deepseek_v32`` model type by setting the class attribute
    (``vllm/transformers_utils/config.py``, ``_register_config_class``:
    ``config_class.model_type = model_type``) whenever it reads a DeepSeek-V3.2
    config; every DeepSeek-V3 config the process builds afterwards says
    ``deepseek_v32``. One process serves one model in practice; this one goes
    from DeepSeek-V3.2 traces to DeepSeek-V3 checkpoints, so after each test the
    class gets back the model type transformers' own table names it by.
    """
    yield
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    for model_type, name in (("deepseek_v3", "DeepseekV3Config"),):
        cls = getattr(transformers, name, None)
        if cls is not None and CONFIG_MAPPING_NAMES.get(model_type) == name:
            cls.model_type = model_type
