"""Build a tiny, randomly initialised causal LM + character-level tokenizer.

Owns: the test/demo model the project builds itself (no hub downloads are
possible on our machines). The result is a normal Hugging Face directory that
both transformers and vLLM load by path.

Shape constraints (docs/design/vllm-cpu.md): vLLM's CPU attention backend needs head_dim 64,
so the defaults are hidden 128, 2 heads, 1 KV head. The tokenizer is one token
per character plus the chat-template specials and the tool-call tags, so a
digit answer is a single token.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlnode.model_files import make_readable

# Qwen/Hermes-style template with tool support. Tools are rendered into the
# system turn as JSON lines; a tool call is <tool_call>{json}</tool_call>;
# tool results come back as a "tool" turn wrapped in <tool_response>.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "# Tools\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{% elif m.role == 'tool' %}"
    "<|im_start|>tool\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls is defined and m.tool_calls %}"
    "{% for tc in m.tool_calls %}"
    "{% set f = tc.function if tc.function is defined else tc %}"
    "<tool_call>{\"name\": {{ f.name | tojson }}, \"arguments\": {{ f.arguments | tojson }}}</tool_call>"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added (non-special) tokens: they decode back to text, so tool calls survive
# detokenisation, but each is a single id.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each of the 256 bytes (space -> 'Ġ')."""
    from tokenizers import pre_tokenizers

    table = pre_tokenizers.ByteLevel.alphabet()
    # Order: the byte values 0..255, so id order is stable across versions.
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping, n = {}, 0
    for b in range(256):
        if b in visible:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + n)
            n += 1
    assert set(mapping.values()) == set(table)
    return [mapping[b] for b in range(256)]


def build_tokenizer(out_dir: Path):
    """A byte-level tokenizer with no merges: one token per byte (so per
    ASCII character), plus the chat specials and tool-call tags.

    Byte-level (GPT-2 alphabet) rather than a plain character vocab because
    transformers 5 loads a qwen2 model's tokenizer as ``Qwen2Tokenizer``,
    which imposes its own byte-level pre-tokenizer and decoder; with this vocab
    that class and the generic fast tokenizer produce the same ids.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for tok in ["<unk>", *SPECIAL_TOKENS, *_byte_alphabet()]:
        vocab[tok] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    hf.add_tokens(TOOL_TOKENS)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out_dir)
    return hf


# Real model shapes with random weights, for GPU benchmarks of memory and
# MFU (``rlnode tiny-model --preset``): the vocabulary is the real one's size
# (the [tokens, vocab] logits dominate trainer memory, docs/design/gpu-h100.md) although
# the tokenizer uses its first ~100 ids only. Written in bf16.
PRESETS: dict[str, dict] = {
    "qwen3-0.6b": dict(arch="qwen3", hidden=1024, layers=28, intermediate=3072, heads=16, kv_heads=8,
                       head_dim=128, vocab=151936, tie_embeddings=True),
    "qwen3-1.7b": dict(arch="qwen3", hidden=2048, layers=28, intermediate=6144, heads=16, kv_heads=8,
                       head_dim=128, vocab=151936, tie_embeddings=True),
}


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen2",
    tie_embeddings: bool = False,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 128,
    head_dim: int = 64,
    preset: str | None = None,
) -> Path:
    """Write model + tokenizer to ``out_dir``; returns the path. ``preset``
    (a ``PRESETS`` name) overrides the shape arguments."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if preset and preset not in PRESETS:
        raise ValueError(f"--preset: expected one of {', '.join(PRESETS)}, got {preset!r}")
    shape = dict(PRESETS[preset]) if preset else {}
    arch = shape.get("arch", arch)
    tie_embeddings = shape.get("tie_embeddings", tie_embeddings)
    layers, hidden, head_dim = shape.get("layers", layers), shape.get("hidden", hidden), shape.get("head_dim", head_dim)
    if hidden % head_dim:
        raise ValueError(f"--hidden {hidden} must be a multiple of head_dim {head_dim}")
    tokenizer = build_tokenizer(out)
    heads = shape.get("heads", hidden // head_dim)
    vocab_size = max(shape.get("vocab", 0), len(tokenizer))
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=shape.get("intermediate", hidden * 2),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=shape.get("kv_heads", 1),
        max_position_embeddings=4096,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        rms_norm_eps=1e-6,
    )
    if arch == "qwen2":
        from transformers import Qwen2Config as C

        cfg = C(**common)
    elif arch == "qwen3":
        from transformers import Qwen3Config as C

        cfg = C(head_dim=head_dim, **common)
    elif arch == "llama":
        from transformers import LlamaConfig as C

        cfg = C(head_dim=head_dim, **common)
    else:
        raise ValueError(f"--arch: expected one of qwen2, qwen3, llama, got {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if preset else torch.float32)
    # Random init with std 0.02 gives near-uniform next-token distributions;
    # that is what we want: the policy starts from "random" and RL shapes it.
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(out)
    (out / "rlnode_tiny.json").write_text(
        json.dumps({"arch": arch, "tie_embeddings": tie_embeddings, "seed": seed,
                    "layers": layers, "hidden": hidden, "preset": preset}, indent=2)
    )
    make_readable(out)  # save_pretrained writes the weights 0600
    return out
