"""An embedded tiny causal LM and its character tokenizer, built in code (no download).

The vocabulary is the ten digits, a few symbols and the special tokens; one character is one
token. The model is a 2-layer Llama with hidden size 64 (~0.1 M parameters): small enough to be
trained from scratch by RL on a CPU in minutes.
"""

from __future__ import annotations

import torch

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
SYMBOLS = tuple("0123456789") + ("?", "=", ",", "+", "-")
TOKENS = SPECIALS + SYMBOLS


def tiny_tokenizer():
    """A PreTrainedTokenizerFast over TOKENS: one token per non-space character; pads left."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(TOKENS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"\S"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def tiny_config(vocab_size: int = len(TOKENS), **overrides):
    """A LlamaConfig of ~0.1 M parameters; any field can be overridden."""
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=TOKENS.index("<pad>"),
        bos_token_id=TOKENS.index("<bos>"),
        eos_token_id=TOKENS.index("<eos>"),
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def tiny_model(seed: int = 0, **overrides):
    """A freshly initialised LlamaForCausalLM from `tiny_config(**overrides)` (seeded)."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config(**overrides))
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id
    return model
