"""What beam search's records cost: ``return_trace`` and ``logprobs=5`` against plain beams.

Per ``--beam-widths``, each of ``CONFIGS`` in interleaved rounds on the random Llama (EOS
ignored); every configuration must return plain's hypotheses (asserted).

    PYTHONPATH=. python benchmarks/beam_trace.py --beam-widths 4,16 --repeats 9 --threads 1
"""

import statistics

from batchgen import LLM, BeamSearchParams
from benchmarks import common as h

CONFIGS = {"plain": {}, "trace": {"return_trace": True}, "logprobs": {"logprobs": 5},
           "trace+logprobs": {"return_trace": True, "logprobs": 5}}


def contender(llm, prompts: list[list[int]], width: int, config: str, n_tokens: int
              ) -> h.Contender:
    def go(ps: list[list[int]], k: int):
        bp = BeamSearchParams(beam_width=width, max_tokens=k, ignore_eos=True, **CONFIGS[config])
        return llm.beam_search(h.token_prompts(ps), bp, use_tqdm=False)

    h.warm_up(go, prompts, n_tokens)
    return h.Contender(config, lambda: go(prompts, n_tokens))


def trace_sizes(outs, width: int) -> dict[str, float]:
    traces = [o.trace for o in outs if getattr(o, "trace", None) is not None]

    def mean(size) -> float:
        return statistics.mean(map(size, traces)) if traces else 0.0

    return {"live_records": mean(lambda t: len(t.live)),
            "finished_records": mean(lambda t: len(t.finished)),
            "steps_x_width": mean(lambda t: t.num_steps * width)}


def main(argv: list[str] | None = None) -> dict:
    p = h.parser(__doc__, model={}, run={}, workload={
        "num_prompts": 16, "min_prompt_len": 16, "max_prompt_len": 128, "output_len": 32})
    p.add_argument("--beam-widths", type=h.int_list, default="4,16", help="comma-separated")
    args = h.check_args(p, p.parse_args(argv))
    info = h.start(args)
    prompts, rows = h.workload_prompts(args), []

    def beams(outs) -> list[list[list[int]]]:
        return [[list(s.token_ids) for s in o.sequences] for o in outs]

    with h.prepare_model_dir(args, args.max_prompt_len + args.output_len) as model_dir:
        for width in args.beam_widths:
            llm = LLM(str(model_dir), device=args.device, max_num_seqs=max(256, width))
            timings = h.interleaved_repeats([contender(llm, prompts, width, c, args.output_len)
                                             for c in CONFIGS], args.repeats, args.device)
            for config, (outs, walls) in zip(CONFIGS, timings):
                assert beams(outs) == beams(timings[0][0]), f"{config} changed the beams"
                rows.append({"width": width, "config": config, "min_s": min(walls),
                             "median_s": statistics.median(walls), "walls": walls,
                             "vs_plain": min(walls) / min(timings[0][1]),
                             **trace_sizes(outs, width)})
            del llm
    h.table(["W", "config", "min s", "median s", "min / plain", "live records / request",
             "finished records / request", "steps x W"],
            [[r["width"], r["config"], f"{r['min_s']:.3f}", f"{r['median_s']:.3f}",
              f"{r['vs_plain']:.3f}x", f"{r['live_records']:.1f}",
              f"{r['finished_records']:.1f}", f"{r['steps_x_width']:.0f}"] for r in rows])
    return h.finish(args, info, {"results": rows})


if __name__ == "__main__":
    main()
