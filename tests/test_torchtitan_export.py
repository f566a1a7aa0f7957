"""gaswap.plan.torchtitan: a sharded plan as torchtitan's job configuration (TORCHTITAN_COMMIT), exact where
torchtitan's options coincide with it, and one statement per thing it cannot express."""
import tomllib

from gaswap.plan.shard_search import TORCHTITAN_COMMIT, torchtitan_saves
from gaswap.plan.torchtitan import job_config, to_toml

FORWARD = [["pow_1", "aten.pow.Tensor_Scalar"], ["mm", "aten.mm.default"], ["mul", "aten.mul.Tensor"],
           ["mm_1", "aten.mm.default"], ["silu", "aten.silu.default"],
           ["_scaled_dot_product_flash_attention", "aten._scaled_dot_product_flash_attention.default"],
           ["mm_2", "aten.mm.default"], ["add", "aten.add.Tensor"]]
TITAN_RECOMPUTE = [n for (n, _), saved in zip(FORWARD, torchtitan_saves([t for _, t in FORWARD])) if not saved]
DIST = {"world_size": 8, "strategy": "fsdp", "units": ["DecoderLayer"], "reshard_after_forward": True,
        "mesh": None, "prefetch": {"forward": 0, "backward": 1},
        "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}, "offload": False, "link": None}


def plan(recompute, n=4, *, groups=None, gathered=(), forward=0, backward=1):
    """recompute: one choice for every block, or a list of one per block."""
    blocks = [f"layers.{i}" for i in range(n)]
    per = recompute if isinstance(recompute, list) else [recompute] * n
    entries = [{"units": u, "recompute": r, "unit_paths": [u], "forward": FORWARD} for u, r in zip(blocks, per)]
    return {"world_size": 8, "units": blocks + [""], "recompute": entries,
            "reshard_after_forward_false": list(gathered), "reshard_after_forward_groups": groups or {},
            "forward_prefetch": forward, "backward_prefetch": backward}


def parsed(sections, missing):
    text = to_toml(sections, missing, "exp")
    assert tomllib.loads(text) == sections
    assert TORCHTITAN_COMMIT in text
    return text


def test_exact_mappings():
    assert "mm_1" in TITAN_RECOMPUTE and "mm" not in TITAN_RECOMPUTE and "add" in TITAN_RECOMPUTE
    for rec, mode in (("none", "none"), ("full", "full"), ([TITAN_RECOMPUTE] * 4, "selective")):
        sections, missing = job_config(plan(rec), DIST)
        assert missing == [], rec
        assert sections["activation_checkpoint"] == {"mode": mode}
        assert sections["parallelism"] == {"data_parallel_shard_degree": 8, "data_parallel_replicate_degree": 1,
                                           "fsdp_reshard_after_forward": "default"}
        assert sections["training"] == {"mixed_precision_param": "bfloat16", "mixed_precision_reduce": "float32"}
        assert "expresses the whole plan" in parsed(sections, missing)
    sections, missing = job_config(plan("none", gathered=[f"layers.{i}" for i in range(4)]),
                                   DIST | {"mesh": [2, 4], "offload": True, "mixed_precision": {}})
    assert missing == []
    assert sections["parallelism"] == {"data_parallel_shard_degree": 4, "data_parallel_replicate_degree": 2,
                                       "fsdp_reshard_after_forward": "never"}
    assert sections["training"] == {"mixed_precision_param": "float32", "mixed_precision_reduce": "float32",
                                    "enable_cpu_offload": True}
    parsed(sections, missing)


def test_unexpressible():
    cases = [
        (plan(["none", "full", "none", "full"]), "every 2th block", "114151ad4"),  # torchtitan dropped selective k
        (plan([["mm_1", "add"]] * 4), "recompute sets 2 op(s)", "left out"),
        (plan(["full", "none", "none", "none"]), "recompute sets full; none", "left out"),
        (plan("none", gathered=["layers.2"]), "per-unit reshard: layers.2", "one setting"),
        (plan("none", groups={"layers.1": 4}), "reshard to 4 ranks", "booleans only"),
        (plan("none", forward=2), "forward prefetch of 2", "no prefetch option"),
        (plan("none", backward=3), "backward prefetch of 3", "no prefetch option"),
    ]
    for p, first, second in cases:
        sections, missing = job_config(p, DIST)
        assert any(first in m and second in m for m in missing), (first, missing)
        text = parsed(sections, missing)
        assert f"# - {missing[0]}" in text.splitlines()[3]
    sections, missing = job_config(plan("full"), DIST | {"mixed_precision": {"param_dtype": "float16",
                                                                             "reduce_dtype": "bfloat16"}})
    assert sections["training"] == {} and sections["activation_checkpoint"] == {"mode": "full"}
    assert [m.split(":")[0] for m in missing] == ["mixed precision param_dtype float16",
                                                  "mixed precision reduce_dtype bfloat16"]
    parsed(sections, missing)
    p = plan("full") | {"units": ["layers.0", "layers.1", "layers.2", "layers.3", "tok_embeddings", ""]}
    assert any(m.startswith("FSDP units tok_embeddings") for m in job_config(p, DIST)[1])
