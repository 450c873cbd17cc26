"""The score stage of a dataset job: a scorer (a reward or process reward model folder, a
loaded `RewardModel` / `PoolingLLM`, or a Python callable) checked before any work, and every
candidate of every generated row scored into its own resumable shards."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.checks import ValidationError
from batchgen.data.identity import digest, folder_fingerprint
from batchgen.data.rows import OUTPUTS, ROW_ID
from batchgen.data.shards import MANIFEST, ShardStore
from batchgen.data.writers import WRITERS, ShardWriter
from batchgen.log import logger
from batchgen.pooling.steps import StepScoring, label_score

HEADS = ("ForSequenceClassification", "ForTokenClassification")
GENERATORS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
SCORES = "scores"
STEP_SCORES = "step_scores"  # a PRM's scores of each candidate's steps
CANDIDATES = "candidates"  # a digest of what a row's scores were computed from
_SCORE_SCHEMA = pa.schema([pa.field(ROW_ID, pa.int64()), pa.field(CANDIDATES, pa.string()),
                           pa.field(SCORES, pa.list_(pa.float64()))])
_STEP_SCHEMA = _SCORE_SCHEMA.append(pa.field(STEP_SCORES, pa.list_(pa.list_(pa.float64()))))


def step_scoring(score: object, prm_step_tag: str | None, prm_aggregate: str | None,
                 prm_step_separator: str | None) -> StepScoring | None:
    """A process reward model scorer's StepScoring (its tag checked against the PRM's
    tokenizer), None for any other scorer; before any work. The prm_* arguments with another
    scorer are refused, naming them."""
    given = {"prm_step_tag": prm_step_tag, "prm_aggregate": prm_aggregate,
             "prm_step_separator": prm_step_separator}
    named = {"tag": prm_step_tag, "aggregate": prm_aggregate, "separator": prm_step_separator}
    steps = StepScoring(**{k: v for k, v in named.items() if v is not None})
    tokenizer = _prm_tokenizer(score)
    if tokenizer is None:
        for name, value in given.items():
            if value is not None:
                raise ValidationError(f"{name} goes with a process reward model scorer (a "
                                      f"*ForTokenClassification), got score={score!r}",
                                      parameter=name, value=value)
        return None
    steps.tag_id(tokenizer)
    return steps


def _prm_tokenizer(score: object) -> Any:
    """The tokenizer of a process reward model scorer (a folder, a RewardModel or a
    PoolingLLM over a *ForTokenClassification), else None."""
    if isinstance(score, (str, os.PathLike)):
        config = Path(score).expanduser() / "config.json"
        archs = json.loads(config.read_text()).get("architectures") or []
        if not any(a.endswith("ForTokenClassification") for a in archs):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(Path(score).expanduser())
    heads = getattr(score, "scores", score)
    if not getattr(heads, "token_level", False):
        return None
    return heads.llm.get_tokenizer()


def _bad(message: str, value: object) -> ValidationError:
    return ValidationError(f"score must be a reward model folder (*ForSequenceClassification), "
                           f"a process reward model folder (*ForTokenClassification), a "
                           f"RewardModel / PoolingLLM, or a callable (prompt, text) -> float: "
                           f"{message}", parameter="score", value=value)


def check_scorer(score: object) -> None:
    """Refuse, before any work: a generator (an LLM, a causal-LM folder), a folder without a
    classification head, or anything that is none of the accepted kinds."""
    from batchgen.llm import LLM

    if isinstance(score, (str, os.PathLike)):
        config = Path(score).expanduser() / "config.json"
        if not config.is_file():
            raise _bad(f"{str(score)!r} is not a model folder (no config.json)", score)
        archs = json.loads(config.read_text()).get("architectures") or []
        if any(a.endswith(HEADS) for a in archs):
            return
        if any(a.endswith(GENERATORS) for a in archs):
            raise _bad(f"{str(score)!r} is a generator ({archs}), not a scorer", score)
        raise _bad(f"{str(score)!r} has no classification head (architectures {archs})", score)
    if hasattr(score, "reward") and hasattr(score, "classify"):
        return
    if isinstance(score, LLM):
        raise _bad("got a generator LLM (build the scorer from a reward model folder)",
                   type(score).__name__)
    if not callable(score):
        raise _bad(f"got {type(score).__name__}", type(score).__name__)


def scorer_identity(score: Any) -> dict[str, Any]:
    """What identifies a scorer in the score stage's fingerprint: a folder by its files, a
    model object by its folder, a callable by its qualified name (rename it, or change
    `score_version`, to rescore with changed code)."""
    if isinstance(score, (str, os.PathLike)):
        path = Path(score).expanduser().resolve()
        return {"scorer": str(path), "scorer_files": folder_fingerprint(path)}
    llm = getattr(score, "llm", score)
    path = getattr(llm, "model_path", None)
    if hasattr(score, "reward") and path is not None:
        files = folder_fingerprint(path) if Path(str(path)).is_dir() else None
        return {"scorer": str(path), "scorer_files": files}
    name = getattr(score, "__qualname__", type(score).__qualname__)
    return {"scorer": f"{getattr(score, '__module__', '')}.{name}"}


@dataclass
class Scorer:
    """A checked scorer, loaded when the score stage first needs it (a folder's model is
    built after the generator went to sleep). `workers`: the callable's thread pool."""

    spec: Any
    workers: int = 4
    steps: StepScoring | None = None  # a process reward model's step scoring
    model: Any = field(default=None, init=False)
    before: Callable[[], None] | None = field(default=None, init=False)  # runs before a model
    # scores (the stages swap the models there)
    scored: int = field(default=0, init=False)  # candidates scored by this process

    @property
    def is_model(self) -> bool:
        return isinstance(self.spec, (str, os.PathLike)) or hasattr(self.spec, "reward")

    def load(self) -> None:
        if self.model is None and isinstance(self.spec, (str, os.PathLike)):
            from batchgen.pooling.scorer import RewardModel

            self.model = RewardModel(str(Path(self.spec).expanduser()), enable_sleep_mode=True)
        elif self.model is None and hasattr(self.spec, "reward"):
            self.model = self.spec

    def identity(self) -> dict[str, Any]:
        """The score stage's fingerprint: the scorer's, and a PRM's step scoring."""
        steps = self.steps
        extra = {} if steps is None else {"prm": [steps.tag, steps.aggregate, steps.separator]}
        return {**scorer_identity(self.spec), **extra}

    def __call__(self, pairs: list[tuple[str, str]]
                 ) -> tuple[list[float], list[list[float]] | None]:
        """Scores of (prompt, candidate text) pairs, and a PRM's step scores (else None): a
        model's over prompt + text (one call: a prompt's candidates share its blocks), a
        PRM's over the steps with their tags, or the callable's, in the thread pool."""
        self.scored += len(pairs)
        if not pairs:
            return [], None if self.steps is None else []
        if not self.is_model:
            with ThreadPoolExecutor(max_workers=self.workers) as pool:
                return [float(s) for s in pool.map(lambda pt: self.spec(*pt), pairs)], None
        if self.before is not None:
            self.before()
        self.load()
        if self.steps is not None:
            steps = self.steps.score_steps(getattr(self.model, "scores", self.model), pairs)
            return [self.steps.reduce(s) for s in steps], steps
        outs = self.model.classify([p + t for p, t in pairs])
        return [label_score(o.outputs.probs) for o in outs], None


def stage_fingerprint(store_dir: Path) -> str:
    """A finished stage's output, by its manifest's job and its shards' hashes (what the
    next stage's fingerprint builds on)."""
    manifest = json.loads((store_dir / MANIFEST).read_text())
    return digest([manifest["job"], [s["sha256"] for s in manifest["shards"]]])


def open_stage(out: Path, job: dict[str, Any], writer: ShardWriter = WRITERS["parquet"],
               rows_per_shard: int = 256) -> ShardStore:
    """A stage's store in `out`, resumed when it holds the same job; a different job's shards
    (another scorer, another policy) are removed first: that stage alone is redone."""
    manifest = out / MANIFEST
    if manifest.is_file() and json.loads(manifest.read_text()).get("job") != job:
        logger.info("%s: its job changed (scorer, policy or inputs): redoing this stage", out)
        for p in out.iterdir():
            if p.name == MANIFEST or p.name.startswith(("part-", ".part-")):
                p.unlink()
    store = ShardStore(out, job, resume=True, writer=writer, rows_per_shard=rows_per_shard)
    store.reconcile(None, errors=False)  # (lists the job as it is: no stored input keys)
    return store


def by_shard(ids: Iterable[int], size: int) -> dict[int, list[int]]:
    """Row ids grouped by the shard that holds them (shard k: ids [k*size, (k+1)*size))."""
    groups: dict[int, list[int]] = {}
    for i in sorted(ids):
        groups.setdefault(i // size, []).append(i)
    return groups


def score_rows(rows: list[dict[str, Any]], prompt_of: Callable[[dict[str, Any]], str],
               scorer: Scorer, store: ShardStore | None, rows_per_shard: int
               ) -> dict[int, list[float]]:
    """Every candidate of `rows` (generated rows) scored, row id -> scores in candidate
    order; with a store, into shards by row id. A row whose prompt and candidate texts are
    those its shard scored keeps its scores (a resume after a kill, or after rows were added
    or edited, scores only the rest, and writes again only the shards that held others). A
    PRM's step scores go into each candidate of `rows` as `step_scores`."""
    done: dict[int, tuple[str, list[float], Any]] = {}
    if store is not None:
        rows_per_shard = store.rows_per_shard
        for f in store.files():
            done.update((r[ROW_ID], (r[CANDIDATES], r[SCORES], r.get(STEP_SCORES)))
                        for r in store.writer.rows(f))
    by_id = {r[ROW_ID]: r for r in rows}
    prompts = {i: prompt_of(r) if r[OUTPUTS] else "" for i, r in by_id.items()}  # (error rows)
    keys = {i: digest([prompts[i], [c["text"] for c in r[OUTPUTS]]]) for i, r in by_id.items()}
    groups = by_shard(by_id, rows_per_shard)
    for k, ids in groups.items():
        todo = [i for i in ids if done.get(i, ("",))[0] != keys[i]]
        if not todo and (store is None or store.ids_in(k) == ids):
            continue
        pairs = [(prompts[i], c["text"]) for i in todo for c in by_id[i][OUTPUTS]]
        (flat, steps), at = scorer(pairs), 0
        for i in todo:
            n = len(by_id[i][OUTPUTS])
            done[i] = (keys[i], flat[at:at + n], None if steps is None else steps[at:at + n])
            at += n
        if store is not None:
            store.put(k, [_score_row(i, done[i], scorer.steps is not None) for i in ids],
                      _SCORE_SCHEMA if scorer.steps is None else _STEP_SCHEMA)
    if store is not None:
        store.keep_only(set(groups))
        store.finish()
    if scorer.steps is not None:
        for i, r in by_id.items():
            for c, s in zip(r[OUTPUTS], done[i][2] or []):
                c[STEP_SCORES] = s
    return {i: done[i][1] for i in by_id}


def _score_row(row_id: int, done: tuple[str, list[float], Any], steps: bool) -> dict[str, Any]:
    """One row of a score shard: its candidates' digest, scores and (a PRM's) step scores."""
    row = {ROW_ID: row_id, CANDIDATES: done[0], SCORES: done[1]}
    return row | ({STEP_SCORES: done[2]} if steps else {})
