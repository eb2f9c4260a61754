"""hylight's model library: the hybrid lightning/softmax MoE decoder of MiniMax-Text-01.

Importing this package registers the model with transformers' Auto classes (model_type ``hylight_hybrid``),
so a saved directory loads with ``AutoModelForCausalLM.from_pretrained(path)`` (safetensors), no remote code.

    configuration.py  HybridConfig (+ attention patterns, DeepNorm factors)
    moe.py            MoEFeedForward: top-k router, SwiGLU experts, capacity drop, aux loss
    modeling.py       LightningAttention, SoftmaxAttention, HybridDecoderLayer, HybridForCausalLM,
                      HybridForSequenceClassification (a score per sequence: reward models, §5.2)
    cache.py          the decoding caches: HybridCache, StaticHybridCache (preallocated, for generation.py)
    generation.py     fast generate: packed prefill, host-free decode step, CUDA graphs
    hf_minimax.py     export to / import from transformers' MiniMaxForCausalLM
    accounting.py     total/activated parameters, Table 1 FLOPs per token, MFU
    sizes.py          named sizes: tiny .. gpu-1b
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from model.cache import HybridCache
from model.configuration import HybridConfig
from model.modeling import HybridForCausalLM, HybridForSequenceClassification, HybridModel
from model.sizes import SIZES, config_for

AutoConfig.register(HybridConfig.model_type, HybridConfig, exist_ok=True)
AutoModel.register(HybridConfig, HybridModel, exist_ok=True)
AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(HybridConfig, HybridForSequenceClassification, exist_ok=True)

__all__ = ["SIZES", "HybridCache", "HybridConfig", "HybridForCausalLM", "HybridForSequenceClassification", "HybridModel", "config_for"]
