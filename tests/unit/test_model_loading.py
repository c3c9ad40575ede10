"""Loading the user's model folder: dtypes, context, errors that say what is missing, and chat templates per turn."""
from __future__ import annotations

import pytest
import torch

from rlstream.models.loading import (ModelError, chat_prompt_ids, chat_turn_ids, check_folder, context_limit,
                                     load_model, load_tokenizer, torch_dtype)
from tests.helpers.models import chat_tokenizer, llama_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return llama_folder(tmp_path_factory.mktemp("m") / "llama", max_positions=1536)


def test_a_folder_loads_as_given_in_the_dtype_asked(folder):
    tok = load_tokenizer(folder)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert next(load_model(folder).parameters()).dtype == torch.float32  # auto: the checkpoint's own
    assert next(load_model(folder, "bf16").parameters()).dtype == torch.bfloat16
    assert torch_dtype("fp16") == torch.float16
    assert context_limit(folder) == 1536


def test_missing_parts_name_what_is_missing_and_how_to_supply_it(tmp_path, folder):
    with pytest.raises(ModelError, match="no such folder"):
        check_folder(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match=r"no config.json; save the model with model.save_pretrained"):
        check_folder(str(tmp_path / "empty"))
    bare = llama_folder(tmp_path / "bare", save_tokenizer=False)
    with pytest.raises(ModelError, match=r"no tokenizer .*tokenizer.save_pretrained"):
        load_tokenizer(bare)
    no_template = chat_tokenizer(chat_template=None)
    with pytest.raises(ModelError, match=r"no chat template; give the trainer --chat-template FILE"):
        chat_prompt_ids(no_template, [{"role": "user", "content": "hi"}])
    with pytest.raises(ModelError, match="--chat-template nope.jinja: no such file"):
        load_tokenizer(folder, chat_template="nope.jinja")


def test_a_chat_template_file_is_set_on_the_tokenizer(tmp_path):
    plain = llama_folder(tmp_path / "plain", tokenizer=chat_tokenizer(chat_template=None))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}")
    tok = load_tokenizer(plain, chat_template=str(template))
    ids = chat_prompt_ids(tok, [{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "[user]hi[assistant]"


def test_chat_turns_append_exactly_what_the_template_adds():
    """Prompt ids, then the engine's tokens (ending in <|im_end|>), then each observation's ids: the same tokens
    as the template renders the whole conversation, less the newline the template puts after <|im_end|> (the
    engine stopped at <|im_end|>; nothing is re-tokenized from the assistant's text)."""
    tok = chat_tokenizer()
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"}]
    prompt = chat_prompt_ids(tok, first)
    assert tok.decode(prompt) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 12 + 30?" \
                                 "<|im_end|>\n<|im_start|>assistant\n"
    episode = list(prompt)
    turns = [("42", "correct"), ("so 42", "thanks")]
    conversation = list(first)
    for answer, observation in turns:
        sampled = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # as the engine returns
        episode += sampled
        added = chat_turn_ids(tok, [{"role": "user", "content": observation}])
        assert tok.decode(added) == f"<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"
        episode += added
        conversation += [{"role": "assistant", "content": answer}, {"role": "user", "content": observation}]
    whole = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    for _, observation in turns:  # the newline after each sampled <|im_end|> is the template's, not the engine's
        turn = f"<|im_start|>user\n{observation}"
        whole = whole.replace(f"<|im_end|>\n{turn}", f"<|im_end|>{turn}")
    assert episode == tok(whole, add_special_tokens=False)["input_ids"]
