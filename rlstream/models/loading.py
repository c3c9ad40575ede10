"""Loading the user's model: a Hugging Face folder (or hub id), or ``tiny``, the demo's built-in model.

Every process that loads a model goes through here (trainer, rollout backends, teacher), so ``--dtype``, the
chat template and the errors for a folder that lacks something mean the same everywhere.

Chat templates: a chat task's messages become prompt token ids through the tokenizer's own template
(``chat_prompt_ids``); a later turn's messages become only the ids the template adds after the conversation so
far (``chat_turn_ids``). The policy's own tokens are never re-tokenized from text: the engine's ids are kept.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from rlstream.errors import UsageError, UserError

log = logging.getLogger(__name__)

#: The built-in model's name for ``--model``.
TINY = "tiny"

#: ``--dtype`` choices; auto is the checkpoint's own dtype (its config's ``dtype``/``torch_dtype``).
DTYPES = ("auto", "bf16", "fp16", "fp32")

#: What a folder needs for a tokenizer (one of these), and what a chat template can live in.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class ModelError(UserError):
    """A model folder or id that cannot be used as given; the message says what is missing and how to supply it."""


def torch_dtype(name: str, folder: Path | None = None):
    """The torch dtype for ``--dtype`` (auto: the checkpoint's own, float32 when it names none)."""
    import torch
    fixed = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name in fixed:
        return fixed[name]
    if name != "auto":
        raise ModelError(f"--dtype {name!r}: expected one of {', '.join(DTYPES)}")
    if folder is not None and (Path(folder) / "config.json").exists():
        config = json.loads((Path(folder) / "config.json").read_text())
        named = config.get("dtype") or config.get("torch_dtype")
        if isinstance(named, str) and hasattr(torch, named):
            return getattr(torch, named)
    return torch.float32


def dtype_name(dtype) -> str:
    """The engine-side name of a torch dtype (what vLLM's ``dtype=`` takes)."""
    return str(dtype).removeprefix("torch.")


def is_local(spec: str) -> bool:
    """Whether ``spec`` names a folder on this machine (else it is a hub id, or ``tiny``)."""
    return spec != TINY and (Path(spec).exists() or spec.startswith((".", "/", "~")))


def check_folder(spec: str, flag: str = "--model") -> Path | str:
    """The folder of a local model (checked for its config), or the hub id as given."""
    if not is_local(spec):
        return spec
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise ModelError(f"{flag} {spec}: no such folder (give a folder written by save_pretrained, a hub id, "
                         f"or '{TINY}')")
    if not (folder / "config.json").exists():
        raise ModelError(f"{flag} {spec}: no config.json; save the model with model.save_pretrained({str(folder)!r})")
    return folder


def load_tokenizer(spec: Path | str, chat_template: str = "", flag: str = "--model"):
    """The tokenizer of a model folder (or hub id), with ``chat_template`` (a Jinja file) set on it when given.

    A folder without tokenizer files is an error that names them and says how to add one.
    """
    from transformers import AutoTokenizer
    folder = Path(spec) if is_local(str(spec)) else None
    if folder is not None and not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise ModelError(f"{flag} {spec}: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the model's "
                         f"tokenizer there with tokenizer.save_pretrained({str(spec)!r})")
    try:
        tok = AutoTokenizer.from_pretrained(str(spec))
    except (OSError, ValueError) as exc:
        raise ModelError(f"{flag} {spec}: cannot load its tokenizer: {exc}") from None
    if chat_template:
        tok.chat_template = read_chat_template(chat_template)
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        # Llama-style tokenizers have no pad token; batches pad with eos (masked out everywhere).
        tok.pad_token = tok.eos_token
    return tok


def warm_imports(*extra: str, model: str = "") -> None:
    """Import what loading a model and its tokenizer imports (transformers' auto classes load lazily, ~3 s of a
    tiny model's resume here), what its first save imports, and the modules named in ``extra``: what a warm standby
    does before it waits. With ``model`` (a folder or hub id whose config is at hand), its class too, built on the
    meta device (no weights). Best effort: what fails here is loaded, and reported, when it is needed."""
    import importlib

    import torch
    import transformers
    from transformers.modeling_utils import unwrap_model

    transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModelForCausalLM  # noqa: B018
    # save_pretrained unwraps through accelerate, which imports DeepSpeed where it is installed: ~0.4 s of the
    # first version a trainer publishes.
    unwrap_model(torch.nn.Module())
    for name in extra:
        importlib.import_module(name)
    if model:
        try:
            config = transformers.AutoConfig.from_pretrained(str(model))
            with torch.device("meta"):
                transformers.AutoModelForCausalLM.from_config(config)
        except (OSError, ValueError, KeyError) as exc:
            log.info("warming %s's model class: %s (it loads when it is needed)", model, exc)


def read_chat_template(path: str) -> str:
    """The text of a ``--chat-template`` file."""
    if not Path(path).is_file():
        raise ModelError(f"--chat-template {path}: no such file (give a Jinja chat template)")
    return Path(path).read_text()


def load_model(spec: Path | str, dtype: str = "auto", flag: str = "--model", attn_implementation: str | None = None):
    """A causal LM from a folder or hub id, in ``dtype``, with ``attn_implementation`` (None: transformers' own
    choice, SDPA for the models rlstream trains; see ``resolve_attention``)."""
    from transformers import AutoModelForCausalLM
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        return AutoModelForCausalLM.from_pretrained(str(spec), dtype=torch_dtype(dtype, spec if is_local(str(spec))
                                                                                 else None), **extra)
    except (OSError, ValueError) as exc:
        raise ModelError(f"{flag} {spec}: cannot load it as a causal LM: {exc}") from None


#: ``--attn-implementation`` values; auto is ``resolve_attention``'s choice.
ATTENTION = ("auto", "sdpa", "flash_attention_2", "eager")


def flash_attn_installed() -> bool:
    """Whether the flash-attn package can be imported here (looked up, not imported: its import loads CUDA)."""
    import importlib.util
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention(requested: str, device_type: str, flash_installed: bool, packed: bool = False) -> str | None:
    """The attention implementation to load a model with; None leaves transformers' own choice (SDPA).

    ``auto`` is flash-attention 2 for packed sequences on CUDA when flash-attn is installed: transformers then runs
    flash-attention's variable-length kernel over the packed rows (``cu_seqlens`` from the restarting position ids),
    where without it SDPA gets a block-diagonal mask over the whole packed sequence (correct, checked by
    ``check_packing``, but quadratic in the packed length). Anything else keeps transformers' choice. Asking
    flash_attention_2 where it cannot run (no flash-attn, no CUDA) is a UsageError saying what to do. Not run on a
    GPU in this project: flash-attn is not installed here, so every packed run so far was SDPA's masked path.
    """
    if requested not in ATTENTION:
        raise UsageError(f"--attn-implementation {requested!r}: expected one of {', '.join(ATTENTION)}")
    if requested == "auto":
        return "flash_attention_2" if packed and device_type == "cuda" and flash_installed else None
    if requested == "flash_attention_2":
        if device_type != "cuda":
            raise UsageError("--attn-implementation flash_attention_2 runs on CUDA only: use sdpa (or auto) here")
        if not flash_installed:
            raise UsageError("--attn-implementation flash_attention_2: the flash-attn package is not installed "
                             "(pip install flash-attn --no-build-isolation, or the GPU profile's extra); or use sdpa")
    return requested


def set_attention(model, implementation: str | None) -> None:
    """Switch a loaded model (a built-in one, a resumed one) to ``implementation``; None leaves it as it is."""
    if implementation and getattr(model.config, "_attn_implementation", None) != implementation:
        model.set_attn_implementation(implementation)


#: Context of a model whose config names none (what older GPT-style configs default to).
DEFAULT_CONTEXT = 2048


def context_limit(folder: Path) -> int:
    """The longest prompt + response the model's config allows (``max_position_embeddings`` or ``n_positions``)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    config = config.get("text_config", config)  # multimodal configs nest the language model's
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    return DEFAULT_CONTEXT


def require_chat_template(tok, what: str) -> None:
    """ModelError unless the tokenizer has a chat template (``what``: who needs it, for the message)."""
    if not getattr(tok, "chat_template", None):
        raise ModelError(f"{what} has chat messages, but the model's tokenizer has no chat template; give the "
                         "trainer --chat-template FILE (a Jinja template) so every version carries one, or use a "
                         "plain prompt column")


def _ids(encoded) -> list[int]:
    # transformers 5 may hand back a BatchEncoding even with return_dict=False on some tokenizers.
    if isinstance(encoded, dict) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return [int(i) for i in encoded]


def chat_prompt_ids(tok, messages: list[dict]) -> list[int]:
    """Token ids of a conversation with the generation prompt after it: what the policy continues from."""
    require_chat_template(tok, "a task")
    return _ids(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


#: A fixed conversation that later turns are appended to: the template's rendering of a turn may depend on what
#: came before it (a system prompt is added when none leads), never on the content of earlier turns.
_BASE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


def chat_turn_ids(tok, messages: list[dict]) -> list[int]:
    """Token ids the template adds for ``messages`` after an assistant turn, with the next generation prompt.

    Taken as a token-level difference against a fixed base conversation, so the assistant's own tokens (the
    engine's, which end in its end-of-turn token) are never re-rendered from text.
    """
    require_chat_template(tok, "an episode")
    base = _ids(tok.apply_chat_template(_BASE, tokenize=True, return_dict=False))
    full = _ids(tok.apply_chat_template(_BASE + messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False))
    if full[:len(base)] != base:
        raise ModelError("the chat template renders earlier turns differently once a turn follows them; "
                         "per-turn token ids cannot be appended (use a template that only appends)")
    ids = full[len(base):]
    eos = tok.eos_token_id
    # The assistant's end-of-turn token is already in the episode (the engine sampled it): do not repeat it.
    while ids and eos is not None and ids[0] == eos:
        ids = ids[1:]
    return ids
