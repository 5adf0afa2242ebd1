"""A vLLM model class needing a transformers class this transformers lacks: named, no vLLM."""

from m2nkit.adapters.vllm.trace import missing_class_refusal, missing_transformers_class


def test_a_missing_transformers_class_is_named_with_what_would_work():
    import transformers

    absent = "NoSuchM2nkitTestConfig"
    assert missing_transformers_class(
        AttributeError(f"module transformers has no attribute {absent}")) == absent
    assert missing_transformers_class(
        ImportError(f"cannot import name '{absent}' from 'transformers'")) == absent
    assert missing_transformers_class(AttributeError("module transformers has no attribute "
                                                     "PretrainedConfig")) is None   # it has it
    assert missing_transformers_class(ValueError(f"no attribute {absent}")) is None
    why = missing_class_refusal(absent, "KimiK25ForConditionalGeneration")
    assert why.startswith(f"transformers {transformers.__version__} has no {absent}, which ")
    assert "(this repository's .venv-tf, made by scripts/side_transformers.sh)" in why
    assert why.endswith(", or use the family table (--layout tables)")
    assert not missing_class_refusal(absent, "NoTableForCausalLM").endswith("(--layout tables)")
