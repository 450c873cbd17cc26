"""Tensor parallelism over a subgroup of the world (vLLM's external_launcher with
tensor_parallel_size < world size: a trainer's world of n ranks split into n/k groups of k
consecutive ranks, each sharding one copy of the model).

transformers 5.24 shards only over a mesh it builds itself: `from_pretrained(...,
distributed_config=...)` calls `cls.prepare_distribute_model` (modeling_utils.py, "if
distributed_config is not None: ... = cls.prepare_distribute_model(distributed_config, ...)"),
whose `initialize_distributed_mesh` (distributed/utils.py) raises unless the mesh spans the whole
world ("The parallel mesh requires {expected} processes, but world_size is {world}"); a
`device_mesh=` argument alone shards nothing (it only reaches the weight loader), and
`dp_replicate_size` to fill the world makes `maybe_distribute_model` wrap the model in FSDP2
(mixin.py, "if distributed_config.dp_size > 1: apply_fully_sharded_data_parallelism"). So the
model class's own classmethod is overridden in a subclass to return the caller's mesh; the rest
of the load (DTensor shards cut while reading the checkpoint, the forward hooks) is
transformers' own, on the "tp" dimension of that mesh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PretrainedConfig

# transformers' mesh dimensions (distributed/utils.py initialize_distributed_mesh)
MESH_DIMS = ("pp", "dp_replicate", "fsdp", "tp")


def world_mesh(tp_size: int, device: torch.device) -> DeviceMesh:
    """The world as transformers lays it out: world/tp data-parallel copies, each over
    `tp_size` consecutive ranks (the "tp" dimension). Every rank of the world must call it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return init_device_mesh(device.type, (1, world // tp_size, 1, tp_size),
                            mesh_dim_names=MESH_DIMS)


def sharded_class(config: PretrainedConfig, mesh: DeviceMesh, device: torch.device) -> type:
    """The config's causal-LM class, loading its shard over `mesh`'s "tp" dimension; ValueError
    for a model transformers does not map (remote code)."""
    from transformers.distributed.utils import TransformersDeviceMesh
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"tensor_parallel_size below the world size needs a model class "
                         f"transformers ships (remote code is not sharded over a subgroup), "
                         f"got {type(config).__name__}")
    base = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]

    def prepare_distribute_model(cls: type, distributed_config: Any, device_map: Any = None
                                 ) -> tuple[Any, torch.device, TransformersDeviceMesh]:
        """transformers' mesh step, with the caller's mesh (no FSDP: dp_size stays 1)."""
        return distributed_config, device, TransformersDeviceMesh(mesh, mesh)

    return type(base.__name__, (base,), {
        "__module__": base.__module__, "__qualname__": base.__qualname__,
        "prepare_distribute_model": classmethod(prepare_distribute_model)})
