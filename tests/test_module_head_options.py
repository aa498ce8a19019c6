"""Every fused loss module takes the head's options (`HeadOptions`) by keyword, with the same
names, held whole in `module.head`; a misspelt one is a TypeError that names it."""

import pytest

import fgrpo_kernels as fk

MODULES = {
    "grpo": lambda **kw: fk.FusedLinearGRPOLoss(**kw),
    "fgrpo": lambda **kw: fk.FusedLinearFGRPOLoss(**kw),
    "gift": lambda **kw: fk.FusedLinearGIFTLoss(2, **kw),
    "fdo": lambda **kw: fk.FusedLinearFDOLoss(**kw),
    "fhal": lambda **kw: fk.FusedLinearFHALLoss(**kw),
    "policy": lambda **kw: fk.FusedLinearPolicyLoss("vanilla", **kw),
}


@pytest.mark.parametrize("name", MODULES)
def test_every_module_takes_the_head_options_by_keyword(name):
    module = MODULES[name](temperature=0.5, max_chunk_bytes=0, vocab_parallel=None, fast_fp32=True)
    assert module.head.temperature == 0.5 and module.temperature == 0.5
    assert module.head.max_chunk_bytes == 0 and module.head.fast_fp32
    assert module.head.vocab_parallel is None and module.head.process_group is None


@pytest.mark.parametrize("name", MODULES)
def test_a_misspelt_head_option_is_a_type_error_naming_it(name):
    with pytest.raises(TypeError, match="max_chunk_byte"):
        MODULES[name](max_chunk_byte=1)


@pytest.mark.parametrize("name", MODULES)
def test_a_bad_head_option_value_is_named(name):
    with pytest.raises(ValueError, match="^max_chunk_bytes"):
        MODULES[name](max_chunk_bytes=-1)
