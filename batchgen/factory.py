"""Building an engine, in one place: what is settled before the weights load (`plan_engine`),
the model's parts (`load_parts`), the model runner over the KV pool (`build_runner`, used by
LLM and by every tensor-parallel worker), and the engine and request front end around a
runner (`build_engine`, `build_frontend`, used by LLM and by the tests' weightless engine).
`assemble` runs them in order for LLM, through an Executor (this process, or a
tensor-parallel group) for whatever every rank must do alike."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from batchgen import cpu_allocator, quantization, threads
from batchgen.attention.backend import AttentionBackend
from batchgen.attention.mla import install_latent
from batchgen.attention.registry import (
    BackendQuery,
    Candidate,
    backend_candidates,
    build_backend,
    reserved_bytes,
)
from batchgen.attention.spec import AttentionSpec, check_pool_geometry
from batchgen.config import CacheConfig, EngineConfig, KVLayout, PoolSize, kv_layout, size_pool
from batchgen.engine.batch import PersistentBatch
from batchgen.engine.engine import Engine, Runner
from batchgen.engine.kv_manager import KVManager
from batchgen.engine.output_processor import OutputProcessor
from batchgen.engine.scheduler import Scheduler
from batchgen.kv.block_manager import BlockManager, blocks_for
from batchgen.kv.cache import FP8_DTYPES, KVCache
from batchgen.kv.swap import HostPool
from batchgen.log import logger
from batchgen.model import loader
from batchgen.model.cuda_graphs import GRAPH_POOL_BYTES, CudaGraphCapturer, capture_sizes
from batchgen.model.families import classify
from batchgen.model.forward_queue import ForwardQueue
from batchgen.model.inputs import StepInputs
from batchgen.model.loader import KVGeometry
from batchgen.model.profile import device_kv_budget
from batchgen.model.runner import ModelRunner
from batchgen.model.shared import (
    check_module,
    module_device,
    module_dtype,
    module_folder,
    paged_forward,
)
from batchgen.model.state_probe import config_state, fill_specs, probe_layers
from batchgen.multimodal.encoder import ENCODER_CACHE_BYTES, VisionEncoder
from batchgen.multimodal.families import VisionFamily, image_refusal, vision_family
from batchgen.multimodal.processor import load_processor
from batchgen.multimodal.prompt import ImagePrompts, NoImages
from batchgen.multimodal.step import VisionStep, rope_index_of
from batchgen.quantization import KVScales, QuantPlan
from batchgen.requests import Limits, RequestBuilder
from batchgen.results import ResultBuilder
from batchgen.sampling.grammar import Grammars
from batchgen.sampling.sampler import Sampler
from batchgen.sampling.stop import StopFactory
from batchgen.state.cache import StateCache
from batchgen.state.layout import StateLayout
from batchgen.state.pool import StatePool
from batchgen.state.slots import StateSlots
from batchgen.state.snapshots import prefill_grid

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# CPU steps are padded to a multiple of this many tokens (and at least this many logits rows):
# small-M GEMMs and the scalar tails of elementwise kernels round differently, and padding keeps
# each row's result independent of its batch.
CPU_MIN_BATCH_ROWS = 16


@dataclass(frozen=True)
class EnginePlan:
    """What is settled before the weights load: folders, config, device, dtypes, this rank's
    KV geometry, the attention backends to try, and (unless a GPU pool is sized from the
    memory the weights leave) the pool."""

    path: Path
    tokenizer_path: Path | None  # None: a shared module from no folder, and no tokenizer given
    config: PretrainedConfig
    device: torch.device
    dtype: torch.dtype
    geo: KVGeometry  # this rank's share of the KV heads
    layout: KVLayout
    backends: list[Candidate]  # best first
    pool: PoolSize | None  # None: a GPU pool, sized once the weights are in
    module: torch.nn.Module | None = None  # the caller's model, used as it is (no load)
    state: StateLayout | None = None  # state mixers, planned on the meta device
    quant: QuantPlan | None = None  # how quantized weights load (None: full precision)
    vision: VisionFamily | None = None  # a vision-language family served with images

    def min_rows(self) -> int:
        """The multiple a CPU step's rows are padded to (batch invariance); none on a GPU."""
        return CPU_MIN_BATCH_ROWS if self.device.type == "cpu" else 0

    def max_step_tokens(self, cfg: EngineConfig) -> int:
        """The most query tokens one step can have, padding included (backends size their
        buffers by it)."""
        m = self.min_rows()
        return -(-max(cfg.max_num_batched_tokens, m) // m) * m if m else cfg.max_num_batched_tokens


@dataclass(frozen=True)
class RunnerSetup:
    """The pool, backend and step-buffer sizes of a runner: rank 0 settles them and every
    tensor-parallel rank builds the same over its local heads."""

    num_layers: int
    num_kv_heads: int  # this rank's
    head_dim: int
    num_blocks: int
    block_size: int
    kv_dtype: torch.dtype
    backend: str  # the backend rank 0 chose (registry name)
    max_step_tokens: int
    inputs: tuple[int, int, int, int]  # StepInputs(max tokens, max rows, max pages, min rows)
    num_host_blocks: int = 0  # the swap pool (swap_space), block ids as rank 0's
    head_dim_v: int | None = None  # values' width when it differs from the keys' (MLA)
    latent: bool = False  # MLA latent: the values are the keys' first head_dim_v
    kv_layers: tuple[int, ...] | None = None  # the layers holding K/V (None: every layer)
    kv_scales: KVScales | None = None  # an fp8 pool's per-layer scales (None: 1.0)


class Executor(Protocol):
    """Where the model's forward runs: this process alone, or a tensor-parallel group whose
    workers must build and size what rank 0 does (distributed/executor.py)."""

    tp_size: int
    tp_mesh: Any  # the mesh this rank's shard is cut over (a subgroup's), None: the world's

    def setup(self, setup: RunnerSetup) -> None:
        """The other ranks build the same runner."""
        ...

    def kv_budget(self, profile: tuple[int, int, float, int], local: Callable[[], int]) -> int:
        """The GPU pool's bytes: this rank's `local()` budget, the tightest over ranks."""
        ...

    def agree(self, pool: PoolSize) -> PoolSize:
        """A pool sized before the weights, as every rank will build it."""
        ...

    def runner(self, local: ModelRunner) -> Runner:
        """The engine's runner around this rank's ModelRunner."""
        ...

    def start_failed(self, error: BaseException) -> BaseException:
        """The error a failed start raises (the executor is stopped)."""
        ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """One process, one rank: nothing to share."""

    tp_size = 1
    tp_mesh = None

    def setup(self, setup: RunnerSetup) -> None:
        pass

    def kv_budget(self, profile: tuple[int, int, float, int], local: Callable[[], int]) -> int:
        return local()

    def agree(self, pool: PoolSize) -> PoolSize:
        return pool

    def runner(self, local: ModelRunner) -> Runner:
        return local

    def start_failed(self, error: BaseException) -> BaseException:
        return error

    def shutdown(self) -> None:
        pass


def plan_engine(model: str | os.PathLike | torch.nn.Module,
                tokenizer: str | os.PathLike | None, dtype: str | torch.dtype,
                device: str | torch.device | None, cfg: EngineConfig) -> EnginePlan:
    """Everything the weights are not needed for: the folders, the config, the weights'
    headers, device, dtypes, attention backend, max_model_len and (unless it is sized from
    the GPU memory left once the weights are in) the pool. ValueError naming what is wrong.
    A loaded model (`torch.nn.Module`) is planned around as it is: see `plan_shared`."""
    if isinstance(model, torch.nn.Module):
        return plan_shared(model, tokenizer, dtype, device, cfg)
    gguf = quantization.gguf_source(model)
    path = gguf[0] if gguf else loader.resolve_model_dir(model)
    tok_path = (path if tokenizer is None else
                loader.resolve_model_dir(tokenizer, "tokenizer", loader.TOKENIZER_FILES))
    config = (quantization.load_gguf_config(*gguf, cfg.trust_remote_code) if gguf
              else loader.load_config(path, cfg.trust_remote_code))
    loader.check_supported(config)
    dev = resolve_device(device)
    quant = quantization.plan_quantization(config, cfg.quantization, dev,
                                           gguf[1] if gguf else None)  # config alone
    quantization.check_tensor_parallel(quant, cfg.tensor_parallel_size)
    if gguf:
        quantization.check_gguf(*gguf)
    else:
        loader.check_weights(path)
    k = cfg.tensor_parallel_size
    if k > 1 and dev.type == "cuda":  # rank 0's GPU; under an external launcher, this rank's
        external = cfg.distributed_executor_backend == "external_launcher"
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) if external else 0)
    check_tp(config, k, dev)
    vision = vision_family(config)
    if vision is not None and k > 1:
        raise ValueError(f"tensor_parallel_size must be 1 for vision-language models "
                         f"({vision.name}), got {k}")
    plan = _plan(path, tok_path, config, dev, loader.resolve_dtype(dtype, config), cfg)
    return replace(plan, quant=quant, vision=vision)


def plan_shared(module: torch.nn.Module, tokenizer: str | os.PathLike | None,
                dtype: str | torch.dtype, device: str | torch.device | None,
                cfg: EngineConfig) -> EnginePlan:
    """The plan for a model the caller holds: its device and dtype (an explicit other one is
    refused: nothing is copied), its config, tokenizer from `tokenizer` or the folder it was
    loaded from (else none: token-id prompts), one rank."""
    config = check_module(module)
    loader.check_supported(config)
    dev, mdtype = module_device(module), module_dtype(module)
    if cfg.quantization is not None and quantization.checkpoint_method(config) is None:
        raise ValueError(f"quantization={cfg.quantization!r}: a loaded model is used as it is "
                         "(nothing is quantized); pass None, or load it quantized yourself")
    quant = quantization.plan_quantization(config, cfg.quantization, dev)  # as loaded
    if device is not None and resolve_device(device) != dev:
        raise ValueError(f"device must be None or the model's own device ({dev}): a loaded "
                         f"model is used where it is, got {device!r}")
    if dtype not in ("auto", mdtype, str(mdtype).removeprefix("torch.")):
        raise ValueError(f"dtype must be 'auto' or the model's own dtype ({mdtype}): a loaded "
                         f"model is used as it is, got {dtype!r}")
    if cfg.tensor_parallel_size != 1:
        raise ValueError("tensor_parallel_size must be 1 for a loaded model (its weights are "
                         f"not split), got {cfg.tensor_parallel_size}")
    folder = module_folder(module)
    tok_path = (folder if tokenizer is None else
                loader.resolve_model_dir(tokenizer, "tokenizer", loader.TOKENIZER_FILES))
    path = folder or Path(str(getattr(module, "name_or_path", "") or type(module).__name__))
    # the trainer's forward runs through the same MLA modules: they keep their expand_kv, so
    # the pool holds decompressed K/V (no latent seam installed on a module we do not own)
    return replace(_plan(path, tok_path, config, dev, mdtype, cfg, latent=False), module=module,
                   quant=quant)


def _plan(path: Path, tok_path: Path | None, config: PretrainedConfig, dev: torch.device,
          model_dtype: torch.dtype, cfg: EngineConfig, latent: bool | None = None
          ) -> EnginePlan:
    """The plan's KV side: this rank's geometry, the pool's layout, the backends to try and
    (unless the GPU's free memory sizes it) the pool."""
    state = config_state(config, model_dtype, cfg.trust_remote_code)  # refusals: no weights
    geo = loader.with_kv_layers(loader.kv_geometry(config, latent),
                                state.attention_layers if state is not None else None)
    k = cfg.tensor_parallel_size
    if geo.latent and k > 1:
        raise ValueError(f"tensor_parallel_size={k}: an MLA latent cache has one KV head to "
                         "split; use tensor_parallel_size=1 or BATCHGEN_MLA_CACHE=decompressed")
    geo = replace(geo, num_kv_heads=geo.num_kv_heads // k)  # this rank's share
    layout = kv_layout(cfg, geo, model_dtype)
    backends = backend_candidates(cfg.attention_backend, BackendQuery(
        dev, model_dtype, layout.kv_dtype, geo.head_dim))
    pool = (None if pool_from_gpu_memory(dev, cfg)
            else size_pool(cfg, layout, dev, None, cfg.swap_space))
    if state is not None and k > 1:
        raise ValueError("tensor_parallel_size must be 1 for models with state mixers "
                         f"({config.model_type}), got {k}")
    return EnginePlan(path, tok_path, config, dev, model_dtype, geo, layout, backends, pool,
                      state=state)


def pool_from_gpu_memory(device: torch.device, cfg: EngineConfig) -> bool:
    """Whether the pool is sized from the GPU memory the weights leave (once they are in),
    not from num_kv_blocks, kv_cache_memory or the CPU default."""
    return device.type == "cuda" and cfg.num_kv_blocks is None and cfg.kv_cache_memory is None


def check_tp(config: PretrainedConfig, tp_size: int, device: torch.device) -> None:
    """ValueError unless the model's heads split over `tp_size` ranks, transformers has a
    tensor-parallel plan for its family, and (on CUDA) that many GPUs are visible."""
    if tp_size == 1:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % tp_size or kv_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide the model's attention heads ({heads}) "
            f"and KV heads ({kv_heads}): each rank holds whole heads (transformers does not "
            "replicate KV heads); pick a tensor_parallel_size that divides both")
    if not getattr(text, "base_model_tp_plan", None):
        raise ValueError(f"tensor_parallel_size={tp_size}: transformers has no tensor-parallel "
                         f"plan for {text.model_type!r} models; use tensor_parallel_size=1")
    if device.type == "cuda" and tp_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={tp_size} needs {tp_size} GPUs, but "
                         f"{torch.cuda.device_count()} are visible (CUDA_VISIBLE_DEVICES)")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device asked for (the GPU when one is there and none is named), a GPU always with
    its index (the current one for a bare 'cuda': torch.cuda.set_device and device
    comparisons need it); ValueError for one that is not 'cpu', 'cuda' or 'cuda:N', or a GPU
    that is not there."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA device is available")
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if dev.type == "cuda" and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device is {device!r} but this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s) (cuda:0 ...)")
    return dev


@dataclass(frozen=True)
class ModelParts:
    """The loaded model and what comes with it."""

    model: torch.nn.Module
    tokenizer: Any
    generation_config: Any
    eos_token_ids: list[int]
    pad_token_id: int | None
    vocab_size: int  # the lm_head's rows
    specs: list[AttentionSpec]  # probed from the loaded model's attention layers
    state: StateLayout | None = None  # its mixers' per-sequence state (None: attention only)
    processor: Any = None  # a vision-language model's HF processor


def load_parts(plan: EnginePlan, cfg: EngineConfig, tp_mesh: Any = None) -> ModelParts:
    """Tokenizer, weights (this rank's shard: over `tp_mesh` when given, else the world),
    generation config, EOS and pad ids, and the attention specs probed from the loaded model."""
    if plan.device.type == "cpu":
        cpu_allocator.tune_host_allocator()  # reuse freed activations (see the module)
    tokenizer = (loader.load_tokenizer(plan.tokenizer_path, cfg.trust_remote_code)
                 if plan.tokenizer_path is not None and not cfg.skip_tokenizer_init else None)
    if (tokenizer is None and not cfg.skip_tokenizer_init and plan.quant is not None
            and plan.quant.gguf_file is not None):
        tokenizer = quantization.load_gguf_tokenizer(plan.path, plan.quant.gguf_file)
    if plan.module is not None:  # the caller's model: no load, its attention switched per forward
        model, gen = plan.module, getattr(plan.module, "generation_config", None)
    else:
        model = loader.load_model(plan.path, plan.config, plan.dtype, plan.device,
                                  cfg.trust_remote_code, cfg.tensor_parallel_size, tp_mesh,
                                  quantization.load_kwargs(plan.quant, plan.dtype, plan.device),
                                  vision=plan.vision is not None)
        gen = loader.load_generation_config(plan.path)
        if plan.geo.latent:  # the attention layers only (a hybrid's mixers have no latent)
            install_mla_latent(model, len(classify(plan.config).attention_layers))
    with paged_forward(model) if plan.module is not None else nullcontext():
        probed, state = probe_layers(model, plan.geo.num_layers, plan.device)
    geo = plan.geo
    attending = [i for i, s in enumerate(probed) if s is not None]
    if geo.kv_layers is not None and not set(attending) <= set(geo.kv_layers):
        raise RuntimeError(f"model family {plan.config.model_type!r}: layers {attending} "
                           f"attend, but the plan gave K/V rows to {list(geo.kv_layers)}")
    specs = fill_specs(probed, geo.num_kv_heads, geo.head_dim, geo.head_dim_v or geo.head_dim,
                       plan.dtype)
    processor = (load_processor(plan.path, cfg.trust_remote_code)
                 if plan.vision is not None else None)
    return ModelParts(model, tokenizer, gen, loader.eos_ids(plan.config, gen, tokenizer),
                      loader.pad_id(plan.config, gen),
                      model.get_output_embeddings().weight.shape[0], specs, state, processor)


def install_mla_latent(model: torch.nn.Module, num_layers: int) -> None:
    """Every MLA layer keeps its latent in the pool (attention/mla.py); a ValueError when the
    model's modules do not all offer the seam."""
    found = install_latent(model)
    if found != num_layers:
        raise ValueError(f"model family {model.config.model_type!r}: {found} of {num_layers} "
                         "MLA layers offer expand_kv for the latent cache; set "
                         "BATCHGEN_MLA_CACHE=decompressed")


def build_runner(model: torch.nn.Module, setup: RunnerSetup, device: torch.device,
                 make_backend: Callable[[KVCache], AttentionBackend], shared: bool = False,
                 state: StateLayout | None = None, vision: VisionFamily | None = None
                 ) -> ModelRunner:
    """A rank's runner: its pool (its KV heads), the backend over it, its step buffers, its
    host swap pool and, for a model with state mixers, the state pool (a slot per sequence
    of max_num_seqs, growing when n samples or beams hold more) behind the cache seam, for a
    vision-language model its image seam (the encoder and its cache); `shared`: the model
    is the caller's (attention switched per forward)."""
    cache = KVCache(setup.num_layers, setup.num_blocks, setup.block_size, setup.num_kv_heads,
                    setup.head_dim, setup.kv_dtype, device, setup.head_dim_v, setup.latent,
                    setup.kv_layers)
    if setup.kv_scales is not None:  # the checkpoint's calibration (quantization/kv_scales.py)
        cache.k_scales, cache.v_scales = list(setup.kv_scales.k), list(setup.kv_scales.v)
    backend = make_backend(cache)
    tokens, rows, pages, min_rows = setup.inputs
    inputs = StepInputs(tokens, rows, pages, setup.block_size, cache.scratch_block, min_rows,
                        device)
    host = HostPool(cache, setup.num_host_blocks) if setup.num_host_blocks else None
    seam = StateCache(StatePool(state, rows, device)) if state is not None else None
    images = (VisionStep(model, vision, VisionEncoder(model, vision, device,
                                                      next(model.parameters()).dtype))
              if vision is not None else None)
    return ModelRunner(model, cache, backend, inputs, host, shared, seam, images)


@dataclass(frozen=True)
class EngineShape:
    """What the engine's bookkeeping is sized by."""

    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    vocab_size: int
    eos_token_ids: list[int]
    enable_prefix_caching: bool = True
    num_host_blocks: int = 0
    preemption_mode: str = "recompute"
    device: torch.device = torch.device("cpu")
    logprobs_mode: str = "raw_logprobs"
    state_bytes_per_seq: int = 0  # the model has state mixers: sequences hold state slots
    state_grid: int = 0  # their prefills are cut on multiples of this (state/snapshots.py)
    max_logprobs: int = 20  # vLLM's: most logprobs / prompt_logprobs a request asks (-1: any)
    scheduling_policy: str = "fcfs"  # or "priority": lower priority starts first
    disable_any_whitespace: bool = False  # every JSON constraint without free whitespace


def build_engine(shape: EngineShape, runner: Runner, overlap: bool = False) -> Engine:
    """Block manager, persistent batch, KV manager, scheduler, sampler and output processor
    around a runner; `overlap`: the forward runs on a ForwardQueue (async scheduling)."""
    bm = BlockManager(shape.num_blocks, shape.block_size, shape.enable_prefix_caching,
                      shape.num_host_blocks)
    batch = PersistentBatch(shape.max_num_seqs, shape.vocab_size,
                            blocks_for(shape.max_model_len, shape.block_size),
                            shape.eos_token_ids, shape.device)
    kv = KVManager(bm, batch, StateSlots(shape.state_bytes_per_seq)
                   if shape.state_bytes_per_seq else None, shape.state_grid)
    scheduler = Scheduler(kv, shape.max_num_seqs, shape.max_num_batched_tokens,
                          shape.preemption_mode, shape.scheduling_policy == "priority")
    queue = ForwardQueue(shape.device) if overlap else None
    return Engine(scheduler, runner, Sampler(logprobs_mode=shape.logprobs_mode),
                  OutputProcessor(kv), queue)


def build_frontend(shape: EngineShape, tokenizer: Any, seed: int | None = 0,
                   pad_token_id: int | None = None,
                   images: ImagePrompts | NoImages | None = None
                   ) -> tuple[RequestBuilder, ResultBuilder]:
    """The request builder (prompts and params to groups, every limit checked; `images`:
    how prompts with images are processed or refused) and the result builder (finished
    groups to outputs)."""
    stops = StopFactory(tokenizer, shape.eos_token_ids)
    limits = Limits(shape.max_model_len, shape.vocab_size, shape.block_size, shape.num_blocks,
                    shape.max_num_batched_tokens, shape.max_logprobs)
    grammars = Grammars(tokenizer, shape.vocab_size, shape.eos_token_ids,
                        shape.disable_any_whitespace)
    return (RequestBuilder(tokenizer, limits, stops, shape.eos_token_ids, seed, pad_token_id,
                           grammars, images), ResultBuilder(tokenizer, stops))


def image_side(plan: EnginePlan, cfg: EngineConfig, parts: ModelParts
               ) -> ImagePrompts | NoImages:
    """How the request builder treats prompts with images: the model's processor for a
    served vision-language family, else a refusal naming the family and why."""
    family = str(getattr(plan.config, "model_type", "?"))
    if plan.vision is None:
        why = image_refusal(plan.config)
        if why is None and vision_family(plan.config) is not None:  # LLM(<loaded module>)
            why = "images need the model's folder (LLM(path)), not a loaded module"
        return NoImages(family, why)
    return ImagePrompts(parts.processor, plan.vision, plan.vision.image_token_id(plan.config),
                        cfg.image_limit, cfg.mm_processor_kwargs,
                        rope_index_of(parts.model) if plan.vision.mrope else None,
                        cfg.max_num_batched_tokens, str(plan.path))


@dataclass(frozen=True)
class Assembled:
    """An engine over a loaded model, ready to run."""

    parts: ModelParts
    cache_config: CacheConfig
    max_model_len: int
    cache: KVCache
    attention_backend: str
    engine: Engine
    requests: RequestBuilder
    results: ResultBuilder
    gpu_reserve: tuple[int, int] | None  # (backend, graph pool) bytes kept beyond a GPU pool
    state_pool: StatePool | None = None  # a hybrid's mixer state (rank 0's runner)


def assemble(plan: EnginePlan, cfg: EngineConfig, executor: Executor) -> Assembled:
    """Load the model, size a GPU pool from what it left, build the runner on every rank and
    the engine around rank 0's."""
    # a colocated trainer's tensors (a shared model's weights too) are not batchgen's use
    foreign = (torch.cuda.memory_allocated(plan.device)
               if plan.pool is None and plan.device.type == "cuda" else 0)
    parts = load_parts(plan, cfg, executor.tp_mesh)
    pool, reserve = plan.pool, None
    if pool is None:
        reserve = _gpu_reserve(plan, cfg, parts.specs)
        # the mixers' state pool (a slot per sequence, and the scratch one) is made after
        # the KV pool: keep its bytes out of the KV budget
        kept = sum(reserve) + (cfg.max_num_seqs + 1) * (
            parts.state.bytes_per_seq if parts.state else 0) + (
            ENCODER_CACHE_BYTES if plan.vision is not None else 0)

        def local_budget() -> int:
            with paged_forward(parts.model) if plan.module is not None else nullcontext():
                return device_kv_budget(parts.model, plan.max_step_tokens(cfg),
                                        cfg.max_num_seqs, plan.device,
                                        cfg.gpu_memory_utilization, kept, foreign)

        budget = executor.kv_budget(
            (plan.max_step_tokens(cfg), cfg.max_num_seqs, cfg.gpu_memory_utilization, kept),
            local_budget)
        pool = size_pool(cfg, plan.layout, plan.device, budget, cfg.swap_space)
    else:
        pool = executor.agree(pool)
    if pool.max_model_len < plan.layout.target_len:
        logger.info("max_model_len = %d, what the KV pool holds (the model allows %d)",
                    pool.max_model_len, plan.layout.target_len)
    chosen: list[str] = []

    def make_backend(cache: KVCache) -> AttentionBackend:
        name, backend = build_backend(plan.backends, parts.specs, cache,
                                      plan.max_step_tokens(cfg),
                                      insisted=cfg.attention_backend is not None)
        chosen.append(name)
        return backend

    setup = _runner_setup(plan, cfg, pool, "")
    check_pool_geometry(parts.specs, setup.num_kv_heads, setup.head_dim,
                        setup.head_dim_v or setup.head_dim)
    local = build_runner(parts.model, setup, plan.device, make_backend, plan.module is not None,
                         parts.state, plan.vision)
    executor.setup(replace(setup, backend=chosen[0]))
    shape = _engine_shape(cfg, pool, parts, plan.device)
    requests, results = build_frontend(shape, parts.tokenizer, cfg.seed, parts.pad_token_id,
                                       image_side(plan, cfg, parts))
    if not cfg.enforce_eager:
        _capture_graphs(local, plan, cfg, pool.max_model_len, executor.tp_size)
    state = parts.state.bytes_per_seq if parts.state else 0
    return Assembled(parts, CacheConfig(cfg.block_size, pool.num_blocks,
                                        plan.layout.bytes_per_token, pool.num_host_blocks,
                                        state, cfg.max_num_seqs if state else 0,
                                        plan.quant.method if plan.quant else None),
                     pool.max_model_len, local.cache, chosen[0],
                     build_engine(shape, executor.runner(local), bool(cfg.async_scheduling)),
                     requests, results, reserve,
                     local.mixers.state.pool if local.mixers is not None else None)


def _engine_shape(cfg: EngineConfig, pool: PoolSize, parts: ModelParts, device: torch.device
                  ) -> EngineShape:
    """What the engine's bookkeeping is sized by, from the config, pool and loaded model."""
    state = parts.state
    return EngineShape(pool.num_blocks, cfg.block_size, pool.max_model_len, cfg.max_num_seqs,
                       cfg.max_num_batched_tokens, parts.vocab_size, parts.eos_token_ids,
                       _prefix_caching(cfg, state), pool.num_host_blocks, cfg.preemption_mode,
                       device, cfg.logprobs_mode, state.bytes_per_seq if state else 0,
                       _state_grid(cfg, state), cfg.max_logprobs, cfg.scheduling_policy,
                       cfg.disable_any_whitespace)


def _prefix_caching(cfg: EngineConfig, state: StateLayout | None) -> bool:
    """Prefix caching as asked, except for mixers that cannot continue a prompt from a state
    snapshot over several tokens (Mamba-1's scan): their hits would change the bits."""
    if cfg.enable_prefix_caching and state is not None and not state.continues_chunks:
        logger.info("enable_prefix_caching: off for this model (its mixers restart a "
                    "multi-token forward from zero, so a prompt cannot resume from a snapshot)")
        return False
    return bool(cfg.enable_prefix_caching)


def _state_grid(cfg: EngineConfig, state: StateLayout | None) -> int:
    """The grid mixer prefills are cut on (0: attention only, or a restarting scan)."""
    if state is None or not state.continues_chunks:
        return 0
    return prefill_grid(cfg.block_size, cfg.max_num_batched_tokens)


def _capture_graphs(runner: ModelRunner, plan: EnginePlan, cfg: EngineConfig,
                    max_model_len: int, tp_size: int) -> None:
    """Decode steps as CUDA graphs, where the device and the backend allow them."""
    if tp_size > 1 or runner.shared or cfg.enable_sleep_mode:
        logger.info("enforce_eager=False: CUDA graphs are not captured with "
                    "tensor_parallel_size > 1, a shared model or sleep mode (their addresses "
                    "change); running eagerly")
        return
    if runner.mixers is not None or runner.vision is not None:
        logger.info("enforce_eager=False: CUDA graphs are not captured for models with "
                    "state mixers or images; running eagerly")
        return
    if plan.device.type != "cuda" or not runner.backend.supports_graphs:
        logger.info("enforce_eager=False: CUDA graphs need a GPU and a backend that supports "
                    "them (here %s, %s); running eagerly", plan.device.type, runner.backend.name)
        return
    pages = cfg.max_num_seqs * blocks_for(max_model_len, cfg.block_size)
    runner.use_graphs(capture_sizes(cfg.max_num_seqs), pages, CudaGraphCapturer())


def log_capacity(built: Assembled, tp_size: int) -> None:
    """The capacity line, the pool per rank under tensor parallelism, the GPU memory kept
    beyond the pool when it was sized from free memory, the backend, and on the CPU a warning
    when torch's threads outnumber the cores free to run them."""
    logger.info(built.cache_config.capacity_line(built.max_model_len))
    method = built.cache_config.quantization
    logger.info("weights: %.1f MiB as loaded%s", quantization.weight_bytes(built.parts.model)
                / 2**20, f" ({method})" if method else "")
    if built.cache.device.type == "cpu":
        threads.warn_if_oversubscribed()
    if tp_size > 1:
        pool, heads = built.cache.nbytes / 2**20, built.cache.num_kv_heads
        logger.info("tensor parallel: %d ranks, each with that pool over %d of the model's "
                    "%d KV heads (%.1f MiB per rank, %.1f MiB in all)", tp_size, heads,
                    heads * tp_size, pool, pool * tp_size)
    if built.gpu_reserve is not None:
        backend, graphs = built.gpu_reserve
        logger.info("GPU memory kept beyond the pool when sizing it: %.1f MiB for the "
                    "attention backend, %.1f MiB for the CUDA graph pool",
                    backend / 2**20, graphs / 2**20)
    logger.info("attention backend: %s", built.attention_backend)


def _runner_setup(plan: EnginePlan, cfg: EngineConfig, pool: PoolSize, backend: str
                  ) -> RunnerSetup:
    """The runner's sizes: the pool, the largest step, one page per block of max_num_seqs
    sequences of max_model_len."""
    geo = plan.geo
    max_pages = cfg.max_num_seqs * blocks_for(pool.max_model_len, cfg.block_size)
    return RunnerSetup(geo.num_layers, geo.num_kv_heads, geo.head_dim, pool.num_blocks,
                       cfg.block_size, plan.layout.kv_dtype, backend, plan.max_step_tokens(cfg),
                       (cfg.max_num_batched_tokens, cfg.max_num_seqs, max_pages,
                        plan.min_rows()), pool.num_host_blocks, geo.head_dim_v, geo.latent,
                       geo.kv_layers, _kv_scales(plan))


def _kv_scales(plan: EnginePlan) -> KVScales | None:
    """An fp8 pool's scales: the checkpoint's k/v scales (a warning and 1.0 without)."""
    if plan.layout.kv_dtype not in FP8_DTYPES:
        return None
    return quantization.fp8_scales(plan.path, plan.geo.num_layers, plan.geo.kv_layers)


def _gpu_reserve(plan: EnginePlan, cfg: EngineConfig, specs: list[AttentionSpec]
                 ) -> tuple[int, int]:
    """GPU bytes to keep beyond the pool: the attention backend's (workspace, wrappers,
    output; per captured size with graphs) and, with graphs, the graph pool's allowance."""
    sizes = None if cfg.enforce_eager else capture_sizes(cfg.max_num_seqs)
    backend = reserved_bytes(plan.backends, specs, plan.max_step_tokens(cfg), sizes)
    graphs = sizes is not None and any(entry.graphs for entry, _ in plan.backends)
    return backend, GRAPH_POOL_BYTES if graphs else 0
