"""peerline.models: built-in models, each a flat list of layers that the pipeline's stage split can cut anywhere.

gpt.py builds a decoder-only transformer LM (embedding, blocks, head); flops.py says what it costs (per-layer
forward FLOPs for a balanced split, model FLOPs per token and the cards' peaks for MFU); rope.py holds the rotary
position embeddings its attention uses.
"""

from peerline.models.flops import gpt_flops_per_token, gpt_layer_costs, gpt_matmul_params, peak_bf16_tflops
from peerline.models.gpt import GPTBlock, LMHead, TokenEmbedding, build_gpt_layers, embedding_init

__all__ = ["GPTBlock", "LMHead", "TokenEmbedding", "build_gpt_layers", "embedding_init", "gpt_flops_per_token",
           "gpt_layer_costs", "gpt_matmul_params", "peak_bf16_tflops"]
