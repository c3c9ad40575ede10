"""A byte-level BPE tokenizer trained on the generated problems, with Qwen's ChatML chat template.

The pipeline is exactly the one transformers' ``Qwen2Tokenizer`` builds: NFC, Qwen's pre-tokenizer regex (which
isolates every digit, as ``Digits(individual_digits=True)`` would), then byte-level without its own regex. That
matters because for a folder whose config is ``qwen2``, ``AutoTokenizer`` (and so vLLM) does not use the saved
pre-tokenizer: it rebuilds a ``Qwen2Tokenizer`` around our vocab and merges. A tokenizer trained with any other
pre-tokenizer (GPT-2's regex after ``Digits``, say) would be split differently once reloaded, wherever the two
regexes disagree (Qwen's glues newlines onto punctuation, for one). Trained with Qwen's own, the reload is the
identity, which ``check_round_trip`` verifies on real text.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [PAD, IM_START, IM_END]

#: Qwen's ChatML: ``<|im_start|>{role}\n{content}<|im_end|>\n`` per message, ``<|im_start|>assistant\n`` to answer.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """A byte-level BPE of about ``vocab_size`` tokens (256 bytes, the specials, merges) learnt from ``texts``."""
    tk = Tokenizer(models.BPE())
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    # Every byte in the alphabet, seen or not: any text the loop might send still encodes.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token=PAD,
        eos_token=IM_END,  # the end of an assistant turn ends a response
        chat_template=CHAT_TEMPLATE,
        padding_side="left",  # batched generation: each row's next token at the end
        clean_up_tokenization_spaces=False,  # "3 + 5" must decode as written
        model_max_length=512,
    )


def chat_prompt(tokenizer: PreTrainedTokenizerFast, question: str) -> list[int]:
    """The ids of a one-message user turn and the assistant's generation prompt."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def check_round_trip(tokenizer: PreTrainedTokenizerFast, folder: Path, texts: Sequence[str]) -> None:
    """AssertionError unless ``AutoTokenizer`` on the saved ``folder`` gives the same ids, specials and chat prompt
    as ``tokenizer``, and digits stay one token each."""
    loaded = AutoTokenizer.from_pretrained(folder)
    for text in texts:
        ours, theirs = tokenizer(text)["input_ids"], loaded(text)["input_ids"]
        assert ours == theirs, f"reloaded tokenizer splits {text!r} differently: {ours} vs {theirs}"
        assert chat_prompt(tokenizer, text) == chat_prompt(loaded, text), f"chat prompt of {text!r} differs"
    for name in ("pad_token_id", "eos_token_id"):
        assert getattr(tokenizer, name) == getattr(loaded, name), f"{name} differs after reload"
    digits = loaded.convert_ids_to_tokens(loaded("Tom has 1234 apples")["input_ids"])
    assert all(len(t) == 1 for t in digits if any(c.isdigit() for c in t)), f"digits merged: {digits}"
