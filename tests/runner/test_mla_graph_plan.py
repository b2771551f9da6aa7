"""A model on the MLA backend (layers/mla.py: the absorbed latent kernel serves only uniform
single-token decode) gets decode-only full graphs: the runner's plan, resolved on the host from the
model's own attention layers, has decode graphs and piecewise graphs but no verify graphs, and a
verify step dispatches to the piecewise graphs."""

from tokenmill.layers.attention import CudaGraphSupport
from tokenmill.models.config import arch_config_from_hf
from tokenmill.models.deepseek import DeepseekForCausalLM
from tokenmill.runner.cuda_graphs import GraphKey, GraphMode, dispatch_graph, resolve_graph_plan, weakest_graph_support

TINY_V3 = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=48,
               moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=16, q_lora_rank=8,
               qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
               n_group=2, topk_group=1, first_k_dense_replace=1, max_position_embeddings=32)


def test_mla_model_gets_decode_only_full_graphs():
    model = DeepseekForCausalLM(arch_config_from_hf(TINY_V3))
    support = weakest_graph_support(model, None)
    assert support is CudaGraphSupport.UNIFORM_SINGLE_TOKEN_DECODE
    plan = resolve_graph_plan(support, enabled=True, max_num_seqs=8, cuda_graph_max_batch=512, max_num_tokens=256,
                              piecewise_max_tokens=64, verify_query_len=3)
    assert set(plan.sizes) == {(GraphMode.PIECEWISE, 0, False), (GraphMode.FULL, 1, False)}
    assert plan.sizes[(GraphMode.FULL, 1, False)] == (1, 2, 4, 8)
    captured = set(plan.keys())
    assert dispatch_graph(plan, captured, 3, 3, 1, False) == GraphKey(GraphMode.FULL, 4, 1)  # decode: full graph
    assert dispatch_graph(plan, captured, 3, 9, 3, False) == GraphKey(GraphMode.PIECEWISE, 16)  # verify: piecewise
