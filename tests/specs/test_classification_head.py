"""Sequence-classification heads (reward models, classifiers: transformers *ForSequenceClassification):
the config read as one, its parameters against transformers on the meta device, what training
keeps (no vocabulary logits), and what refuses it (serving, verify, exporters that build a causal LM)."""

from __future__ import annotations

import json

import pytest

from shardplan.cost.layout import Layout
from shardplan.cost.memory_training import training_memory
from shardplan.cost.params import count_params
from shardplan.cost.workload import TrainingWorkload
from shardplan.errors import EXIT_BAD_INPUT, EXIT_OK
from shardplan.search.space import topology
from shardplan.specs.hf import spec_from_hf_config
from shardplan.specs.loading import load_hardware, load_model

LLAMA_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
REWARD = {**LLAMA_8B, "architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "LABEL_0"},
          "label2id": {"LABEL_0": 0}}
SMALL_QWEN = {  # tied embeddings in the causal LM; a classifier has no head to tie
    "model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 512,
    "tie_word_embeddings": True, "architectures": ["Qwen2ForSequenceClassification"], "num_labels": 3,
}


def test_a_reward_model_config_reads_as_a_one_label_head():
    spec = spec_from_hf_config(REWARD, "rm")
    assert spec.head == "sequence_classification" and spec.num_labels == 1 and spec.head_outputs == 1
    lm = spec_from_hf_config({**LLAMA_8B, "architectures": ["LlamaForCausalLM"]}, "lm")
    assert lm.head == "lm" and lm.head_outputs == 128256
    # the lm_head (128256 x 4096) is gone, the score (4096 x 1) is there
    assert count_params(lm).total - count_params(spec).total == 128256 * 4096 - 4096


@pytest.mark.consumers
@pytest.mark.parametrize("config", [REWARD, SMALL_QWEN], ids=["llama-reward", "qwen2-3-labels-tied"])
def test_classification_parameters_equal_transformers_on_the_meta_device(config):
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    cfg = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    hf = AutoConfig.for_model(config["model_type"], **cfg)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(hf)
    assert sum(p.numel() for p in model.parameters()) == count_params(spec_from_hf_config(config, "m")).total


def test_training_a_reward_model_keeps_no_vocabulary_logits():
    """Llama 3.1 8B at 8 x 4096 tokens: the causal LM's loss head holds tokens x 128256 logits
    at the stack's bytes a logit; the reward model's score is tokens x 1."""
    hw = topology(load_hardware("h100-sxm-80gb"), 8)
    layout = Layout(dp=8, zero_stage=3, micro_batch_size=8)
    wl = TrainingWorkload(seq_len=4096, global_batch_size=64)
    lm = training_memory(load_model("llama-3.1-8b").spec, hw, layout, wl)
    rm = training_memory(spec_from_hf_config(REWARD, "rm"), hw, layout, wl)
    tokens = 8 * 4096
    gap = lm.ranks[0].breakdown.activations - rm.ranks[0].breakdown.activations
    assert gap == 4 * tokens * (128256 - 1)  # the fp32 logits (no stack: 4 bytes each) over 128256 -> 1 output


def test_serving_and_verify_refuse_a_classification_head_in_one_line(cli, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(REWARD))
    res = cli("estimate", str(path), "--gpus", "1")
    assert res.exit_code == EXIT_BAD_INPUT
    assert len(res.stderr.strip().splitlines()) == 1 and "classification" in res.stderr and "Traceback" not in res.stderr
    res = cli("estimate", str(path), "--workload", "training", "--gpus", "8", "--zero-stage", "3", "--seq-len", "2048",
              "--global-batch-size", "64", "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    assert res.json()["model"]["num_params"] == count_params(spec_from_hf_config(REWARD, "rm")).total
