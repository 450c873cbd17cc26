"""Images in, text out: tiny vision-language models (both towers tiny, built in-process) give
HF `generate`'s greedy tokens on the same processor outputs, for one image, several images
in a prompt, text-only prompts beside image prompts, images of different sizes, a prefill
chunk boundary inside an image, long M-RoPE decodes, preemption (recompute and swap), beams
and seeded samples; prefix caching keys blocks by the images they hold."""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import EOS_ID, cpu_kernel_or_skip, strip_after_eos

from batchgen import LLM, BeamSearchParams, SamplingParams
from batchgen.tools.make_tiny_vlm import IMAGE_PLACEHOLDER

FAMILIES = ("llava", "llava_next", "idefics3", "qwen2_5_vl", "qwen3_vl")  # and gemma3
MROPE = ("qwen2_5_vl", "qwen3_vl")
T = 12  # new tokens (M-RoPE families decode longer: 40)


def image(seed: int, h: int, w: int) -> Any:
    """A deterministic random RGB image."""
    from PIL import Image

    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8"))


def workload(family: str) -> list[tuple[str, list[Any]]]:
    """One image, two images of different sizes, text only, an image first."""
    ph = IMAGE_PLACEHOLDER[family]
    return [(f"hello {ph} what is this", [image(0, 20, 24)]),
            (f"x {ph} y {ph} z", [image(1, 40, 12), image(2, 32, 32)]),
            ("plain text only, no picture", []),
            (f"{ph} the cat sat on the mat", [image(3, 16, 16)])]


def as_prompt(text: str, images: list[Any]) -> Any:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


@functools.cache
def _hf(path: str) -> tuple[Any, Any]:
    from transformers import AutoModelForImageTextToText

    from batchgen.multimodal.processor import load_processor

    return (AutoModelForImageTextToText.from_pretrained(path).eval(), load_processor(Path(path)))


def hf_greedy(path: Path, prompts: list[tuple[str, list[Any]]], new: int) -> list[list[int]]:
    """HF generate, one prompt at a time, on the processor's outputs (EOS kept, then cut)."""
    model, processor = _hf(str(path))
    out = []
    for text, images in prompts:
        inputs = processor(text=[text], images=[images] if images else None,
                           return_tensors="pt")
        with torch.inference_mode():
            ids = model.generate(**inputs, max_new_tokens=new, do_sample=False,
                                 eos_token_id=EOS_ID, pad_token_id=0)
        out.append(strip_after_eos(ids[0, inputs["input_ids"].shape[1]:].tolist()))
    return out


def greedy(llm: LLM, prompts: list[tuple[str, list[Any]]], new: int) -> list[list[int]]:
    outs = llm.generate([as_prompt(t, i) for t, i in prompts],
                        SamplingParams(temperature=0, max_tokens=new), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf(tiny_vlm_factory, family: str) -> None:
    """A mixed batch (one image, two images of other sizes, text only) equals HF, in one
    prefill per prompt and with 5-token chunks (boundaries inside images)."""
    path = tiny_vlm_factory(family)
    new = 40 if family in MROPE else T
    prompts = workload(family)
    want = hf_greedy(path, prompts, new)
    for chunk in (None, 5):
        llm = LLM(path, limit_mm_per_prompt={"image": 2}, max_num_batched_tokens=chunk,
                  block_size=8, num_kv_blocks=256)
        assert greedy(llm, prompts, new) == want, f"max_num_batched_tokens={chunk}"
    assert llm.kv_stats().prompt_tokens_computed > 0


def test_preemption_by_recompute_and_swap(tiny_vlm_factory) -> None:
    """A pool too small for every request at once: preempted image requests (recomputed,
    features from the encoder cache, or swapped) give HF's tokens."""
    path = tiny_vlm_factory("qwen2_5_vl")
    prompts = workload("qwen2_5_vl") * 2
    want = hf_greedy(path, prompts, 40)
    for kw in ({"preemption_mode": "recompute"}, {"swap_space": 0.01}):
        llm = LLM(path, limit_mm_per_prompt={"image": 2}, block_size=4, num_kv_blocks=40,
                  max_num_batched_tokens=16, **kw)
        assert greedy(llm, prompts, 40) == want, kw
        stats = llm.kv_stats()
        assert stats.preemptions > 0, kw
        assert (stats.swap_outs > 0) == ("swap_space" in kw)


def test_beams_equal_hf_beam_search(tiny_vlm_factory) -> None:
    path = tiny_vlm_factory("llava")
    model, processor = _hf(str(path))
    text, images = workload("llava")[1]
    inputs = processor(text=[text], images=[images], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, num_beams=3, num_return_sequences=3, max_new_tokens=8,
                             do_sample=False, eos_token_id=EOS_ID, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    want = [strip_after_eos(r) for r in out.sequences[:, inputs["input_ids"].shape[1]:].tolist()]
    llm = LLM(path, limit_mm_per_prompt={"image": 2}, block_size=8, num_kv_blocks=128)
    got = llm.beam_search(as_prompt(text, images), BeamSearchParams(beam_width=3, max_tokens=8),
                          use_tqdm=False)[0]
    assert [s.token_ids for s in got.sequences] == want
    assert [s.score for s in got.sequences] == pytest.approx(out.sequences_scores.tolist(),
                                                             abs=1e-4)


def test_seeded_samples_do_not_depend_on_the_batch(tiny_vlm_factory) -> None:
    """n seeded samples of image prompts in one batch equal each request run alone."""
    path = tiny_vlm_factory("qwen3_vl")
    prompts = [as_prompt(t, i) for t, i in workload("qwen3_vl")]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10)
    llm = LLM(path, limit_mm_per_prompt={"image": 2}, block_size=8, num_kv_blocks=256)
    together = llm.generate(prompts, params, use_tqdm=False)
    for p, out in zip(prompts, together):
        alone = llm.generate(p, params, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs]
    assert len({tuple(c.token_ids) for c in together[0].outputs}) > 1


def test_prefix_cache_keys_blocks_by_their_images(tiny_vlm_factory) -> None:
    """The same image with two questions hits the image's blocks; the same text with another
    image hits none of them; outputs equal the cache off."""
    path = tiny_vlm_factory("llava")
    ph = IMAGE_PLACEHOLDER["llava"]
    a, b = image(10, 16, 16), image(11, 16, 16)
    first = (f"describe {ph} please", [a])
    same_image = [(f"describe {ph} please, then count", [a])]
    other_image = [(f"describe {ph} please", [b])]
    off = LLM(path, block_size=4, num_kv_blocks=128, enable_prefix_caching=False)
    on = LLM(path, block_size=4, num_kv_blocks=128)
    for follow, hits in ((same_image, True), (other_image, False)):
        on.reset_prefix_cache()
        greedy(on, [first], T)
        out = on.generate(as_prompt(*follow[0]), SamplingParams(temperature=0, max_tokens=T),
                          use_tqdm=False)[0]
        hit = on.kv_stats().prefix_hit_tokens
        assert [out.outputs[0].token_ids] == greedy(off, follow, T)
        start = out.prompt_token_ids.index(512)  # the image's first placeholder; 16 of them
        assert (hit >= (start + 16) // 4 * 4) if hits else (hit <= start), (follow, hit)


def test_images_as_paths_urls_and_arrays(tiny_vlm_factory, tmp_path: Path) -> None:
    """A path, a file:// URL, a data: URL, a numpy and a torch array of the same pixels give
    the PIL image's tokens; chat image parts give generate's."""
    import base64
    import io

    path = tiny_vlm_factory("llava")
    img = image(5, 16, 16)
    file = tmp_path / "a.png"
    img.save(file)
    data = "data:image/png;base64," + base64.b64encode(file.read_bytes()).decode()
    arr = np.asarray(img)
    text = f"look {IMAGE_PLACEHOLDER['llava']} here"
    llm = LLM(path, block_size=8, num_kv_blocks=128)
    want = greedy(llm, [(text, [img])], T)
    for form in (str(file), f"file://{file}", data, arr, torch.from_numpy(arr.copy())):
        assert greedy(llm, [(text, [form])], T) == want, type(form)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    chat = [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": data}}]}]
    template = ("{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
                "<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endfor %}")
    out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=T), use_tqdm=False,
                   chat_template=template)[0]
    direct = llm.generate({"prompt": "look<image>", "multi_modal_data": {"image": img},
                           "mm_processor_kwargs": {"add_special_tokens": False}},
                          SamplingParams(temperature=0, max_tokens=T), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    assert out.prompt_token_ids[0] != 1 or out.prompt_token_ids[1] != 1  # one BOS at most


@pytest.mark.parametrize("prompt, match", [
    ({"prompt": "a <image> <image>", "multi_modal_data": {"image": [0, 0]}}, "limit_mm_per"),
    ({"prompt": "a <image>", "multi_modal_data": {"image": "/no/such.png"}}, "no image file"),
    ({"prompt": "a <image>", "multi_modal_data": {"image": "https://x.org/a.png"}},
     "never downloads"),
    ({"prompt": "a <image>", "multi_modal_data": {"image": "data:image/png;base64,AAAA"}},
     "not a readable image"),
    ({"prompt": "a <image> b <image>", "multi_modal_data": {"image": "IMG"}}, "2 <image> tokens and 1 images"),
    ({"prompt": "a <image>", "multi_modal_data": {"video": "IMG"}}, "'video'"),
    ({"prompt": "a", "multi_modal_dta": {"image": "IMG"}}, "'multi_modal_dta'"),
    ({"prompt": "a", "mm_processor_kwargs": {}}, "beside 'multi_modal_data'"),
    ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": "IMG"}}, "text 'prompt'"),
    ({"prompt": "a <image>", "multi_modal_data": {"image": "IMG"},
      "multi_modal_uuids": {"image": ["u1", "u2"]}}, "multi_modal_uuids"),
])
def test_bad_image_prompts_are_refused_before_any_work(tiny_vlm_factory, prompt, match) -> None:
    path = tiny_vlm_factory("llava")
    llm = LLM(path, block_size=8, num_kv_blocks=64)
    if prompt.get("multi_modal_data", {}).get("image") == "IMG":
        prompt = {**prompt, "multi_modal_data": {"image": image(0, 16, 16)}}
    if prompt.get("multi_modal_data", {}).get("image") == [0, 0]:
        prompt = {**prompt, "multi_modal_data": {"image": [image(0, 16, 16)] * 2}}
    good = "plain text"
    with pytest.raises(ValueError, match=match):
        llm.generate([good, prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.kv_stats().prompt_tokens_computed == 0  # nothing ran


def test_text_models_and_unserved_families(tiny_model_factory, tiny_vlm_factory,
                                           tmp_path: Path) -> None:
    """An image for a text-only model names the key and the family; an unserved
    image-text-to-text family is refused from its config, before any weights."""
    from transformers import AutoConfig

    llm = LLM(tiny_model_factory("llama"), num_kv_blocks=64)
    with pytest.raises(ValueError, match="multi_modal_data.*'llama' is a text-only model"):
        llm.generate({"prompt": "a", "multi_modal_data": {"image": image(0, 8, 8)}},
                     use_tqdm=False)
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1 for vision-language"):
        LLM(tiny_vlm_factory("llava"), tensor_parallel_size=2)
    AutoConfig.for_model("paligemma").save_pretrained(tmp_path)  # a config, no weights
    with pytest.raises(ValueError, match="'paligemma' is a vision-language.*bidirectional"):
        LLM(tmp_path)


@pytest.mark.parametrize("backend", ["cpu_kernel", "torch"])
def test_gemma3_bidirectional_images_equal_hf(tiny_vlm_factory, backend: str) -> None:
    """Gemma 3 attends bidirectionally inside each image (windowed on its sliding layers):
    HF's tokens with one prefill per prompt, with chunks cut before images (a 20-token
    budget, 16-token images), and with the cache's hits ending inside an image."""
    if backend == "cpu_kernel":
        cpu_kernel_or_skip()
    path = tiny_vlm_factory("gemma3")
    prompts = workload("gemma3")
    want = hf_greedy(path, prompts, T)
    for chunk in (None, 20):
        llm = LLM(path, limit_mm_per_prompt={"image": 2}, max_num_batched_tokens=chunk,
                  block_size=4, num_kv_blocks=256, attention_backend=backend)
        assert greedy(llm, prompts, T) == want, chunk
    again = greedy(llm, prompts, T)  # every image block cached: hits inside images
    assert again == want and llm.kv_stats().prefix_hit_tokens > 0
    with pytest.raises(ValueError, match="max_num_batched_tokens .8. must hold it"):
        LLM(path, max_num_batched_tokens=8, num_kv_blocks=64).generate(
            as_prompt(*prompts[0]), use_tqdm=False)


def test_multimodal_families_served_as_text_refuse_images() -> None:
    """qwen3_5's text decoder is served; its images are refused naming the family."""
    from transformers import AutoConfig

    from batchgen.model.loader import check_supported
    from batchgen.multimodal.families import image_refusal
    from batchgen.multimodal.prompt import NoImages

    config = AutoConfig.for_model("qwen3_5")
    check_supported(config)
    why = image_refusal(config)
    with pytest.raises(ValueError, match="'qwen3_5' is served for text only.*hybrid"):
        NoImages("qwen3_5", why).process({"prompt": "a", "multi_modal_data": {}}, "prompts[0]")


def test_block_keys_and_cuts() -> None:
    """A block's key names each image it overlaps with its offset; a bidirectional image
    is never cut by a chunk's end."""
    from batchgen.kv.block_manager import chain_hashes
    from batchgen.multimodal.items import ImageItem, MMPrompt

    item = ImageItem(b"k" * 16, np.arange(5, 11), {})
    mm = MMPrompt((item,), bidirectional=True)
    assert mm.block_key(0, 4) == b""
    assert mm.block_key(1, 4) == item.key + (1).to_bytes(8, "little", signed=True)
    assert mm.block_key(2, 4) == item.key + (-3).to_bytes(8, "little", signed=True)
    assert [mm.cut(0, n) for n in (4, 5, 6, 9, 11)] == [4, 5, 5, 5, 11]
    assert mm.cut(5, 3) == 0 and MMPrompt((item,)).cut(5, 3) == 3
    ids = list(range(16))
    other = MMPrompt((ImageItem(b"j" * 16, np.arange(5, 11), {}),))
    plain, a, b = (chain_hashes(ids, 4, [], extra=e) for e in
                   (None, mm.block_key, other.block_key))
    assert plain[0] == a[0] == b[0] and len({plain[1], a[1], b[1]}) == 3


def test_every_image_text_family_is_served_or_refused_from_its_config() -> None:
    """transformers' image-text-to-text families: served with images (the parity tests
    above, smolvlm through idefics3's path), served as text (images refused by name), or
    refused from the config alone with a ValueError naming the family."""
    from transformers import AutoConfig

    from batchgen.model.loader import check_supported
    from batchgen.multimodal.families import (
        SERVED,
        TEXT_SERVED,
        image_refusal,
        image_text_families,
    )

    assert set(FAMILIES) | {"smolvlm", "gemma3"} == set(SERVED)
    refused, built = 0, 0
    for family in sorted(image_text_families()):
        try:
            config = AutoConfig.for_model(family)
        except Exception:  # no default config (a composite needing its parts): by name
            config = type("Config", (), {"model_type": family, "vision_config": {}})()
        built += hasattr(config, "to_dict")
        if family in SERVED:
            assert image_refusal(config) is None
            continue
        if family in TEXT_SERVED:
            check_supported(config)
            assert image_refusal(config)
            continue
        with pytest.raises(ValueError, match=f"'{family}'"):
            check_supported(config)
        refused += 1
    assert refused > 80 and built > 90


def test_new_weights_never_read_old_image_features(tiny_vlm_factory) -> None:
    """load_weights on the vision side: the encoder cache's features of the old weights are
    dropped, so outputs follow HF on the new weights."""
    from transformers import AutoModelForImageTextToText

    path = tiny_vlm_factory("llava")
    prompt = workload("llava")[0]
    llm = LLM(path, block_size=8, num_kv_blocks=64)
    before = greedy(llm, [prompt], T)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    name = "model.multi_modal_projector.linear_1.weight"
    weight = dict(model.named_parameters())[name]
    with torch.no_grad():
        weight.mul_(3.0)
    llm.load_weights([(name, weight.detach().clone())])
    _, processor = _hf(str(path))
    inputs = processor(text=[prompt[0]], images=[prompt[1]], return_tensors="pt")
    with torch.inference_mode():
        ids = model.generate(**inputs, max_new_tokens=T, do_sample=False, eos_token_id=EOS_ID,
                             pad_token_id=0)
    want = strip_after_eos(ids[0, inputs["input_ids"].shape[1]:].tolist())
    assert greedy(llm, [prompt], T) == [want] != before


def test_an_image_column_in_a_dataset_job_and_the_cli(tiny_vlm_factory, tmp_path: Path,
                                                      capsys) -> None:
    """generate_dataset with datasets' Image column (kept encoded in the shards) and a JSON
    Lines file of image paths through `batchgen generate --image-column`: each row's outputs
    equal LLM.generate's on the same image; a resumed job has nothing left to do."""
    import datasets
    import pyarrow.parquet as pq

    from batchgen.cli import main
    from batchgen.data import generate_dataset

    path = tiny_vlm_factory("llava")
    ph = IMAGE_PLACEHOLDER["llava"]
    pics = [image(20 + i, 16, 16) for i in range(3)]
    texts = [f"caption {ph} number {i}" for i in range(3)]
    llm = LLM(path, block_size=8, num_kv_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=6)
    want = greedy(llm, list(zip(texts, [[p] for p in pics])), 6)
    rows = datasets.Dataset.from_dict({"prompt": texts, "image": pics}).cast_column(
        "image", datasets.Image())
    out = generate_dataset(llm, rows, params, image_column="image", output_dir=tmp_path / "a",
                           use_tqdm=False)
    assert [r["outputs"][0]["token_ids"] for r in out] == want
    again = generate_dataset(llm, rows, params, image_column="image", resume=True,
                             output_dir=tmp_path / "a", use_tqdm=False)
    assert llm.kv_stats().prompt_tokens_computed == 0 and len(again) == 3
    files = []
    for i, p in enumerate(pics):
        p.save(tmp_path / f"{i}.png")
        files.append({"prompt": texts[i], "image": str(tmp_path / f"{i}.png")})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(f) + "\n" for f in files))
    argv = ["generate", "--model", str(path), "--input", str(tmp_path / "rows.jsonl"),
            "--output", str(tmp_path / "b"), "--max-tokens", "6", "--temperature", "0",
            "--num-kv-blocks", "128", "--block-size", "8", "--quiet"]
    assert main([*argv, "--image-column", "picture"]) != 0
    assert "--image-column 'picture' is not a column" in capsys.readouterr().err
    assert main([*argv, "--image-column", "image"]) == 0
    shards = pq.read_table(tmp_path / "b").to_pylist()
    assert [r["outputs"][0]["token_ids"] for r in sorted(shards, key=lambda r: r["row_id"])] \
        == want
    # a resume over image paths keeps unchanged files' rows and redoes a file changed in place
    job = dict(image_column="image", output_dir=tmp_path / "c", use_tqdm=False)
    generate_dataset(llm, tmp_path / "rows.jsonl", params, **job)
    generate_dataset(llm, tmp_path / "rows.jsonl", params, resume=True, **job)
    assert llm.kv_stats().prompt_tokens_computed == 0
    pics[1] = image(30, 16, 16)
    pics[1].save(tmp_path / "1.png")
    again = generate_dataset(llm, tmp_path / "rows.jsonl", params, resume=True, **job)
    assert llm.kv_stats().prompt_tokens_computed > 0
    now = greedy(llm, list(zip(texts, [[p] for p in pics])), 6)
    assert [r["outputs"][0]["token_ids"] for r in again] == now != want


def test_kv_plan_counts_the_encoder_cache(tiny_vlm_factory, tiny_model_factory) -> None:
    from transformers import AutoConfig

    from batchgen.cli.kv_plan import report_lines
    from batchgen.kv_plan import plan_kv

    vlm = plan_kv(AutoConfig.from_pretrained(tiny_vlm_factory("qwen2_5_vl")))
    text = plan_kv(AutoConfig.from_pretrained(tiny_model_factory("llama")))
    assert vlm.encoder_cache_bytes > 0 and text.encoder_cache_bytes == 0
    assert any("encoder cache keeps up to 256.0 MiB" in line for line in report_lines(vlm, "m"))


def test_image_prompts_are_processed_ahead_in_worker_threads(tiny_vlm_factory, monkeypatch
                                                              ) -> None:
    """The processor runs in the worker threads, each on its own copy; a stream submits the
    next chunk's prompts when it hands out the current chunk's first group (so they are
    processed while the engine steps), and its outputs equal a plain generate's."""
    from batchgen.kinds import kind_of
    from batchgen.multimodal.ahead import ProcessorPool
    from batchgen.multimodal.prompt import ImagePrompts

    path = tiny_vlm_factory("llava")
    prompts = [as_prompt(t, i) for t, i in workload("llava") if i] * 2  # 6 image prompts
    llm = LLM(path, limit_mm_per_prompt={"image": 2}, block_size=8, num_kv_blocks=256,
              max_num_seqs=2)  # a stream pulls chunks of 2 prompts
    params = SamplingParams(temperature=0, max_tokens=4)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    submitted, ran = [], []
    submit, process = ProcessorPool.submit, ImagePrompts.process
    monkeypatch.setattr(ProcessorPool, "submit",
                        lambda self, p, name: submitted.append(name) or submit(self, p, name))
    monkeypatch.setattr(ImagePrompts, "process", lambda self, p, name: ran.append(
        (threading.current_thread().name, id(self.processor))) or process(self, p, name))
    groups = llm.requests.stream(iter(prompts), params, kind_of(params), 2)
    next(groups)
    assert submitted == [f"prompts[{i}]" for i in range(4)]  # chunk 2 started already
    groups.close()
    got = dict(llm.generate_stream(iter(prompts), params, use_tqdm=False))
    assert [got[i].outputs[0].token_ids for i in range(len(prompts))] == want
    assert ran and all(name.startswith("batchgen-mm") for name, _ in ran)
    assert id(llm.requests.images.prompts.processor) not in {p for _, p in ran}


def test_run_batch_chat_lines_with_image_parts(tiny_vlm_factory, tmp_path: Path) -> None:
    """OpenAI batch-file chat lines with image_url parts (a data: and a file:// URL) answer as
    `llm.chat` does on the same messages; an http URL is that line's error, the others run."""
    import base64

    from batchgen.batch_api import run_batch

    llm = LLM(tiny_vlm_factory("llava"), block_size=8, num_kv_blocks=128)
    template = ("{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
                "<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endfor %}")
    file = tmp_path / "a.png"
    image(6, 16, 16).save(file)
    data = "data:image/png;base64," + base64.b64encode(file.read_bytes()).decode()
    urls = {"data": data, "file": f"file://{file}", "http": "https://example.org/a.png"}
    msgs = {k: [{"role": "user", "content": [{"type": "text", "text": f"look {k}"},
                                             {"type": "image_url", "image_url": {"url": u}}]}]
            for k, u in urls.items()}
    lines = [json.dumps({"custom_id": k, "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": m, "max_tokens": T, "temperature": 0}})
             for k, m in msgs.items()]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    s = run_batch(llm, tmp_path / "in.jsonl", tmp_path / "out.jsonl", chat_template=template,
                  use_tqdm=False)
    assert (s.answered, s.errors) == (2, 1)
    got = {d["custom_id"]: d for d in map(json.loads, (tmp_path / "out.jsonl").open())}
    assert "never downloads" in got["http"]["error"]["message"]
    refs = llm.chat([msgs["data"], msgs["file"]], SamplingParams(temperature=0, max_tokens=T),
                    use_tqdm=False, chat_template=template)
    for key, ref in zip(("data", "file"), refs):
        body = got[key]["response"]["body"]
        assert body["choices"][0]["message"]["content"] == ref.outputs[0].text
        assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    image(7, 16, 16).save(file)  # the same file:// URL, another image: that line reruns
    s = run_batch(llm, tmp_path / "in.jsonl", tmp_path / "out.jsonl", chat_template=template,
                  resume=True, use_tqdm=False)
    assert (s.answered, s.reused, s.recomputed, s.errors) == (0, 1, 1, 1)
