"""`generate_dataset` with a score stage and a select stage (best-of-n, rejection sampling,
DPO pairs, `until:k` rounds): each stage in its own folder under `output_dir` with its own
fingerprint, so a resume redoes only the stages whose inputs, model or policy changed.

    output_dir/generate/   the n candidates per row (generate_dataset's shards and manifest)
    output_dir/score/      row_id -> each candidate's score (fingerprint: the generate
                           stage's output + the scorer)
    output_dir/round-R/    until:k's later rounds (R = 1, 2, ...): generate/ and score/ of the
                           rows still open
    output_dir/selected/   the result: the rows with every candidate's score and the
                           `selected` column (fingerprint: the score stages' + the policy)

The generator and a scorer model run in sequential phases on one process: the generator's
pool is released (sleep mode, when the LLM has it) while the scorer runs, and the scorer's
while the generator runs."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from batchgen.checks import ValidationError, check_int, is_number
from batchgen.data import runner
from batchgen.data.rows import ADDED_COLUMNS, ERROR, OUTPUTS, ROW_ID, job_seed, row_seed
from batchgen.data.scoring import (
    STEP_SCORES,
    Scorer,
    by_shard,
    check_scorer,
    open_stage,
    score_rows,
    stage_fingerprint,
    step_scoring,
)
from batchgen.data.writers import writer_for
from batchgen.params import SamplingParams
from batchgen.pooling.select import POLICIES, Select, parse_select

if TYPE_CHECKING:
    import datasets

    from batchgen.llm import LLM

SELECTED, REJECTED, ROUNDS, SCORE = "selected", "rejected", "rounds", "score"
SOURCE = "_source_row_id"  # a later round's rows: the id of the row they continue


@dataclass(frozen=True)
class Until:
    """`until:k`: rounds of n samples per row until k candidates score >= `threshold` or the
    next round would pass `max_candidates`."""

    k: int
    threshold: float
    max_candidates: int

    def chosen(self, scores: list[float]) -> list[int]:
        return [i for i, s in enumerate(scores) if s >= self.threshold][:self.k]


def parse_policy(select: object, threshold: object, max_candidates: object, params: Any,
                 score: object) -> Select | Until | None:
    """The selection policy, or a ValidationError naming the argument, before any work."""
    if select is None:
        for name, value in (("threshold", threshold), ("max_candidates", max_candidates)):
            if value is not None:
                raise ValidationError(f"{name} goes with select='until:k', got select=None",
                                      parameter=name, value=value)
        return None
    if score is None:
        raise ValidationError("select needs score= (a reward model folder, a RewardModel or "
                              "a callable verifier) to rank the candidates by",
                              parameter="select", value=select)
    if not (isinstance(select, str) and select.startswith("until:")):
        if threshold is not None or max_candidates is not None:
            raise ValidationError("threshold and max_candidates go with select='until:k' (a "
                                  "threshold policy is select='threshold:X')",
                                  parameter="threshold", value=threshold)
        return parse_select(select)
    k = select.removeprefix("until:")
    if not k.isdigit() or int(k) < 1:
        raise ValidationError(f"select must be one of {POLICIES} or until:k (k an int >= 1), "
                              f"got {select!r}", parameter="select", value=select)
    if not (is_number(threshold) and math.isfinite(float(threshold))):  # type: ignore[arg-type]
        raise ValidationError(f"threshold must be a number (the score a candidate must reach "
                              f"under select='until:k'), got {threshold!r}",
                              parameter="threshold", value=threshold)
    if not isinstance(params, SamplingParams):
        raise ValidationError("select='until:k' samples in rounds: params must be "
                              f"SamplingParams, got {type(params).__name__}",
                              parameter="params", value=type(params).__name__)
    budget = 4 * params.n if max_candidates is None else max_candidates
    check_int(budget, "max_candidates", minimum=params.n)
    return Until(int(k), float(threshold), int(budget))  # type: ignore[arg-type]


def generate_dataset(llm: LLM, data: Any, params: Any = None, *, score: Any = None,
                     select: str | None = None, threshold: float | None = None,
                     max_candidates: int | None = None, score_workers: int = 4,
                     prm_step_tag: str | None = None, prm_aggregate: str | None = None,
                     prm_step_separator: str | None = None, **kwargs: Any) -> datasets.Dataset:
    """`batchgen.data.runner.generate_dataset` (every argument of it in `kwargs`), then, with
    `score`, every candidate scored, and with `select` a selection column. A process reward
    model scorer scores each response's steps (split at `prm_step_separator`, default
    "\\n\\n"; `prm_step_tag` after each, default "<extra_0>"), kept as `step_scores`, and
    `prm_aggregate` (min, last, mean or prod; default min) makes the score. See
    docs/best_of_n.md."""
    prm = (prm_step_tag, prm_aggregate, prm_step_separator)
    if score is None and select is None and threshold is None and max_candidates is None \
            and prm == (None, None, None):
        return runner.generate_dataset(llm, data, params, **kwargs)
    params = llm.get_default_sampling_params() if params is None else params
    policy = parse_policy(select, threshold, max_candidates, params, score)
    check_scorer(score)
    check_int(score_workers, "score_workers")
    scorer = Scorer(score, score_workers, step_scoring(score, *prm))
    return _Stages(llm, data, params, policy, scorer, kwargs).run()


def _signature() -> inspect.Signature:
    """The runner's parameters and the stages' own (what docs/api.md lists)."""
    base = inspect.signature(runner.generate_dataset)
    own = [p for p in inspect.signature(generate_dataset).parameters.values()
           if p.kind is p.KEYWORD_ONLY]
    return base.replace(parameters=[*base.parameters.values(), *own])


generate_dataset.__signature__ = _signature()  # type: ignore[attr-defined]


class _Stages:
    """One staged job: generate (rounds, under until:k), score, select."""

    def __init__(self, llm: LLM, data: Any, params: Any, policy: Select | Until | None,
                 scorer: Scorer, kwargs: dict[str, Any]) -> None:
        self.llm, self.data, self.params, self.policy, self.scorer = llm, data, params, policy, scorer
        self.kwargs = dict(kwargs)
        out = self.kwargs.pop("output_dir", None)
        self.out = None if out is None else Path(out).expanduser()
        self.resume = self.kwargs.pop("resume", False)
        self.seed = job_seed(params, self.kwargs.pop("seed", None))
        self.rows_per_shard = self.kwargs.get("rows_per_shard", runner.DEFAULT_ROWS_PER_SHARD)
        self.writer = writer_for(self.kwargs.get("output_format", "parquet"))
        self.score_dirs: list[Path] = []

    def run(self) -> datasets.Dataset:
        """The stages in order; at the end (or on an error) the generator is awake again and
        a scorer model this job loaded is dropped."""
        try:
            first = self._round(0, self.data, self.params, self.seed)
            rows = {r[ROW_ID]: r for r in first[0]}
            state = {i: (r[OUTPUTS], first[1].get(i, []), 1) for i, r in rows.items()}
            if isinstance(self.policy, Until):
                self._more_rounds(rows, state)
            return self._select(rows, state, first[2])
        finally:
            if self.scorer.model is not self.scorer.spec:
                self.scorer.model = None
            _wake(self.llm)

    def _dir(self, r: int, stage: str) -> Path | None:
        if self.out is None:
            return None
        return self.out / stage if r == 0 else self.out / f"round-{r}" / stage

    def _round(self, r: int, data: Any, params: Any, seed: int
               ) -> tuple[list[dict[str, Any]], dict[int, list[float]], pa.Schema]:
        """Generate (the scorer's pool asleep), then score (the generator's asleep)."""
        gen_dir = self._dir(r, "generate")
        _sleep(_engine(self.scorer.model))
        _wake(self.llm)
        ds = runner.generate_dataset(self.llm, data, params, output_dir=gen_dir,
                                     resume=self.resume, seed=seed, **self.kwargs)
        rows = ds.to_list()
        store = None
        if gen_dir is not None:
            score_dir = self._dir(r, "score")
            self.score_dirs.append(score_dir)  # type: ignore[arg-type]
            store = open_stage(score_dir, {"stage": "score",  # type: ignore[arg-type]
                                           **self.scorer.identity()},
                               rows_per_shard=self.rows_per_shard)
        self.scorer.before = self._to_scorer  # only if a candidate is left to score
        scores = score_rows(rows, self._prompt_of, self.scorer, store, self.rows_per_shard)
        return rows, scores, ds.data.schema

    def _to_scorer(self) -> None:
        """The generator to sleep, the scorer model loaded (or woken)."""
        _sleep(self.llm)
        self.scorer.load()
        _wake(_engine(self.scorer.model))

    def _prompt_of(self, row: dict[str, Any]) -> str:
        return prompt_text(self.llm.get_tokenizer(), row, self.kwargs)

    def _more_rounds(self, rows: dict[int, dict[str, Any]], state: dict[int, Any]) -> None:
        """until:k: rounds of n for the rows still open (fewer than k passed, budget left),
        each seeded from (job seed, round): a resume redoes the same rounds."""
        import datasets

        policy, n, r = self.policy, self.params.n, 1
        assert isinstance(policy, Until)
        while True:
            open_ids = [i for i, (outs, scores, _) in state.items() if outs
                        and len(policy.chosen(scores)) < policy.k
                        and len(outs) + n <= policy.max_candidates]
            if not open_ids:
                return
            data = datasets.Dataset.from_list([{**_inputs(rows[i]), SOURCE: i}
                                               for i in open_ids])
            params = replace(self.params, seed=None)
            got, scores, _ = self._round(r, data, params, row_seed(self.seed, -r))
            for row in got:
                i = row[SOURCE]
                outs, old, rounds = state[i]
                state[i] = (outs + row[OUTPUTS], old + scores[row[ROW_ID]], rounds + 1)
            r += 1

    def _select(self, rows: dict[int, dict[str, Any]], state: dict[int, Any],
                schema: pa.Schema) -> datasets.Dataset:
        """The result rows (candidates with scores, the selection), written as the select
        stage (only the rows its shards lack) and read back ordered by row_id."""
        import datasets

        schema = final_schema(schema, self.policy, self.scorer.steps is not None)
        store = None
        if self.out is not None:
            job = {"stage": "select", "policy": repr(self.policy),
                   "scores": [stage_fingerprint(d) for d in self.score_dirs]}
            store = open_stage(self.out / SELECTED, job, self.writer, self.rows_per_shard)
        if store is None:
            kept = [final_row(rows[i], *state[i], self.policy) for i in sorted(rows)]
            return datasets.Dataset(pa.Table.from_pylist(kept, schema=schema))
        groups = by_shard(rows, store.rows_per_shard)
        for k, ids in groups.items():  # a shard written whole, unless it is already
            if store.ids_in(k) != ids:
                store.put(k, [final_row(rows[i], *state[i], self.policy) for i in ids], schema)
        store.keep_only(set(groups))
        store.finish()
        return store.writer.load(store.files(), schema).sort(ROW_ID)


def prompt_text(tok: Any, row: dict[str, Any], kwargs: dict[str, Any]) -> str:
    """The prompt text a candidate is scored after (prompt + candidate): the row's prompt
    column, its messages rendered through the chat template, or its token ids decoded
    (`kwargs`: the job's prompt_column / messages_column / chat template arguments)."""
    messages = kwargs.get("messages_column")
    value = row[messages or kwargs.get("prompt_column", "prompt")]
    if messages:
        return tok.apply_chat_template(
            value, tokenize=False, chat_template=kwargs.get("chat_template"),
            add_generation_prompt=kwargs.get("add_generation_prompt", True),
            **(kwargs.get("chat_template_kwargs") or {}))
    return value if isinstance(value, str) else tok.decode(value)


def _engine(model: Any) -> Any:
    """The LLM a scorer model runs on (a RewardModel's `llm`, a PoolingLLM itself)."""
    return getattr(model, "llm", model)


def _sleep(llm: Any) -> None:
    """Release an LLM's pool while the other model runs (a no-op without sleep mode)."""
    if llm is not None and not llm.is_sleeping():
        try:
            llm.sleep(level=1)
        except ValueError:  # built without enable_sleep_mode
            pass


def _wake(llm: Any) -> None:
    if llm is not None and llm.is_sleeping():
        llm.wake_up()


def _inputs(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in ADDED_COLUMNS and k != ERROR}


def final_row(row: dict[str, Any], outs: list[dict[str, Any]], scores: list[float],
               rounds: int, policy: Select | Until | None) -> dict[str, Any]:
    """A result row: every candidate with its score (renumbered in order across rounds)."""
    cands = [{**c, "index": j, SCORE: s} if "index" in c else {**c, SCORE: s}
             for j, (c, s) in enumerate(zip(outs, scores))]
    out = {**{k: v for k, v in row.items() if k != SOURCE}, OUTPUTS: cands}
    if isinstance(policy, Until):
        out[SELECTED], out[ROUNDS] = policy.chosen(scores), rounds
    elif policy is not None:
        picked = policy(scores)
        out[SELECTED] = picked["chosen"]
        if policy.kind == "pairs":
            out[REJECTED] = picked["rejected"]
    return out


def final_schema(schema: pa.Schema, policy: Select | Until | None, steps: bool = False
                  ) -> pa.Schema:
    """The generate stage's schema, each candidate with a `score` (and a PRM's
    `step_scores`), and the selection."""
    fields = []
    added = [pa.field(SCORE, pa.float64())]
    if steps:
        added.append(pa.field(STEP_SCORES, pa.list_(pa.float64())))
    for f in schema:
        if f.name == OUTPUTS:
            f = pa.field(OUTPUTS, pa.list_(pa.struct([*f.type.value_type, *added])))
        fields.append(f)
    if policy is not None:
        fields.append(pa.field(SELECTED, pa.list_(pa.int32())))
    if isinstance(policy, Select) and policy.kind == "pairs":
        fields.append(pa.field(REJECTED, pa.list_(pa.int32())))
    if isinstance(policy, Until):
        fields.append(pa.field(ROUNDS, pa.int32()))
    return pa.schema(fields)
