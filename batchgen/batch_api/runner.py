"""`run_batch`: an OpenAI Batch API file through one `LLM` in one streamed call, one output
line per input line (same custom_id, input order), written atomically by the dataset jobs'
JSONL writer (batchgen.data.writers). Finished answers are appended to a progress file as they
come, each with its request's fingerprint (the model's identity, the served name, the chat
template, the line's url and body, the bytes of its file:// images), and the output's
fingerprints are kept beside it, so `resume=True` reuses exactly the answers whose request is
unchanged and recomputes the rest."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchgen.batch_api.embeddings import embedding_answers, render_embedding
from batchgen.batch_api.paths import check_paths, fingerprints_path, progress_path
from batchgen.batch_api.requests import (
    EMBEDDINGS_URL,
    BatchRequest,
    LineError,
    chat_messages,
    completion_prompt,
    custom_id_of,
    file_images,
    parse_line,
    sampling_params,
)
from batchgen.batch_api.responses import answer_line, embedding_line, error_line
from batchgen.checks import check_flag
from batchgen.data.identity import digest, model_identity
from batchgen.data.writers import atomic_write, jsonl_text, read_jsonl, write_jsonl
from batchgen.kinds import SAMPLES
from batchgen.pooling.llm import PoolingLLM

if TYPE_CHECKING:
    from batchgen.llm import LLM

_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FINGERPRINTS_FORMAT = "batchgen-run-batch/1"


@dataclass(frozen=True)
class BatchSummary:
    """What one run did: lines answered now for the first time, answers reused from a previous
    run, error lines, and lines answered before but recomputed because their request changed
    (another model, body, served name or chat template)."""

    answered: int
    reused: int
    errors: int
    recomputed: int = 0

    @property
    def lines(self) -> int:
        return self.answered + self.reused + self.errors + self.recomputed


@dataclass
class _Plan:
    """A run's lines: each a reused answer, an error line or a placeholder request (in
    `todo`); the fingerprint of every request; the custom_ids answered before with another."""

    lines: list[Any]
    todo: list[BatchRequest]
    fingerprints: dict[str, str]  # custom_id -> its request's fingerprint
    changed: set[str]
    reused: int = 0


def run_batch(llm: LLM, input_path: str | os.PathLike, output_path: str | os.PathLike, *,
              resume: bool = False, overwrite: bool = False, model_name: str | None = None,
              chat_template: str | None = None, use_tqdm: bool = True) -> BatchSummary:
    """Serve every line of `input_path` (OpenAI Batch API JSONL: custom_id, method, url, body
    for /v1/chat/completions or /v1/completions) and write `output_path`. A line that cannot
    be served gets an error line; blank lines are skipped. An existing output is replaced only
    with `overwrite`; with `resume`, an answer in `output_path` or in its progress file is
    reused when its line's request is the same (model, served name, chat template, url, body),
    and recomputed when it changed."""
    check_flag(resume, "resume")
    check_flag(overwrite, "overwrite")
    src, out = Path(input_path).expanduser(), Path(output_path).expanduser()
    check_paths(src, out, resume, overwrite)
    progress = progress_path(out)
    name = model_name or llm.model_path.name
    identity = {**model_identity(llm), "served_as": name, "chat_template": chat_template}
    done = _answered(out, progress) if resume else {}
    plan = _prepare(llm, src.read_text().splitlines(), done, identity, chat_template)
    with open(progress, "a" if resume else "w", encoding="utf-8") as log:
        _serve(llm, plan, name, log, use_tqdm)
    write_jsonl(plan.lines, out)
    _write_fingerprints(out, plan)
    progress.unlink(missing_ok=True)
    errors = sum(1 for v in plan.lines if v.get("error") is not None)
    recomputed = sum(1 for r in plan.todo if r.custom_id in plan.changed)
    return BatchSummary(len(plan.todo) - recomputed, plan.reused, errors, recomputed)


def _prepare(llm: LLM, raw: list[str], done: dict[str, tuple[dict[str, Any], str | None]],
             identity: dict[str, Any], chat_template: str | None) -> _Plan:
    """Per non-blank line: a reused answer (its request's fingerprint equal to the one it was
    answered under), an error line, or a placeholder for a request to run (rendered and
    checked)."""
    defaults = llm.get_default_sampling_params()
    defaults_kw = {k: getattr(defaults, k) for k in _DEFAULT_KEYS}
    plan = _Plan([], [], {}, set())
    for number, text in enumerate(raw, 1):
        if not text.strip():
            continue
        try:
            req = parse_line(text, number)
            req.line = len(plan.lines)
            if req.custom_id in plan.fingerprints:
                raise LineError("duplicate_custom_id", f"custom_id {req.custom_id!r} appears "
                                "on an earlier line", "custom_id")
            images = file_images(req.body)  # absent without file:// images (older files)
            fingerprint = digest({**identity, "url": req.url, "body": req.body,
                                  **({"image_files": images} if images else {})})
            plan.fingerprints[req.custom_id] = fingerprint
            if req.custom_id in done:
                answer, was = done[req.custom_id]
                if was == fingerprint:
                    plan.lines.append(answer)
                    plan.reused += 1
                    continue
                plan.changed.add(req.custom_id)
            _render(llm, req, defaults_kw, chat_template)
        except LineError as e:
            plan.lines.append(error_line(custom_id_of(text), e))
            continue
        plan.lines.append(req)
        plan.todo.append(req)
    return plan


def _render(llm: LLM, req: BatchRequest, defaults: dict[str, Any],
            chat_template: str | None) -> None:
    """Set the request's prompt and params, and check it as `generate` would (LineError)."""
    if req.url == EMBEDDINGS_URL:
        render_embedding(llm, req)
        return
    if isinstance(llm, PoolingLLM):
        raise LineError("invalid_url", f"{req.url} needs a generative model (this is a pooling "
                        f"model: {EMBEDDINGS_URL} with an embedding model)", "url")
    req.params = sampling_params(req, defaults)
    try:
        if req.is_chat:
            kwargs = req.body.get("chat_template_kwargs")
            if kwargs is not None and not isinstance(kwargs, dict):
                raise LineError("invalid_request", "chat_template_kwargs must be an object",
                                "chat_template_kwargs")
            (req.prompt,) = llm.requests.render_chat([chat_messages(req.body)], chat_template,
                                                     True, False, None, kwargs)
        else:
            req.prompt = completion_prompt(req.body)
            if isinstance(req.prompt, dict) and llm.tokenizer is not None:
                req.prompt["prompt"] = llm.tokenizer.decode(req.prompt["prompt_token_ids"])
        llm.requests.check_one(req.prompt, req.params, SAMPLES)
    except LineError:
        raise
    except Exception as e:  # the chat template's own errors (jinja) and the engine's checks
        raise LineError("invalid_request", str(e) or type(e).__name__) from e


def _serve(llm: LLM, plan: _Plan, model: str, log: Any, use_tqdm: bool) -> None:
    """Run every request in one streamed call; each answer replaces its placeholder and is
    appended to the progress log, with its request's fingerprint, as it finishes."""
    embeds = [r for r in plan.todo if r.url == EMBEDDINGS_URL]
    if embeds:
        for req, body in zip(embeds, embedding_answers(llm, embeds, model)):
            _answer(plan, log, req, embedding_line(req, body))
    todo = [r for r in plan.todo if r.url != EMBEDDINGS_URL]
    if not todo:
        return
    stream = llm.generate_stream([r.prompt for r in todo], [r.params for r in todo],
                                 use_tqdm=use_tqdm)
    try:
        for index, out in stream:
            _answer(plan, log, todo[index], answer_line(todo[index], out, model))
    finally:
        log.flush()
        os.fsync(log.fileno())


def _answer(plan: _Plan, log: Any, req: BatchRequest, answer: dict[str, Any]) -> None:
    """An answer replaces its placeholder and is appended to the progress log with its
    request's fingerprint."""
    plan.lines[req.line] = answer
    log.write(jsonl_text([{"fingerprint": plan.fingerprints[req.custom_id],
                           "answer": answer}]))
    log.flush()


def _write_fingerprints(out: Path, plan: _Plan) -> None:
    """Beside the output (atomically, after it): each answer's request fingerprint by answer
    id, so a later resume knows what every answer was computed for."""
    ids = {v["id"]: plan.fingerprints[v["custom_id"]] for v in plan.lines
           if v.get("error") is None and v.get("custom_id") in plan.fingerprints}
    payload = json.dumps({"format": FINGERPRINTS_FORMAT, "answers": ids}) + "\n"
    atomic_write(fingerprints_path(out), lambda tmp: tmp.write_text(payload))


def _answered(out: Path, progress: Path) -> dict[str, tuple[dict[str, Any], str | None]]:
    """custom_id -> (answer line with status 200, the fingerprint of the request it answered,
    None when unknown) from a previous output (fingerprints from the file beside it) and from
    the progress log, which is newer (a torn last line of the log, from a kill, is ignored)."""
    done: dict[str, tuple[dict[str, Any], str | None]] = {}
    if out.is_file():
        known = _stored_fingerprints(out)
        for obj in read_jsonl(out, skip_torn=True):
            if _is_answer(obj):
                done[obj["custom_id"]] = (obj, known.get(obj.get("id")))
    if progress.is_file():
        for obj in read_jsonl(progress, skip_torn=True):
            entry = obj.get("answer") if isinstance(obj, dict) else None
            if _is_answer(entry):
                done[entry["custom_id"]] = (entry, obj.get("fingerprint"))
    return done


def _stored_fingerprints(out: Path) -> dict[str, str]:
    """The fingerprints kept beside `out` by answer id (none when missing or unreadable: its
    answers are then recomputed)."""
    try:
        stored = json.loads(fingerprints_path(out).read_text())
    except (OSError, ValueError):
        return {}
    answers = stored.get("answers") if isinstance(stored, dict) else None
    return answers if stored.get("format") == FINGERPRINTS_FORMAT and isinstance(
        answers, dict) else {}


def _is_answer(obj: Any) -> bool:
    """A served line (status 200) with a custom_id."""
    response = obj.get("response") if isinstance(obj, dict) else None
    return isinstance(response, dict) and response.get("status_code") == 200 \
        and isinstance(obj.get("custom_id"), str)
