"""`run_batch`: an OpenAI Batch API file through one `LLM` in one streamed call, one output
line per input line (same custom_id, input order), written atomically by the dataset jobs'
JSONL writer (batchgen.data.writers); finished answers are appended to a progress file as they
come, so `resume=True` skips what a stopped run answered."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchgen.batch_api.requests import (
    BatchRequest,
    LineError,
    chat_messages,
    completion_prompt,
    custom_id_of,
    parse_line,
    sampling_params,
)
from batchgen.batch_api.responses import answer_line, error_line
from batchgen.checks import check_flag
from batchgen.data.writers import jsonl_text, read_jsonl, write_jsonl
from batchgen.kinds import SAMPLES

if TYPE_CHECKING:
    from batchgen.llm import LLM

_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class BatchSummary:
    """What one run did: lines answered now, answers reused from a previous run, error lines."""

    answered: int
    reused: int
    errors: int

    @property
    def lines(self) -> int:
        return self.answered + self.reused + self.errors


def run_batch(llm: LLM, input_path: str | os.PathLike, output_path: str | os.PathLike, *,
              resume: bool = False, model_name: str | None = None,
              chat_template: str | None = None, use_tqdm: bool = True) -> BatchSummary:
    """Serve every line of `input_path` (OpenAI Batch API JSONL: custom_id, method, url, body
    for /v1/chat/completions or /v1/completions) and write `output_path`. A line that cannot
    be served gets an error line; blank lines are skipped. With `resume`, custom_ids answered
    in `output_path` or in its progress file are not run again."""
    check_flag(resume, "resume")
    src, out = Path(input_path).expanduser(), Path(output_path).expanduser()
    if not src.is_file():
        raise FileNotFoundError(f"input {str(src)!r} is not a file")
    if out.is_dir():
        raise ValueError(f"output {str(out)!r} is a folder: give a file path")
    progress = out.with_name(f".{out.name}.partial")
    done = _answered(out, progress) if resume else {}
    name = model_name or llm.model_path.name
    lines, todo = _prepare(llm, src.read_text().splitlines(), done, chat_template)
    reused = sum(1 for v in lines if isinstance(v, dict) and v.get("custom_id") in done
                 and v is done[v["custom_id"]])
    with open(progress, "a" if resume else "w", encoding="utf-8") as log:
        _serve(llm, todo, lines, name, log, use_tqdm)
    write_jsonl(lines, out)
    progress.unlink(missing_ok=True)
    errors = sum(1 for v in lines if v.get("error") is not None)
    return BatchSummary(len(todo), reused, errors)


def _prepare(llm: LLM, raw: list[str], done: dict[str, dict[str, Any]],
             chat_template: str | None) -> tuple[list[Any], list[BatchRequest]]:
    """Per non-blank line: a reused answer, an error line, or a placeholder for a request to
    run (returned in `todo`, rendered and checked)."""
    defaults = llm.get_default_sampling_params()
    defaults_kw = {k: getattr(defaults, k) for k in _DEFAULT_KEYS}
    lines: list[Any] = []
    todo: list[BatchRequest] = []
    seen: set[str] = set()
    for number, text in enumerate(raw, 1):
        if not text.strip():
            continue
        try:
            req = parse_line(text, number)
            req.line = len(lines)
            if req.custom_id in seen:
                raise LineError("duplicate_custom_id", f"custom_id {req.custom_id!r} appears "
                                "on an earlier line", "custom_id")
            seen.add(req.custom_id)
            if req.custom_id in done:
                lines.append(done[req.custom_id])
                continue
            _render(llm, req, defaults_kw, chat_template)
        except LineError as e:
            lines.append(error_line(custom_id_of(text), e))
            continue
        lines.append(req)
        todo.append(req)
    return lines, todo


def _render(llm: LLM, req: BatchRequest, defaults: dict[str, Any],
            chat_template: str | None) -> None:
    """Set the request's prompt and params, and check it as `generate` would (LineError)."""
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


def _serve(llm: LLM, todo: list[BatchRequest], lines: list[Any], model: str, log: Any,
           use_tqdm: bool) -> None:
    """Run every request in one streamed call; each answer replaces its placeholder and is
    appended to the progress log as it finishes."""
    if not todo:
        return
    stream = llm.generate_stream([r.prompt for r in todo], [r.params for r in todo],
                                 use_tqdm=use_tqdm)
    try:
        for index, out in stream:
            req = todo[index]
            answer = answer_line(req, out, model)
            lines[req.line] = answer
            log.write(jsonl_text([answer]))
            log.flush()
    finally:
        log.flush()
        os.fsync(log.fileno())


def _answered(out: Path, progress: Path) -> dict[str, dict[str, Any]]:
    """custom_id -> answer line (status 200) in a previous output and in the progress log
    (a torn last line of the log, from a kill, is ignored)."""
    done: dict[str, dict[str, Any]] = {}
    for path in (out, progress):
        if not path.is_file():
            continue
        for obj in read_jsonl(path, skip_torn=True):
            response = obj.get("response") if isinstance(obj, dict) else None
            if isinstance(response, dict) and response.get("status_code") == 200 \
                    and isinstance(obj.get("custom_id"), str):
                done[obj["custom_id"]] = obj
    return done

