"""RL rollouts: TRL's GRPO rollout time per step on HF generate, TRL's transformers continuous
batching and batchgen as TRL's colocated vLLM (weights copied in after every step, or shared).

Every system trains the same model from the same start with the same GRPOConfig (CPU, fp32),
each run in a fresh process (TRL's continuous-batching path leaves a manager thread behind that
slows whatever runs next in its process); a round runs each system once, rounds interleave the
systems, the best round counts. The timed
part of a step is TRL's `_generate_single_turn` (for batchgen it includes TRL's weight sync:
the copy, or nothing when the weights are shared); the first step of each run (warm-up) is not
counted. For batchgen TRL also reports its check of the generator's token logprobs against its
own recomputation (`sampling/sampling_logp_difference/*`) and the importance-sampling ratio.

    PYTHONPATH=. python benchmarks/rl_rollouts.py --model tiny|smollm2|FOLDER [--steps 4]

Needs TRL (the [rl] extra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import batchgen.vllm_compat

batchgen.vllm_compat.install()  # before TRL loads: its colocated path imports `vllm`

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from benchmarks import common  # noqa: E402

COLOCATE = {"use_vllm": True, "vllm_mode": "colocate"}
SYSTEMS = {  # flag name -> (table label, GRPOConfig overrides, share the trainer's module)
    "hf": ("TRL, HF generate", {"use_vllm": False}, False),
    "cb": ("TRL, transformers continuous batching",
           {"use_vllm": False, "use_transformers_continuous_batching": True}, False),
    "copied": ("batchgen, weights copied (TRL's sync)", COLOCATE, False),
    "shared": ("batchgen, weights shared (no copy)", COLOCATE, True),
}
LOGP = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
        "sampling/importance_sampling_ratio/mean")


def parse_args() -> argparse.Namespace:
    p = common.parser(__doc__, run={"device": None, "repeats": 2})
    p.add_argument("--model", default="tiny", help="tiny, smollm2 or a model folder")
    p.add_argument("--steps", type=int, default=4, help="GRPO steps per run (the first untimed)")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="comma-separated subset of: " + ", ".join(
                       f"{k} ({v[0]})" for k, v in SYSTEMS.items()))
    p.add_argument("--child", choices=list(SYSTEMS), help=argparse.SUPPRESS)  # one run, here
    args = p.parse_args()
    args.systems = [s.strip() for s in args.systems.split(",")]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or args.steps < 2:
        p.error(f"--systems: unknown {unknown}" if unknown else "--steps must be >= 2")
    return args


def length_reward(completions: list[str], **_: Any) -> list[float]:
    """A toy reward with spread: shorter completions score higher."""
    return [-len(c) / 100 for c in completions]


def run(system: str, args: argparse.Namespace, model_dir: Path, prompts: list[str]
        ) -> dict[str, Any]:
    """One GRPO run of `system` from the folder's weights: per-step rollout seconds, tokens,
    TRL's logp metrics."""
    _, overrides, share = SYSTEMS[system]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    if share:
        batchgen.vllm_compat.share(model)
    gen_per_step = args.prompts_per_step * args.num_generations
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, use_cpu=True, report_to="none", max_steps=args.steps,
            per_device_train_batch_size=gen_per_step, num_generations=args.num_generations,
            max_completion_length=args.max_completion_length, temperature=args.temperature,
            logging_steps=1, learning_rate=1e-5, save_strategy="no", seed=0, bf16=False,
            vllm_max_model_length=args.max_model_len, dataloader_num_workers=0,
            disable_tqdm=True, **overrides)
        start = time.perf_counter()
        trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=config,
                              processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": prompts}))
        init_s = time.perf_counter() - start
        seconds: list[float] = []
        generate = trainer._generate_single_turn

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            result = generate(*a, **kw)
            seconds.append(time.perf_counter() - t0)
            return result

        trainer._generate_single_turn = timed
        try:
            trainer.train()
        finally:
            batchgen.vllm_compat.unshare(model)
    logs = [e for e in trainer.state.log_history if "completions/mean_length" in e]
    tokens = [e["completions/mean_length"] * gen_per_step for e in logs]
    assert len(seconds) == len(logs) == args.steps, (system, len(seconds), len(logs))
    return {"system": system, "init_s": init_s, "step_s": seconds, "tokens": tokens,
            **{k: [e[k] for e in logs] for k in LOGP if logs and k in logs[0]}}


def summarize(runs: list[dict[str, Any]]) -> list[list[Any]]:
    """One row per system: its best round's median timed step."""
    rows = []
    for system in dict.fromkeys(r["system"] for r in runs):
        best = min((r for r in runs if r["system"] == system),
                   key=lambda r: statistics.median(r["step_s"][1:]))
        step = statistics.median(best["step_s"][1:])
        toks = statistics.mean(best["tokens"][1:])
        logp = best.get(LOGP[0])
        rows.append([SYSTEMS[system][0], f"{best['init_s']:.2f}", f"{step:.3f}", f"{toks:.0f}",
                     f"{toks / step:,.0f}",
                     f"{max(logp):.1e}" if logp else "—",
                     f"{max(best[LOGP[1]]):.1e}" if logp else "—",
                     f"{min(best[LOGP[2]]):.4f}" if logp else "—"])
    return rows


def run_in_child(system: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """`run` in a fresh process (this script with --child), its result read back."""
    out = folder / f"{system}-{time.monotonic_ns()}.json"
    argv = [a for a in sys.argv[1:] if a != "--json"]
    if args.json is not None:  # drop the parent's --json PATH
        at = sys.argv.index("--json")
        argv = sys.argv[1:at] + sys.argv[at + 2:]
    proc = subprocess.run([sys.executable, __file__, *argv, "--child", system, "--json",
                           str(out)], env=common.child_env(), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{system} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    args = parse_args()
    info = common.start(args)
    model_dir = common.resolve_model(args.model)
    n = args.prompts_per_step * (args.steps + 1)
    prompts = [common.QUESTIONS[i % len(common.QUESTIONS)] for i in range(n)]
    if args.child:
        args.json.write_text(json.dumps(run(args.child, args, model_dir, prompts)))
        return
    print(f"model {model_dir.name}; {args.steps} GRPO steps x {args.prompts_per_step} prompts "
          f"x {args.num_generations} generations, <= {args.max_completion_length} tokens, "
          f"temperature {args.temperature}; {args.repeats} interleaved rounds", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        runs = [run_in_child(system, args, Path(folder))
                for _ in range(args.repeats) for system in args.systems]
    rows = summarize(runs)
    common.table(["system", "trainer init s", "rollout s/step (median)", "tokens/step",
                  "tok/s", "logp diff mean (max over steps)", "logp diff max",
                  "IS ratio mean (min)"], rows)
    common.finish(args, info, {"runs": runs, "rows": rows})


if __name__ == "__main__":
    main()
