# shardplan 0.1.0 export --to jax: llama-3.1-8b on 16 x NVIDIA H100 80GB HBM3 (2 node(s) of 8), tp=2 pp=1 dp=8
# predicted peak per GPU: 20.25 GiB of 79.11 GiB (binding: stage 0, activations)
# Mesh and PartitionSpecs for the weights as the Hugging Face checkpoint stores them
# (linear [out, in], embeddings/lm_head [vocab, hidden], routed experts [experts, out, in]).
from jax.sharding import PartitionSpec as P

MESH_AXES = ('data', 'context', 'tensor')
MESH_SHAPE = (8, 1, 2)

PARTITION_SPECS = {
    'embed_tokens.weight': P('tensor', 'data'),
    'self_attn.q_proj.weight': P('tensor', 'data'),
    'self_attn.k_proj.weight': P('tensor', 'data'),
    'self_attn.v_proj.weight': P('tensor', 'data'),
    'self_attn.o_proj.weight': P('data', 'tensor'),
    'mlp.gate_proj.weight': P('tensor', 'data'),
    'mlp.up_proj.weight': P('tensor', 'data'),
    'mlp.down_proj.weight': P('data', 'tensor'),
    'norm0.weight': P(None),
    'norm1.weight': P(None),
    'final_norm.weight': P(None),
    'lm_head.weight': P('tensor', 'data'),
}

# ZeRO-3: optimizer states follow the weights' specs
OPTIMIZER_STATE_EXTRA_AXIS = None


def make_mesh():
    """The mesh over all devices (jax.make_mesh orders them for the interconnect)."""
    import jax

    return jax.make_mesh(MESH_SHAPE, MESH_AXES)
