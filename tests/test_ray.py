"""`batchgen.ray` on a local Ray (loopback, CPU actors): the same rows as the local dataset
runner, every sample kept; an actor killed mid-job is restarted by Ray and no row is lost or
duplicated; `batchgen generate --ray` writes what a local job writes; nothing of Ray is left
running after shutdown. Skipped when Ray is not installed (the test extra installs it)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import datasets
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from helpers import head_folder  # noqa: E402

from batchgen import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from batchgen.cli import main  # noqa: E402
from batchgen.data import generate_dataset  # noqa: E402
from batchgen.ray import (  # noqa: E402
    BatchgenProcessorConfig,
    build_processor,
    numbered_blocks,
)

WORDS = "the a cat dog runs jumps over under blue red green house tree river".split()
PARAMS = SamplingParams(n=4, temperature=1.0, max_tokens=8)
ACTOR = "MapWorker(MapBatches(_Generate))"
RAY_PROCESSES = ("raylet", "gcs_server", "ray::", "dashboard", "plasma_store")


def rows(count: int) -> list[dict]:
    return [{"prompt": " ".join(WORDS[(i * 5 + j * 3) % len(WORDS)] for j in range(2 + i % 7)),
             "k": i} for i in range(count)]


def processes(*needles: str) -> list[int]:
    """PIDs whose command line contains any of `needles` (this machine, this user)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(n in cmd for n in needles) and int(pid) != os.getpid():
            found.append(int(pid))
    return found


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray on loopback with 3 logical CPUs (2 actors + the read/write tasks); after
    the module, shut down and check that none of its processes is left."""
    assert not processes(*RAY_PROCESSES), "a Ray is already running on this machine"
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()
    deadline = time.monotonic() + 30
    while processes(*RAY_PROCESSES) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes(*RAY_PROCESSES), "Ray processes left after ray.shutdown()"


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> Path:
    return tiny_model_factory("llama", eos_boost=0.06)


def by_id(records: list[dict]) -> list[dict]:
    return sorted(records, key=lambda r: r["row_id"])


def config(model: Path, **kw) -> BatchgenProcessorConfig:
    kw = {"sampling_params": PARAMS, "engine_kwargs": {"device": "cpu"}, "seed": 3,
          "batch_size": 8, "concurrency": 2, **kw}
    return BatchgenProcessorConfig(str(model), **kw)


def test_two_actors_equal_the_local_runner(local_ray, model: Path) -> None:
    data = datasets.Dataset.from_list(rows(48))
    local = generate_dataset(LLM(str(model), device="cpu"), data, PARAMS, seed=3,
                             use_tqdm=False).to_list()
    blocks = ray.data.from_arrow(numbered_blocks(data, 8))
    got = by_id(build_processor(config(model))(blocks).take_all())
    assert got == local  # every column, every sample of every row
    assert all(len(r["outputs"]) == 4 for r in got)


def test_beams_pre_and_postprocess(local_ray, model: Path) -> None:
    """Also: without a row_id column (ray.data.from_items) the processor numbers rows by
    position, so each row's best beam lands on the local runner's row."""
    data = datasets.Dataset.from_list(rows(12))
    bp = BeamSearchParams(beam_width=3, max_tokens=6)
    local = generate_dataset(LLM(str(model), device="cpu"), data, bp, use_tqdm=False)
    proc = build_processor(
        config(model, sampling_params=bp, prompt_column="text"),
        preprocess=lambda r: {**r, "text": r["prompt"]},
        postprocess=lambda r: {"row_id": r["row_id"], "k": r["k"],
                               "best": r["outputs"][0]["text"]})
    got = by_id(proc(ray.data.from_items(rows(12), override_num_blocks=3)).take_all())
    assert [r["row_id"] for r in got] == [r["k"] for r in got] == list(range(12))
    assert [r["best"] for r in got] == [o[0]["text"] for o in local["outputs"]]


def test_tensor_parallel_actor_equals_the_local_runner(local_ray, model: Path) -> None:
    """engine_kwargs' tensor_parallel_size reaches the actor's LLM, whose second rank is a
    process the actor spawns (on GPUs the actor holds num_gpus=2): greedy rows equal a local
    one-process job's."""
    data = datasets.Dataset.from_list(rows(12))
    greedy = SamplingParams(temperature=0, max_tokens=6)
    local = generate_dataset(LLM(str(model), device="cpu"), data, greedy, seed=3,
                             use_tqdm=False).to_list()
    tp = config(model, sampling_params=greedy, concurrency=1, num_cpus=2,
                engine_kwargs={"device": "cpu", "tensor_parallel_size": 2})
    got = by_id(build_processor(tp)(ray.data.from_arrow(numbered_blocks(data, 6))).take_all())
    logprobs = [o.pop("cumulative_logprob") for r in (*got, *local) for o in r["outputs"]]
    assert got == local  # tokens, text, finish reasons; the ranks sum in another order:
    assert logprobs[:12] == pytest.approx(logprobs[12:], rel=1e-5)


def test_killed_actor_is_retried_without_loss_or_duplicates(local_ray, model: Path,
                                                            tmp_path: Path) -> None:
    data = datasets.Dataset.from_list(rows(240))
    out = tmp_path / "out"
    ds = build_processor(config(model, batch_size=6))(
        ray.data.from_arrow(numbered_blocks(data, 6)))
    errors: list[BaseException] = []

    def write() -> None:
        try:
            ds.write_parquet(str(out))
        except BaseException as e:  # surfaced below
            errors.append(e)

    writer = threading.Thread(target=write)
    writer.start()
    deadline = time.monotonic() + 120
    while not (out.is_dir() and any(out.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.05)  # the first output block is written: the actors are mid-job
    victims = processes(ACTOR)
    assert victims and writer.is_alive(), "the job ended before an actor could be killed"
    os.kill(victims[0], signal.SIGKILL)
    writer.join(timeout=300)
    assert not writer.is_alive() and not errors, errors
    got = by_id(pq.read_table(out).to_pylist())
    assert [r["row_id"] for r in got] == list(range(240))  # none lost, none twice
    local = generate_dataset(LLM(str(model), device="cpu"), data, PARAMS, seed=3,
                             use_tqdm=False).to_list()
    assert got == local


def test_cli_ray_equals_local_cli(local_ray, model: Path, tmp_path: Path, capsys) -> None:
    data = tmp_path / "in.jsonl"
    datasets.Dataset.from_list(rows(30)).to_json(data)
    common = ["generate", "--model", str(model), "--input", str(data), "--n", "3",
              "--max-tokens", "6", "--seed", "7", "--quiet"]
    assert main([*common, "--output", str(tmp_path / "local")]) == 0
    assert main([*common, "--output", str(tmp_path / "ray"), "--ray", "--actors", "2",
                 "--batch-size", "4"]) == 0
    assert "batchgen: 30 rows, 90 samples in" in capsys.readouterr().out
    assert by_id(pq.read_table(tmp_path / "ray").to_pylist()) == by_id(
        pq.read_table(tmp_path / "local").to_pylist())
    assert main([*common, "--output", str(tmp_path / "ray-jsonl"), "--ray", "--actors", "2",
                 "--batch-size", "8", "--output-format", "jsonl"]) == 0
    assert "batchgen: 30 rows, 90 samples in" in capsys.readouterr().out
    lines = pads.dataset(tmp_path / "ray-jsonl", format="json").to_table().to_pylist()
    assert by_id(lines) == by_id(pq.read_table(tmp_path / "local").to_pylist())


def test_bad_config_and_flags(local_ray, model: Path, tmp_path: Path, capsys) -> None:
    with pytest.raises(ValueError, match="concurrency must be an integer >= 1 or a"):
        config(model, concurrency=(3, 1))
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        config(model, batch_size=0)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got True"):
        config(model, batch_size=True)  # more cases, without Ray: test_ray_config.py
    with pytest.raises(ValueError, match="prompt_column 'question' is not a column"):
        build_processor(config(model, prompt_column="question"))(
            ray.data.from_items(rows(4)))
    data = tmp_path / "in.jsonl"
    datasets.Dataset.from_list(rows(3)).to_json(data)
    code = main(["generate", "--model", str(model), "--input", str(data), "--output",
                 str(tmp_path / "o"), "--ray", "--resume"])
    assert code == 2 and "--resume is for local jobs" in capsys.readouterr().err
    clash = tmp_path / "clash.jsonl"
    datasets.Dataset.from_list([{**r, "outputs": 1} for r in rows(3)]).to_json(clash)
    code = main(["generate", "--model", str(model), "--input", str(clash), "--output",
                 str(tmp_path / "o2"), "--ray"])
    err = capsys.readouterr().err
    assert code == 2 and "already has column(s) ['outputs']" in err, err


def test_an_image_column_equals_the_local_runner(local_ray, tiny_vlm_factory) -> None:
    """A VLM on one actor over rows with datasets' Image column (Arrow: {bytes, path}): each
    row's outputs equal generate_dataset's on the same rows (a None image: a text row)."""
    import numpy as np
    from PIL import Image

    from batchgen.tools.make_tiny_vlm import IMAGE_PLACEHOLDER

    path = tiny_vlm_factory("llava")
    rng = np.random.RandomState(0)
    pics = [Image.fromarray((rng.rand(16, 16, 3) * 255).astype("uint8")) for _ in range(2)]
    ph = IMAGE_PLACEHOLDER["llava"]
    data = datasets.Dataset.from_dict({"prompt": [f"a {ph} b", f"{ph} c", "text only"],
                                       "image": [*pics, None]}).cast_column(
        "image", datasets.Image())
    params = SamplingParams(temperature=0, max_tokens=6)
    engine = {"device": "cpu", "block_size": 8, "num_kv_blocks": 64}
    local = generate_dataset(LLM(str(path), **engine), data, params, image_column="image",
                             use_tqdm=False)
    cfg = BatchgenProcessorConfig(str(path), params, engine, image_column="image",
                                  batch_size=3, concurrency=1)
    got = by_id(build_processor(cfg)(ray.data.from_arrow(numbered_blocks(data, 3))).take_all())
    want = [o[0]["token_ids"] for o in local["outputs"]]
    assert [r["outputs"][0]["token_ids"] for r in got] == want
    assert want[0] != want[1]  # the images are seen
    with pytest.raises(ValueError, match="image_column 'picture' is not a column"):
        build_processor(BatchgenProcessorConfig(str(path), params, engine,
                                                image_column="picture"))(
            ray.data.from_arrow(numbered_blocks(data, 3)))


def test_an_adapter_column_equals_the_local_runner(local_ray, model: Path,
                                                   tmp_path: Path) -> None:
    """Rows under two PEFT LoRA adapters and the base model, on one actor: the same outputs as
    generate_dataset's local run with the same lora_column and loras (tests/test_lora_data.py
    checks that against PEFT's models); lora_column without enable_lora is refused."""
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    loras = {}
    for i, targets in enumerate((["q_proj", "v_proj"], ["o_proj", "up_proj"])):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        peft_model = peft.get_peft_model(base, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.data.normal_(0, 0.3)
        peft_model.save_pretrained(tmp_path / f"l{i}")
        loras[f"l{i}"] = str(tmp_path / f"l{i}")
    data = datasets.Dataset.from_list([{**r, "adapter": [None, "l0", "l1"][i % 3]}
                                       for i, r in enumerate(rows(9))])
    engine = {"device": "cpu", "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    local = generate_dataset(LLM(str(model), **engine), data, PARAMS, seed=3,
                             lora_column="adapter", loras=loras, use_tqdm=False).to_list()
    cfg = config(model, engine_kwargs=engine, lora_column="adapter", loras=loras,
                 concurrency=1, batch_size=5)
    got = by_id(build_processor(cfg)(ray.data.from_arrow(numbered_blocks(data, 5))).take_all())
    assert got == local
    base = generate_dataset(LLM(str(model), device="cpu"), data, PARAMS, seed=3,
                            use_tqdm=False)["outputs"]
    assert [r["outputs"] == b for r, b in zip(got, base)] == [True, False, False] * 3
    with pytest.raises(ValueError, match="lora_column needs engine_kwargs"):
        config(model, lora_column="adapter", loras=loras)


def reward_model(generator: Path, folder: Path) -> Path:
    """A one-label reward model: the generator's body with a random score head."""
    return head_folder(generator, folder, seed=11)


def test_best_of_n_pipeline_equals_the_local_job(local_ray, model: Path,
                                                 tmp_path: Path) -> None:
    """generate (an actor pool) -> score (a second pool holding a reward model folder) ->
    select (a map), one Ray Data pipeline: the same candidates, scores and selection as
    generate_dataset(score=, select=); then a callable verifier with another policy."""
    rm = reward_model(model, tmp_path / "rm")
    data = datasets.Dataset.from_list(rows(12))
    llm = LLM(str(model), device="cpu")
    local = generate_dataset(llm, data, PARAMS, seed=3, score=str(rm), select="pairs",
                             use_tqdm=False).to_list()
    cfg = config(model, concurrency=1, batch_size=5, score=str(rm), select="pairs",
                 score_engine_kwargs={"device": "cpu"}, num_cpus=0.5, score_num_cpus=0.5)
    got = by_id(build_processor(cfg)(ray.data.from_arrow(numbered_blocks(data, 5))).take_all())
    assert got == local  # every candidate's text, logprobs and score; selected and rejected
    assert len({o["score"] for r in got for o in r["outputs"]}) == 48  # real, distinct scores
    assert all(r["selected"] != r["rejected"] for r in got)

    def verify_length(prompt: str, text: str) -> float:  # pickled by value for the actors
        return float(len(text) % 7)

    local = generate_dataset(llm, data, PARAMS, seed=3, score=verify_length, select="top:2",
                             use_tqdm=False).to_list()
    cfg = config(model, concurrency=1, batch_size=5, score=verify_length, select="top:2",
                 num_cpus=0.5, score_num_cpus=0.5)  # CPUs left for the select tasks
    got = by_id(build_processor(cfg)(ray.data.from_arrow(numbered_blocks(data, 5))).take_all())
    assert got == local and all(len(r["selected"]) == 2 for r in got)


def test_cli_ray_score_select_equals_local_cli(local_ray, model: Path, tmp_path: Path,
                                              capsys) -> None:
    """`batchgen generate --ray --score-model RM --select best` writes the local job's
    result rows (its selected/ stage); until:k and a shared GPU without pool sizes are
    refused before Ray runs anything."""
    rm = reward_model(model, tmp_path / "rm")
    data = tmp_path / "in.jsonl"
    datasets.Dataset.from_list(rows(10)).to_json(data)
    common = ["generate", "--model", str(model), "--input", str(data), "--n", "3",
              "--max-tokens", "5", "--seed", "7", "--quiet", "--score-model", str(rm)]
    assert main([*common, "--output", str(tmp_path / "local"), "--select", "best"]) == 0
    assert main([*common, "--output", str(tmp_path / "ray"), "--select", "best", "--ray",
                 "--batch-size", "4"]) == 0
    assert "batchgen: 10 rows, 30 samples in" in capsys.readouterr().out
    got = by_id(pq.read_table(tmp_path / "ray").to_pylist())
    assert got == by_id(pq.read_table(tmp_path / "local" / "selected").to_pylist())
    assert all(len(r["selected"]) == 1 and "score" in r["outputs"][0] for r in got)
    code = main([*common, "--output", str(tmp_path / "o"), "--ray", "--select", "until:2",
                 "--threshold", "0.5"])
    assert code == 2 and "--select until:2 is for local jobs" in capsys.readouterr().err
    code = main([*common, "--output", str(tmp_path / "o"), "--ray", "--select", "best",
                 "--gpus-per-actor", "0.5", "--kv-cache-memory", "1GiB",
                 "--score-gpus-per-actor", "0.5"])
    err = capsys.readouterr().err
    assert code == 2 and "give the scorer's KV pool a size (--score-kv-cache-memory)" in err
    code = main([*common[:-2], "--output", str(tmp_path / "o"), "--ray", "--score-actors", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--score-actors go with --ray and --score-model" in err, err
