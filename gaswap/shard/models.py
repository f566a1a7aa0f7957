"""The sharded path's models, kept under their old names: they live in `gaswap.zoo` (an MLP of square blocks and
a Llama-3-shaped decoder, each with the module class its FSDP units are made of, `UNIT_CLASS`)."""
from gaswap.zoo import (  # noqa: F401  (re-exported)
    LLAMA3_8B,
    LLAMA_TINY,
    UNIT_CLASS,
    Attention,
    BlockMLP,
    DecoderLayer,
    FeedForward,
    Llama,
    MLPBlock,
    RMSNorm,
    apply_rope,
    block_mlp,
    llama,
    llama_inputs,
    mlp_inputs,
    rope_tables,
)
