"""The score and select stages on Ray Data, after the generate stage's actors, as one pipeline:
a second actor pool holds the scorer (a reward / process reward model folder on batchgen's
pooling engine, or a Python callable verifier) and scores every candidate of each batch; a plain
map then applies the select policy. Both stages are the local job's (batchgen/data/stages.py,
batchgen/data/scoring.py): the same scorer, the same scores, the same output columns."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from batchgen.checks import ValidationError, check_int, check_type
from batchgen.data.rows import OUTPUTS, ROW_ID
from batchgen.data.scoring import Scorer, check_scorer, score_rows
from batchgen.data.stages import final_row, final_schema, parse_policy, prompt_text
from batchgen.pooling.select import Select, parse_select

if TYPE_CHECKING:
    import ray.data

Config = Any  # a BatchgenProcessorConfig (batchgen/ray/processor.py, which imports this module)
PROMPT_TEXT = "_batchgen_prompt_text"  # generate -> score: what a candidate is scored after
ROW_SCORES = "_batchgen_scores"  # score -> select: each candidate's score, in order
# the score stage's fields and their defaults (set without `score`: refused)
SCORE_FIELDS = {"select": None, "score_engine_kwargs": {}, "score_num_gpus": 0.0,
                "score_num_cpus": 1.0, "score_concurrency": 1, "score_workers": 4}


def check_stages(c: Config) -> None:
    """ValueErrors naming the field, before Ray starts: the scorer and the policy as the local
    job checks them, plus what a pipeline cannot run (until:k, a model built in this process)."""
    if c.score is None:
        for name, default in SCORE_FIELDS.items():
            if getattr(c, name) != default:
                raise ValidationError(f"{name} goes with score= (a reward model folder or a "
                                      f"callable verifier), got score=None",
                                      parameter=name, value=getattr(c, name))
        return
    if isinstance(c.select, str) and c.select.startswith("until:"):
        raise ValidationError(
            f"select={c.select!r} is for local jobs (generate_dataset): until:k samples each "
            f"row in rounds, a round only for the rows the last round's scores left open, and "
            f"a Ray Data pipeline runs each stage once per row; on Ray use a fixed n with "
            f"'threshold:X' or 'top:k'", parameter="select", value=c.select)
    parse_policy(c.select, None, None, c.sampling_params, c.score)
    check_scorer(c.score)
    if hasattr(c.score, "reward"):
        raise ValidationError("score must be a reward model folder or a callable on Ray: a "
                              "built RewardModel / PoolingLLM lives in this process (each "
                              "score actor builds its own from the folder)",
                              parameter="score", value=type(c.score).__name__)
    check_type(c.score_engine_kwargs, "score_engine_kwargs", dict,
               "a dict of RewardModel (LLM) arguments")
    if c.score_engine_kwargs and not isinstance(c.score, (str, os.PathLike)):
        raise ValidationError("score_engine_kwargs go with a reward model folder as score, "
                              "not a callable", parameter="score_engine_kwargs",
                              value=c.score_engine_kwargs)
    check_int(c.score_workers, "score_workers")


class _Score:
    """The score stage's actor: one scorer, built once (a folder's RewardModel on its own paged
    engine, `score_engine_kwargs` its LLM arguments); each call scores every candidate of a
    batch of generated rows, a prompt's candidates in one call (sharing its cached blocks)."""

    def __init__(self, config: Config) -> None:
        spec = config.score
        if isinstance(spec, (str, os.PathLike)):
            from batchgen.pooling.scorer import RewardModel

            spec = RewardModel(str(Path(spec).expanduser()), **config.score_engine_kwargs)
        self.scorer = Scorer(spec, config.score_workers)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        scores = score_rows(rows, lambda r: r[PROMPT_TEXT], self.scorer, None,
                            max(1, len(rows)))
        column = pa.array([scores[r[ROW_ID]] for r in rows], pa.list_(pa.float64()))
        return batch.append_column(ROW_SCORES, column)


def select_rows(batch: pa.Table, policy: Select | None) -> pa.Table:
    """The select stage (a plain map): each row's candidates with their scores and the
    selection column, the local job's result rows."""
    base = batch.schema
    for name in (PROMPT_TEXT, ROW_SCORES):
        base = base.remove(base.get_field_index(name))
    rows = [final_row({k: v for k, v in r.items() if k not in (PROMPT_TEXT, ROW_SCORES)},
                      r[OUTPUTS], r[ROW_SCORES], 1, policy) for r in batch.to_pylist()]
    return pa.Table.from_pylist(rows, schema=final_schema(base, policy))


def with_prompt_texts(table: pa.Table, rows: list[dict[str, Any]], tokenizer: Any,
                      c: Config) -> pa.Table:
    """The generate stage's output with each row's prompt text (what the score stage scores a
    candidate after), rendered with the generator's tokenizer as the local job does."""
    kwargs = {"prompt_column": c.prompt_column, "messages_column": c.messages_column,
              "chat_template": c.chat_template, "chat_template_kwargs": c.chat_template_kwargs}
    texts = [prompt_text(tokenizer, r, kwargs) for r in rows]
    return table.append_column(PROMPT_TEXT, pa.array(texts, pa.string()))


def score_and_select(ds: ray.data.Dataset, c: Config,
                     remote: dict[str, Any]) -> ray.data.Dataset:
    """The score stage (an actor pool of `score_concurrency` scorers, `score_num_gpus` /
    `score_num_cpus` each) and the select stage (tasks) after the generate stage."""
    import ray.data

    size = c.score_concurrency if isinstance(c.score_concurrency, tuple) else (
        c.score_concurrency,) * 2
    compute = ray.data.ActorPoolStrategy(min_size=size[0], max_size=size[1])
    ds = ds.map_batches(_Score, fn_constructor_args=(c,), batch_size=c.batch_size,
                        batch_format="pyarrow", compute=compute, num_gpus=c.score_num_gpus,
                        num_cpus=c.score_num_cpus, **remote)
    policy = None if c.select is None else parse_select(c.select)
    return ds.map_batches(select_rows, fn_kwargs={"policy": policy}, batch_format="pyarrow",
                          **remote)
