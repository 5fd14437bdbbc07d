"""``rlnode sft`` (issue 45), the supervised warm start: the assistant mask
under real chat templates (the tiny model's and SmolLM2's), the data
file's errors, the loss and its gradient accumulation, --resume step for
step, and final/ loaded back by transformers, by the trainer, and with
trainer.lora by peft. Real components: the tokenizers, the tiny model,
torch on CPU in fp32."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from rlnode.cli import build_parser
from rlnode.config import ConfigError, load_config
from rlnode.trainer.sft import SftError, SftJob, SftTrainer, main_sft
from rlnode.trainer.sft_data import BatchOrder, ChatTokens, ConversationError, SftDataError, load_file, load_sft_data

CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "2+2"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "4+5"},
    {"role": "assistant", "content": "nine is 9"},
]


def _write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _segments(chat: ChatTokens, ids: np.ndarray, mask: np.ndarray) -> tuple[list[str], str]:
    """The masked runs decoded one by one, and the unmasked text."""
    m = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(m))
    runs = [chat.tok.decode(ids[s:e].tolist()) for s, e in zip(edges[::2], edges[1::2])]
    return runs, chat.tok.decode(ids[~mask].tolist())


@pytest.fixture(scope="module")
def tiny_chat(tokenizer):
    return ChatTokens(tokenizer)


@pytest.fixture(scope="module")
def smol_chat(smollm2_dir):
    from transformers import AutoTokenizer

    return ChatTokens(AutoTokenizer.from_pretrained(smollm2_dir))


# -- the template and the mask ---------------------------------------------------


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_the_mask_is_each_assistant_turn_and_its_end_token_only(which, tiny_chat, smol_chat):
    chat = tiny_chat if which == "tiny" else smol_chat
    ids, mask = chat.render(CONVERSATION, None, "x:1")
    # The template, not a concatenation of contents: the ids are its text.
    assert chat.tok.decode(ids.tolist()) == chat.tok.apply_chat_template(CONVERSATION, tokenize=False)
    runs, rest = _segments(chat, ids, mask)
    assert runs == ["4<|im_end|>", "nine is 9<|im_end|>"]
    # Headers, system and user turns and ChatML's "\n" after <|im_end|> stay unmasked.
    assert rest.count("<|im_start|>assistant\n\n") == 2 and "You add numbers." in rest and "4+5" in rest
    assert int(mask.sum()) == sum(len(chat.tok.encode(c + "<|im_end|>", add_special_tokens=False))
                                  for c in ("4", "nine is 9"))


def test_smollm2_template_adds_its_system_prompt_untrained(smol_chat):
    ids, mask = smol_chat.render(CONVERSATION[1:3], None, "x:1")
    runs, rest = _segments(smol_chat, ids, mask)
    assert rest.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert runs == ["4<|im_end|>"]


def test_tools_reach_the_template_and_a_tool_call_is_trained(tiny_chat):
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                {"role": "tool", "content": "5"},
                {"role": "assistant", "content": "5"}]
    ids, mask = tiny_chat.render(messages, tools, "x:1")
    runs, rest = _segments(tiny_chat, ids, mask)
    assert runs == ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>', "5<|im_end|>"]
    assert '"name": "add"' in rest.split("</tools>")[0] and "<tool_response>5</tool_response>" in rest


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_line(tmp_path, tokenizer):
    # Keeps only the last assistant turn, as templates that drop past reasoning do.
    drops = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<|im_start|>{{ m.role }}\n"
             "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    data = _write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION[1:3]}, {"messages": CONVERSATION}])
    s = load_config(None, [f"sft.data={data}"]).sft
    with pytest.raises(ConversationError,
                       match=r"d\.jsonl:2: messages\[2\] \(assistant\): the prompt before it does not render"):
        load_file(data, ChatTokens(tokenizer, drops), s)


# -- the data file ------------------------------------------------------------------


@pytest.mark.parametrize("line, error", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected an object"),
    ('{"messages": []}', '"messages" must be a non-empty list'),
    ('{"messages": [{"content": "hi"}]}', r"messages\[0\] must be an object with a string \"role\""),
    ('{"messages": [{"role": "user", "content": 3}]}', r"messages\[0\]\.content"),
    ('{"messages": [{"role": "user", "content": "hi"}], "tools": {"a": 1}}', '"tools" must be a list'),
])
def test_a_malformed_line_names_the_file_and_line(tmp_path, tiny_chat, line, error):
    data = _write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION}, "", line])
    s = load_config(None, [f"sft.data={data}"]).sft
    with pytest.raises(SftDataError, match=rf"d\.jsonl:3: {error}"):
        load_file(data, tiny_chat, s)


def test_conversations_without_an_assistant_turn_or_too_long_are_counted(tmp_path, tiny_chat):
    long = [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "y" * 40}]
    data = _write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION[1:3]}, {"messages": CONVERSATION[:2]},
                                               {"messages": long},
                                               {"messages": [{"role": "user", "content": "z" * 80}, long[1]]}])
    s = load_config(None, [f"sft.data={data}", "sft.max_length=60"]).sft
    kept, counts = load_file(data, tiny_chat, s)
    # The 2nd has no assistant turn; the 3rd is cut to 60 tokens; the 4th has none left within them.
    assert (counts.conversations, counts.used, counts.no_assistant, counts.truncated, counts.dropped_overlong) \
        == (4, 2, 1, 1, 1)
    assert [e.line for e in kept] == [1, 3] and len(kept[1].ids) == 60 and kept[1].mask[-1]
    import msgspec

    kept, counts = load_file(data, tiny_chat, msgspec.structs.replace(s, overlong="drop"))
    assert [e.line for e in kept] == [1] and counts.dropped_overlong == 2


def test_batches_cover_each_pass_once_in_an_order_of_the_seed(tmp_path):
    s = load_config(None, ["sft.data=x", "sft.batch_size=3", "sft.epochs=2"]).sft
    order = BatchOrder([10] * 7, s, seed=5)
    assert order.total_steps() == 6
    passes = [[i for k in range(3 * p, 3 * p + 3) for i in order.batch(k)[1]] for p in range(2)]
    assert [sorted(p) for p in passes] == [list(range(7))] * 2 and passes[0] != passes[1]
    assert BatchOrder([10] * 7, s, seed=5).batch(4) == order.batch(4)
    import msgspec

    by_tokens = BatchOrder([4, 9, 3, 8, 2], msgspec.structs.replace(s, batch_tokens=12, shuffle=False), seed=0)
    assert by_tokens.pass_batches(0) == [[0], [1, 2], [3, 4]]


# -- training ------------------------------------------------------------------------

FACTS = [("red", "apple"), ("blue", "sky"), ("green", "leaf"), ("white", "snow"), ("black", "night"),
         ("gold", "sun"), ("grey", "rain"), ("pink", "rose")]


def _facts(tmp_path: Path) -> Path:
    return _write_jsonl(tmp_path / "facts.jsonl", [
        {"messages": [{"role": "user", "content": f"What is {c}?"}, {"role": "assistant", "content": f"The {w}."}]}
        for c, w in FACTS])


def _cfg(tmp_path: Path, model_dir, data: Path, *extra: str):
    return load_config(None, [f"model.path={model_dir}", f"run.run_dir={tmp_path / 'run'}", 'trainer.device="cpu"',
                              "trainer.cpu_threads=1", "trainer.optim.lr=3e-3", f"sft.data={data}", "sft.batch_size=4",
                              *extra])


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_micro_batches_accumulate_the_gradient_of_the_whole_batch(tmp_path, tiny_model_dir, tiny_chat):
    data = _facts(tmp_path)

    def grads(*extra):
        torch.manual_seed(0)
        cfg = _cfg(tmp_path, tiny_model_dir, data, *extra)
        sft = load_sft_data(cfg.sft, 0, tiny_chat)
        trainer = SftTrainer(cfg, 1)
        trainer.learner.optimizer.zero_grad(set_to_none=True)
        loss = trainer.accumulate(sft.train)
        return loss, len(trainer.micro_batches(sft.train)), {n: p.grad.clone() for n, p in
                                                             trainer.model.named_parameters()}

    whole, parts, budget = grads("trainer.micro_batch_size=64"), grads("trainer.micro_batch_size=1"), \
        grads("trainer.micro_batch_tokens=100")
    assert (whole[1], parts[1]) == (1, len(FACTS)) and 1 < budget[1] < len(FACTS)
    for loss, _, g in (parts, budget):
        assert loss == pytest.approx(whole[0], rel=1e-6)
        for n, ref in whole[2].items():
            torch.testing.assert_close(g[n], ref, rtol=1e-5, atol=1e-7)


def test_the_loss_is_the_mean_over_assistant_tokens(tmp_path, tiny_model_dir, tiny_chat):
    cfg = _cfg(tmp_path, tiny_model_dir, _facts(tmp_path))
    ex = load_sft_data(cfg.sft, 0, tiny_chat).train[:2]
    trainer = SftTrainer(cfg, 1)
    with torch.no_grad():
        got = trainer.mean_nll(ex)
        want, n = 0.0, 0
        for e in ex:
            logp = torch.log_softmax(trainer.model(torch.from_numpy(e.ids)[None]).logits[0].float(), -1)
            at = np.flatnonzero(e.mask)
            want -= float(logp[at - 1, torch.from_numpy(e.ids[at])].sum())
            n += len(at)
    assert got == pytest.approx(want / n, rel=1e-5)


def test_the_loss_falls_on_a_memorisation_set_through_the_command(tmp_path, tiny_model_dir, capsys):
    data = _facts(tmp_path)
    conf = tmp_path / "sft.toml"
    conf.write_text(f'[model]\npath = "{tiny_model_dir}"\n[run]\nrun_dir = "{tmp_path / "run"}"\nprogress = true\n'
                    f'[trainer]\ndevice = "cpu"\ncpu_threads = 1\n[trainer.optim]\nlr = 1e-2\n'
                    f'[sft]\ndata = "{data}"\nepochs = 30\nbatch_size = 8\neval_data = "{data}"\neval_every = 15\n')
    # The command's own function in this process (cli.main would bind the
    # logs to this test's captured stderr; its arguments: test_the_command_line).
    assert main_sft(load_config(conf)) == 0
    recs = _records(tmp_path / "run")
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert steps[-1]["loss"] < 0.3 * steps[0]["loss"]
    evals = [r["eval_loss"] for r in recs if "eval_loss" in r]
    assert len(evals) == 3 and evals[2] < evals[1] < evals[0]  # steps 0, 15, 30
    assert all(r["tokens"] > 0 and r["lr"] == 1e-2 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in steps)
    out = capsys.readouterr().out
    assert "sft [" in out and "30/30 100%" in out and "final model in" in out


def test_resume_trains_what_an_uninterrupted_run_trains(tmp_path, tiny_model_dir):
    data = _facts(tmp_path)
    args = ("sft.epochs=3", "sft.save_every=2", "trainer.optim.schedule=\"cosine\"", "trainer.optim.warmup_steps=2")

    def losses(run_dir):
        return {r["step"]: r["loss"] for r in _records(run_dir) if "loss" in r}  # the last record of a step wins

    whole = SftJob(_cfg(tmp_path / "a", tiny_model_dir, data, *args))
    whole.start()
    whole.run()
    whole.finish()
    assert whole.step == 6

    # A crash after step 3: the checkpoint of step 2 is the latest.
    def crash():
        if job.step == 3:
            raise KeyboardInterrupt
        return False

    job = SftJob(_cfg(tmp_path / "b", tiny_model_dir, data, *args))
    job.start()
    with pytest.raises(KeyboardInterrupt):
        job.run(crash)
    job.close()
    # Stopped (a signal) after step 4: a checkpoint of step 4 is written, no final/.
    job = SftJob(_cfg(tmp_path / "b", tiny_model_dir, data, *args), resume=True)
    job.start()
    assert job.step == 2
    job.run(lambda: job.step == 4)
    assert job.finish() is None and not (tmp_path / "b/run/final").exists()
    job = SftJob(_cfg(tmp_path / "b", tiny_model_dir, data, *args), resume=True)
    job.start()
    assert job.step == 4
    job.run()
    job.finish()
    assert losses(tmp_path / "b/run") == losses(tmp_path / "a/run")  # fp32 on CPU: to the bit
    final_a = _tensors(tmp_path / "a/run/final")
    for n, t in _tensors(tmp_path / "b/run/final").items():
        assert torch.equal(t, final_a[n]), n


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


def test_resume_refuses_other_data_and_a_fresh_run_refuses_a_used_run_dir(tmp_path, tiny_model_dir):
    data = _facts(tmp_path)
    job = SftJob(_cfg(tmp_path, tiny_model_dir, data, "sft.max_steps=1"))
    job.start()
    job.run()
    job.finish()
    with pytest.raises(SftError, match="pass --resume"):
        SftJob(_cfg(tmp_path, tiny_model_dir, data, "sft.max_steps=2")).start()
    with pytest.raises(SftError, match=r"changed: batch_size\)"):
        SftJob(_cfg(tmp_path, tiny_model_dir, data, "sft.max_steps=2", "sft.batch_size=3"), resume=True).start()


# -- final/ --------------------------------------------------------------------------


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_final_is_a_model_folder_that_model_path_loads(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlnode.trainer.learner import Learner

    job = SftJob(_cfg(tmp_path, tiny_model_dir, _facts(tmp_path), "sft.max_steps=2"))
    job.start()
    job.run()
    final = job.finish()
    assert final == tmp_path / "run/final"
    ids = job.data.train[0].ids.tolist()
    trained = _logits(job.trainer.model.eval(), ids)
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(final), ids), trained)
    # The trainer's own loading (an RL run's model.path).
    learner = Learner(load_config(None, [f"model.path={final}", 'trainer.device="cpu"']))
    torch.testing.assert_close(_logits(learner.model.eval(), ids), trained)
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == \
        job.chat.tok.apply_chat_template(CONVERSATION, tokenize=False)
    assert stat.S_IMODE(final.stat().st_mode) == 0o755
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in final.iterdir()} == \
        {f.name: 0o644 for f in final.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= \
        {f.name for f in final.iterdir()}


def test_with_lora_final_is_a_peft_adapter_and_final_merged_full_weights(tmp_path, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    job = SftJob(_cfg(tmp_path, tiny_model_dir, _facts(tmp_path), "sft.max_steps=3", "trainer.lora.rank=4",
                      "trainer.lora.alpha=8", "trainer.optim.lr=3e-2", "sft.merge_lora=true"))
    job.start()
    job.run()
    ids = job.data.train[0].ids.tolist()
    trained = _logits(job.trainer.model.eval(), ids)
    final = job.finish()
    assert sorted(f.name for f in final.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert stat.S_IMODE(final.stat().st_mode) == 0o755
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.allclose(_logits(base, ids), trained, atol=1e-4)  # the adapter moved the model
    torch.testing.assert_close(_logits(PeftModel.from_pretrained(base, final), ids), trained)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run/final-merged")
    torch.testing.assert_close(_logits(merged, ids), trained, rtol=1e-4, atol=1e-5)


# -- config and command ------------------------------------------------------------


def test_sft_keys_are_checked_naming_the_key(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"^sft\.epoch: unknown key"):
        load_config(None, ["sft.epoch=2"])
    with pytest.raises(ConfigError, match=r"^sft\.eval_fraction: expected `float` <= 0\.5"):
        load_config(None, ["sft.eval_fraction=0.9"])
    with pytest.raises(ConfigError, match=r"^sft\.eval_fraction: set either sft\.eval_data"):
        load_config(None, ["sft.eval_data=x.jsonl", "sft.eval_fraction=0.1"])
    with pytest.raises(ConfigError, match=r"^sft\.data: required"):
        SftJob(load_config(None, [])).start()
    with pytest.raises(ConfigError, match=r"^sft\.data: .*missing\.jsonl is not a file"):
        SftJob(load_config(None, [f"sft.data={tmp_path / 'missing.jsonl'}"])).start()
    data = _write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(ConfigError, match=r"^trainer\.parallel\.ranks: `rlnode sft` trains on one device"):
        SftJob(load_config(None, [f"sft.data={data}", "trainer.parallel.ranks=2"])).start()
    with pytest.raises(ConfigError, match=r"^sft\.max_length: 8192 is above the model's max_position_embeddings"):
        SftJob(load_config(None, [f"sft.data={data}", "sft.max_length=8192", f"model.path={tiny_model_dir}"])).start()


def test_the_command_line():
    args = build_parser().parse_args(["sft", "--config", "c.toml", "--set", "sft.epochs=2", "--run-dir", "r",
                                      "--resume"])
    assert (args.command, args.config, args.overrides, args.sft_run_dir, args.sft_resume) == \
        ("sft", "c.toml", ["sft.epochs=2"], "r", True)


def test_the_command_exits_2_naming_a_bad_line(tmp_path, tiny_model_dir, capsys):
    data = _write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATION}, '{"messages": "hi"}'])
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"sft.data={data}", f"run.run_dir={tmp_path}"])
    assert main_sft(cfg) == 2
    assert f"{data}:2: \"messages\" must be a non-empty list" in capsys.readouterr().err
