"""Small Hugging Face model folders built in code, as a user would bring them: another architecture than the demo's
tiny Qwen2 (Llama), a byte-level BPE tokenizer trained here, a ChatML chat template, and on request a model that
never ends a response (to test long generations deterministically).
"""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TEXT = ["What is 12 + 30? The answer is 42.", "Reverse abc: cba", "user: hello\nassistant: hi there",
         "Tom has 3 apples and buys 5 more. How many apples does Tom have?\n3 + 5 = 8\n#### 8"] * 20


def chat_tokenizer(vocab_size: int = 320, chat_template: str | None = CHATML) -> PreTrainedTokenizerFast:
    """A byte-level BPE (every byte encodable, digits one per token) with ChatML specials; eos is <|im_end|>."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(_TEXT, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=SPECIALS[1:])
    if chat_template:
        tok.chat_template = chat_template
    return tok


def llama_folder(path: Path, *, tokenizer: PreTrainedTokenizerFast | None = None, max_positions: int = 2048,
                 never_stop: bool = False, hidden: int = 64, seed: int = 0, save_tokenizer: bool = True,
                 tied: bool = False, init_range: float = 0.02) -> Path:
    """Save a small random Llama with its tokenizer; its output head is its own unless ``tied`` (the head is then
    the input embeddings, as in most small pretrained models). ``init_range``: the weights' init std (the default
    gives near-uniform next-token distributions; larger makes versions' log-probs far apart).

    ``never_stop``: the end-of-turn token's logit is pinned far below every other, whatever the input, so every
    response runs to its token limit. One residual dimension is held constant (its embedding column set, every
    block's writes to it zeroed), and the eos row of the head reads only that dimension, negatively.
    """
    tok = tokenizer or chat_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                         tie_word_embeddings=tied, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None, dtype="float32",
                         initializer_range=init_range)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if never_stop and tied:
        raise ValueError("never_stop pins a row of the output head, which a tied model shares with its input")
    if never_stop:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] = 1.0
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight[0] = 0.0
                layer.mlp.down_proj.weight[0] = 0.0
            model.lm_head.weight[tok.eos_token_id] = 0.0
            model.lm_head.weight[tok.eos_token_id, 0] = -1e4
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    if save_tokenizer:
        tok.save_pretrained(path)
    return Path(path)


def reference_logprobs(folder: Path, prompt: list[int], tokens: list[int]) -> list[float]:
    """The log-prob of each of ``tokens`` after ``prompt`` under the model in ``folder``, as the trainer computes it
    (transformers, fp32, the whole sequence at once)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        lp = torch.log_softmax(model(seq).logits[0, :-1].float(), -1).gather(-1, seq[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1:].tolist()
