"""A tiny model with custom modeling code (``auto_map`` in its config.json, loaded with ``trust_remote_code``):
Pre-LN blocks of LayerNorm -> MLP with a residual, a final LayerNorm and an LM head, written into a directory
with its ``modeling_tinyln.py``. Shared by ``tests/checkpoint/test_streamed_remote_code.py`` and
``benchmarks/lowmem_option_sweep.py`` (round 59: ``--trust-remote-code`` swept, in memory and streamed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODELING = '''
import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class TinyLNConfig(PretrainedConfig):
    model_type = "tinyln"

    def __init__(self, vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=5, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        super().__init__(**kwargs)


class TinyLNBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size)
        self.up = nn.Linear(config.hidden_size, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLNPreTrainedModel(PreTrainedModel):
    config_class = TinyLNConfig
    base_model_prefix = "model"

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


class TinyLNModel(TinyLNPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TinyLNBlock(config) for _ in range(config.num_hidden_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size)
        self.post_init()

    def forward(self, input_ids=None, **kwargs):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.final_norm(x)


class TinyLNForCausalLM(TinyLNPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.model = TinyLNModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        return CausalLMOutput(logits=self.lm_head(self.model(input_ids)))
'''

AUTO_MAP = {"AutoConfig": "modeling_tinyln.TinyLNConfig", "AutoModel": "modeling_tinyln.TinyLNModel",
            "AutoModelForCausalLM": "modeling_tinyln.TinyLNForCausalLM"}


def save_remote_code_model(out: Path, seed: int = 0, max_shard_size: str = "40KB") -> Path:
    """Write the tiny custom-code model (LayerNorm γ/β and biases randomised) with its modeling file into
    ``out``; returns ``out``."""
    import importlib.util

    import torch

    out.mkdir(parents=True, exist_ok=True)
    (out / "modeling_tinyln.py").write_text(MODELING)
    spec = importlib.util.spec_from_file_location(f"tinyln_{abs(hash(str(out)))}", out / "modeling_tinyln.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    torch.manual_seed(seed)
    model = mod.TinyLNForCausalLM(mod.TinyLNConfig()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    cfg = json.loads((out / "config.json").read_text())
    cfg["auto_map"] = AUTO_MAP
    cfg["architectures"] = ["TinyLNForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "modeling_tinyln.py").write_text(MODELING)  # save_pretrained may have copied its own module file
    return out
