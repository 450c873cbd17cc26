"""The memory table of docs/families.md: for each hybrid / state-space family, its config
class's defaults (transformers' own, mostly the flagship checkpoint's shape) planned as
`batchgen kv-plan` plans them, from the config alone on the meta device: the layers holding
K/V, β (bf16 K/V bytes per token) and the mixer state per sequence (any length).

    PYTHONPATH=. python scripts/hybrid_memory.py
"""

from __future__ import annotations

from transformers import AutoConfig

from batchgen.kv_plan import plan_kv

FAMILIES = ("qwen3_next", "qwen3_5_text", "granitemoehybrid", "nemotron_h", "jamba", "bamba",
            "falcon_h1", "lfm2", "kimi_linear", "olmo_hybrid", "minimax", "mamba2")


def main() -> None:
    print("| family | layers | K/V layers | β (bf16 bytes/token) | state per sequence |")
    print("|---|---:|---:|---:|---:|")
    for family in FAMILIES:
        config = AutoConfig.for_model(family)
        try:
            plan = plan_kv(config, dtype="bfloat16", memory=2**30)
        except Exception as e:  # a default config the meta build cannot take: say so
            print(f"| {family} | - | - | - | not planned ({type(e).__name__}) |")
            continue
        total = config.get_text_config().num_hidden_layers
        kv = plan.num_layers if plan.bytes_per_token > 4 else 0  # mamba2: one 4-byte stand-in
        print(f"| {family} | {total} | {kv} | {plan.bytes_per_token if kv else 0:,} | "
              f"{plan.state_bytes_per_seq / 2**20:.2f} MiB |")


if __name__ == "__main__":
    main()
