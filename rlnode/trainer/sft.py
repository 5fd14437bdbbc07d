"""``rlnode sft``: the supervised warm start, on the trainer.

Owns the SFT job: startup (data rendered and checked, the model, --resume)
-> run (one optimizer step per batch of conversations, held-out loss,
checkpoints, metrics.jsonl, the progress line) -> finish (a last
checkpoint, final/). It trains with the RL trainer's own pieces: the
Learner (model loading, device, precision, attention kernel, memory plan,
trainer.lora's wrap, AdamW with trainer.optim's warm-up and schedule over
the SFT's steps, clipping, the skip of a non-finite step), scoring.py's
micro-batch layouts and chunked log-probs (trainer.micro_batch_size /
micro_batch_tokens, logprob_chunk_tokens), checkpoint.py's atomic
checkpoints and metrics file, trackers.py. Data, the mask and the order of
batches: sft_data.py. Must not touch sockets, engines or the RL loop. Plain
blocking torch: a batch job on one device.

The loss of one optimizer step over the batch B of conversations, A_c the
assistant tokens of conversation c (the mask, sft_data.py):

    L = -(1 / N) * sum_{c in B} sum_{t in A_c} log p_theta(x_t | x_<t),    N = sum_{c in B} |A_c|

the mean over the batch's assistant tokens: every assistant token weighs
the same, whatever its conversation's length. Micro-batch m contributes
L_m = -(1 / N) * sum_{t in m} log p_theta(x_t | x_<t) (N: the whole
batch's count), so the L_m sum to L and their backward passes accumulate
exactly grad L, however the batch is split. The held-out loss is the same
mean over every held-out assistant token.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import msgspec
import torch

from rlnode.config import Config, ConfigError, LossConfig, ModelConfig, check_sft_job
from rlnode.config.derived import chat_template_text
from rlnode.log import get_logger
from rlnode.model_files import make_readable
from rlnode.trainer.checkpoint import CheckpointManager, MetricsWriter, is_adapter, model_adapter_spec
from rlnode.trainer.learner import Learner, causal_lm
from rlnode.trainer.scoring import (PackedRow, bucket_micro_batches, budget_micro_batches, chunked_logprobs,
                                    packed_inputs, padded_inputs)
from rlnode.trainer.sft_data import BatchOrder, ChatTokens, Example, SftDataError, load_sft_data
from rlnode.weights import lora

log = get_logger("rlnode.trainer.sft")

FINAL_DIR = "final"
MERGED_DIR = "final-merged"  # trainer.lora with sft.merge_lora: the adapter merged into the base
DATA_REPORT = "sft_data.json"


class SftError(RuntimeError):
    """An SFT job that cannot start or resume as asked (the message says why)."""


@dataclass
class StepFigures:
    loss: float  # L of the module docstring
    tokens: int  # assistant tokens trained (N)
    seq_tokens: int  # every token of the batch's conversations
    conversations: int
    lr: float  # the learning rate this step trained with
    grad_norm: float  # before clipping
    stepped: bool  # False: the loss or gradient was not finite, no step taken
    step_s: float


def learner_config(cfg: Config, total_steps: int) -> Config:
    """The Learner's view of an SFT job: the lr schedule over the SFT's
    steps, no RL loss term that would load a second model (KL), rows up to
    sft.max_length tokens for the memory plan, and the chunked head it
    scores with (nll_sum: the plan counts its recompute)."""
    t = msgspec.structs.replace(cfg.trainer, max_steps=total_steps, loss=LossConfig(), logprob_head="chunked")
    m = msgspec.structs.replace(cfg.model, max_model_len=cfg.sft.max_length)
    return msgspec.structs.replace(cfg, trainer=t, model=m)


class SftTrainer:
    """The model, its optimizer, and the SFT step (module docstring)."""

    def __init__(self, cfg: Config, total_steps: int):
        self.cfg = cfg
        self.learner = Learner(learner_config(cfg, total_steps))

    @property
    def model(self) -> torch.nn.Module:
        return self.learner.model

    def micro_batches(self, examples: list[Example]) -> list[list[PackedRow]]:
        """The batch's forward passes, as the RL trainer splits its own:
        trainer.micro_batch_tokens > 0 packs rows to that token budget
        (one sequence for a varlen kernel, else length-bucketed padded
        rows), else trainer.micro_batch_size conversations each, in order."""
        rows, spans = [], 0
        for e in examples:
            rows.append(e.row(spans))
            spans += len(rows[-1].spans)
        budget = self.cfg.trainer.micro_batch_tokens
        if budget > 0:
            layout = budget_micro_batches if self.learner.varlen else bucket_micro_batches
            return [mb.rows for mb in layout(rows, budget)]
        size = self.cfg.trainer.micro_batch_size
        return [rows[i: i + size] for i in range(0, len(rows), size)]

    def nll_sum(self, rows: list[PackedRow]) -> torch.Tensor:
        """sum over the rows' assistant tokens of -log p_theta(x_t | x_<t),
        a scalar carrying its graph."""
        lrn, t = self.learner, self.cfg.trainer
        if lrn.varlen:
            inp = packed_inputs(rows, lrn.device, lrn.attn_impl)
        else:
            inp = padded_inputs(rows, lrn.device)
        # The flat position predicting each assistant token (logits at j predict token j + 1).
        f_idx = [off + start - 1 + j for off, row in zip(inp.offsets, rows) for _, start, n in row.spans
                 for j in range(n)]
        f_i = torch.tensor(f_idx, dtype=torch.long, device=lrn.device)
        model = causal_lm(lrn.model)
        with torch.autocast(lrn.device.type, dtype=torch.bfloat16, enabled=t.precision == "bf16-mixed"):
            hidden = model.base_model(**inp.kwargs).last_hidden_state  # [R, L, H] or [1, S, H]
            logp, _ = chunked_logprobs(model.get_output_embeddings(), hidden.reshape(-1, hidden.shape[-1])[f_i],
                                       inp.ids[f_i + 1], torch.ones(len(f_idx), device=lrn.device),
                                       t.logprob_chunk_tokens, fp32_head=lrn.fp32_head,
                                       entropy_grad=False)  # [N]
        return -logp.sum()

    def accumulate(self, examples: list[Example]) -> float:
        """Backward of L over the batch's micro-batches (each L_m; their
        gradients add up to grad L in the parameters' .grad); returns L."""
        n = sum(e.trained_tokens for e in examples)
        loss = 0.0
        for rows in self.micro_batches(examples):
            part = self.nll_sum(rows) / n
            part.backward()
            loss += float(part.detach())
        return loss

    def step(self, examples: list[Example]) -> StepFigures:
        t0 = time.perf_counter()
        lrn = self.learner
        lr = lrn.scheduler.get_last_lr()[0]
        lrn.optimizer.zero_grad(set_to_none=True)
        loss = self.accumulate(examples)
        # The RL step's own clip and step: a non-finite loss or gradient
        # norm takes no step (nor a schedule step), its gradients dropped.
        grad_norm, stepped = lrn._clip_and_step(math.isfinite(loss))
        return StepFigures(loss, sum(e.trained_tokens for e in examples), sum(len(e.ids) for e in examples),
                           len(examples), lr, grad_norm, stepped, time.perf_counter() - t0)

    @torch.no_grad()
    def mean_nll(self, examples: list[Example]) -> float:
        """The held-out loss: mean over every assistant token of ``examples``."""
        n = sum(e.trained_tokens for e in examples)
        self.model.eval()
        try:
            total = sum(float(self.nll_sum(rows)) for rows in self.micro_batches(examples))
        finally:
            self.model.train()
        return total / n


def load_tokenizer(m: ModelConfig) -> tuple[object, str | None]:
    """(tokenizer, model.chat_template's text or None), as the actor loads them."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(m.tokenizer or m.path), chat_template_text(m)


def check_positions(cfg: Config) -> None:
    """sft.max_length within the model's positions (its config.json)."""
    try:
        conf = json.loads((Path(cfg.model.path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: cannot read {cfg.model.path}/config.json ({e})") from None
    limit = conf.get("max_position_embeddings") or conf.get("text_config", {}).get("max_position_embeddings")
    if limit and cfg.sft.max_length > limit:
        raise ConfigError(f"sft.max_length: {cfg.sft.max_length} is above the model's max_position_embeddings "
                          f"({limit})")


class SftJob:
    """startup (``start``) -> run (``run``) -> shutdown (``finish``)."""

    def __init__(self, cfg: Config, resume: bool = False):
        self.cfg, self.resume = cfg, resume
        self.run_dir = Path(cfg.run.run_dir)
        self.step = 0
        self.last_saved = 0
        self.metrics: MetricsWriter | None = None
        self.progress = cfg.run.progress or sys.stdout.isatty()

    # -- startup ----------------------------------------------------------------------

    def start(self) -> None:
        from rlnode.trainer.trackers import open_sinks

        cfg = self.cfg
        check_sft_job(cfg.sft, cfg.trainer)
        check_positions(cfg)
        self.chat = ChatTokens(*load_tokenizer(cfg.model))
        self.data = load_sft_data(cfg.sft, cfg.run.seed, self.chat)
        self.order = BatchOrder([len(e.ids) for e in self.data.train], cfg.sft, cfg.run.seed)
        self.total = self.order.total_steps()
        self.checkpoints = CheckpointManager(self.run_dir, cfg.trainer.keep_checkpoints)
        if not self.resume and self.checkpoints.latest() is not None:
            raise SftError(f"{self.run_dir} holds the checkpoints of an earlier run: pass --resume to continue it, "
                           "or choose another run.run_dir (--run-dir)")
        resume_from = self._resume_point() if self.resume else None
        self.trainer = SftTrainer(cfg, self.total)
        if resume_from is not None:
            lrn = self.trainer.learner
            state = self.checkpoints.load(resume_from, lrn.model, lrn.optimizer, lrn.scheduler)
            self.step = self.last_saved = int(state["step"])
            log.info("sft.resumed", checkpoint=str(resume_from), step=self.step, total_steps=self.total)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        report = {"files": {f: asdict(c) for f, c in self.data.counts.items()}, "train": len(self.data.train),
                  "held_out": len(self.data.held_out), "total_steps": self.total, **self.data.fingerprint}
        (self.run_dir / DATA_REPORT).write_text(json.dumps(report, indent=1) + "\n")
        self.metrics = MetricsWriter(self.run_dir, open_sinks(cfg, self.run_dir))
        for f, c in self.data.counts.items():
            log.info("sft.data", file=f, **asdict(c))
        log.info("sft.started", train=len(self.data.train), held_out=len(self.data.held_out), step=self.step,
                 total_steps=self.total, device=str(self.trainer.learner.device), lora=is_adapter(self.trainer.model))

    def _resume_point(self) -> Path | None:
        """The checkpoint --resume continues from, checked before the model
        loads: an SFT checkpoint of the same data, template and batching."""
        path = self.checkpoints.latest()
        if path is None:
            log.warning("sft.resume_without_checkpoint", run_dir=str(self.run_dir))
            return None
        saved = json.loads((path / "state.json").read_text()).get("sft")
        if saved is None:
            raise SftError(f"checkpoint {path} is not an `rlnode sft` checkpoint (an RL run's?)")
        changed = sorted(k for k in set(saved) | set(self.data.fingerprint)
                         if saved.get(k) != self.data.fingerprint.get(k))
        if changed:
            raise SftError(f"checkpoint {path} was written with other data, template or batching (changed: "
                           f"{', '.join(changed)}): a resumed run would not train what the interrupted one would have")
        return path

    # -- run --------------------------------------------------------------------------

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Steps until the last, or until ``should_stop()`` (checked
        between steps)."""
        s = self.cfg.sft
        if self.step == 0 and self.data.held_out:
            # The held-out loss before training: what the first evaluation is compared to.
            self.metrics.write({"step": 0, "version": 0, "time": time.time(), **self._held_out()})
        t0, first = time.perf_counter(), self.step
        while self.step < self.total and not should_stop():
            p, idx = self.order.batch(self.step)
            fig = self.trainer.step([self.data.train[i] for i in idx])
            self.step += 1
            rec = self._step_record(p, fig)
            if self.data.held_out and (self.step == self.total or (s.eval_every and self.step % s.eval_every == 0)):
                rec.update(self._held_out())
            self.metrics.write(rec)
            log.info("sft.step", step=self.step, loss=round(fig.loss, 4), tokens=fig.tokens,
                     eval_loss=rec.get("eval_loss"), step_s=round(fig.step_s, 3))
            if self.progress:
                self._print_progress(rec, (time.perf_counter() - t0) / (self.step - first))
            if s.save_every and self.step % s.save_every == 0:
                self.save()

    def _step_record(self, p: int, fig: StepFigures) -> dict:
        """metrics.jsonl's record of the step just taken (``version``: the
        trackers' x axis, the steps the weights have taken)."""
        rec = {"step": self.step, "version": self.step, "time": time.time(), "epoch": p + 1,
               "loss": fig.loss, "tokens": fig.tokens, "seq_tokens": fig.seq_tokens,
               "conversations": fig.conversations, "lr": fig.lr, "grad_norm": fig.grad_norm,
               "step_s": fig.step_s, "tokens_per_s": fig.seq_tokens / max(fig.step_s, 1e-9)}
        if not fig.stepped:
            rec["skipped_step"] = True  # a non-finite loss or gradient: the weights did not move
        return rec

    def _held_out(self) -> dict[str, float]:
        return {"eval_loss": self.trainer.mean_nll(self.data.held_out),
                "eval_tokens": sum(e.trained_tokens for e in self.data.held_out)}

    def _print_progress(self, rec: dict, s_per_step: float) -> None:
        width, done = 24, self.step / self.total
        bar = "#" * int(width * done) + "-" * (width - int(width * done))
        eta = int(s_per_step * (self.total - self.step))
        ev = f"  eval {rec['eval_loss']:.4f}" if "eval_loss" in rec else ""
        line = (f"sft [{bar}] {self.step:>{len(str(self.total))}}/{self.total} {done:4.0%}  epoch {rec['epoch']}  "
                f"loss {rec['loss']:.4f}{ev}  lr {rec['lr']:.2e}  {rec['tokens_per_s']:,.0f} tok/s  "
                f"eta {eta // 60}m{eta % 60:02d}s")
        print(line, flush=True)

    # -- checkpoints and shutdown ---------------------------------------------------

    def save(self) -> Path:
        lrn = self.trainer.learner
        path = self.checkpoints.save(self.step, self.step, lrn.model, lrn.optimizer, lrn.scheduler,
                                     self.cfg.model.path, [], {"run": self.cfg.run.name, "kind": "sft",
                                                               "total_steps": self.total,
                                                               "sft": self.data.fingerprint})
        self.last_saved = self.step
        log.info("sft.checkpoint", path=str(path), step=self.step)
        return path

    def finish(self) -> Path | None:
        """A checkpoint of any step since the last one, then final/ once
        the last step is done; returns final/ (None when stopped early)."""
        try:
            if self.step > self.last_saved:
                self.save()
            if self.step < self.total:
                return None
            final = write_final(self.trainer.model, self.chat, self.cfg, self.run_dir)
            log.info("sft.final", path=str(final), step=self.step)
            return final
        finally:
            self.close()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


# -- final/ ----------------------------------------------------------------------


def write_final(model: torch.nn.Module, chat: ChatTokens, cfg: Config, run_dir: Path) -> Path:
    """final/: full weights, a model folder that model.path loads (config,
    safetensors, the tokenizer with the chat template SFT rendered with);
    with trainer.lora the adapter in peft's format, as an RL run's final/
    (its base named by absolute path), and with sft.merge_lora also
    final-merged/, the adapter merged into the base. Every file 0644,
    every directory 0755: a service user reads them."""
    out = run_dir / FINAL_DIR
    if not is_adapter(model):
        write_model_dir(model, chat, out)
        return out
    lora.write_adapter(str(out), model_adapter_spec(model), lora.adapter_tensors(model),
                       base=os.path.abspath(cfg.model.path))
    make_readable(out)
    if cfg.sft.merge_lora:
        # In place: the job is done with the adapter.
        write_model_dir(model.merge_and_unload(), chat, run_dir / MERGED_DIR)
    return out


def write_model_dir(model: torch.nn.Module, chat: ChatTokens, out: Path) -> None:
    """A Hugging Face model folder at ``out``, replaced whole: written
    beside it, fsynced, renamed in."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if chat.template:
            chat.tok.chat_template = chat.template
        chat.tok.save_pretrained(tmp)
        make_readable(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".old-{out.name}-", dir=out.parent))
            os.rename(out, old / out.name)
        os.rename(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# -- the command ------------------------------------------------------------------


def main_sft(cfg: Config, resume: bool = False) -> int:
    """``rlnode sft``: 0 when final/ is written; 2 for a config or data
    error (the key or file:line named); 128 + the signal when SIGINT or
    SIGTERM stopped it (after the step in progress, with a checkpoint:
    ``--resume`` continues); a second signal exits at once (130)."""
    got: list[int] = []

    def on_signal(signum, _frame) -> None:
        if got:
            os.write(2, b'{"event": "forced exit on second signal"}\n')
            os._exit(130)
        got.append(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    job = SftJob(cfg, resume)
    try:
        job.start()
        job.run(lambda: bool(got))
        final = job.finish()
    except ConfigError as e:
        print(f"rlnode: config error: {e}", file=sys.stderr)
        return 2
    except (SftDataError, SftError) as e:
        print(f"rlnode sft: {e}", file=sys.stderr)
        return 2
    finally:
        job.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if final is None:
        print(f"stopped at step {job.step} of {job.total} (checkpoint in {job.checkpoints.dir}); "
              "`rlnode sft --resume` continues", flush=True)
        return 128 + (got[0] if got else signal.SIGTERM)
    merged = cfg.sft.merge_lora and is_adapter(job.trainer.model)
    print(f"sft done: {job.step} steps; final model in {final}"
          f"{f' (merged: {job.run_dir / MERGED_DIR})' if merged else ''}", flush=True)
    return 0
