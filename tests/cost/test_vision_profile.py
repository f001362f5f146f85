"""A multimodal model's vision tower in vLLM's profiling pass, by version (cost/engine.py
profile_vision, cost/vision.py), with the figures worked by hand from the rules' sources
(docs/research/vllm-multimodal-profiling.md)."""

from __future__ import annotations

import pytest
from conftest import REPO

from shardplan.cost.engine import profile_vision
from shardplan.cost.estimate import estimate
from shardplan.cost.inputs import inference_workload
from shardplan.cost.layout import Layout
from shardplan.cost.memory_serving import activation_peak_bytes
from shardplan.cost.vision import vision_block_peak_bytes
from shardplan.knowledge.load import engine_rules
from shardplan.specs.cluster import cluster
from shardplan.specs.loading import load_hardware, load_model

MODELS = REPO / "shardplan" / "validation" / "corpus" / "models"
BF16 = 2


def _spec(name: str):
    return load_model(str(MODELS / f"{name}.yaml")).spec


def test_largest_image_per_family_as_vllm_counts_it():
    # LLaVA 1.5: CLIP-L/14 at 336 px: 24 x 24 = 576 tokens (the class token dropped), 577 through the tower.
    llava = _spec("llava-1.5-7b").vision
    assert (llava.image_tokens_max, llava.image_encoder_tokens_max) == (576, 577)
    # Gemma 3: SigLIP at 896 px / 14 = 64 x 64 patches, pooled to mm_tokens_per_image 256.
    gemma = _spec("gemma-3-4b-it").vision
    assert (gemma.image_tokens_max, gemma.image_encoder_tokens_max) == (256, 4096)
    # Qwen2.5-VL: max_pixels 12845056 / 28^2 = 16384 tokens, 2 x 2 merged: 65536 patches.
    qwen = _spec("qwen2.5-vl-7b-qwen-image-text-encoder").vision
    assert (qwen.image_tokens_max, qwen.image_encoder_tokens_max) == (16384, 65536)
    # Mistral 3 (Pixtral): 1540 / 14 = 110 patches a side, 55 x 55 tokens after the 2 x 2 merge.
    mistral = _spec("mistral-small-3-24b-flux2-text-encoder").vision
    assert (mistral.image_tokens_max, mistral.image_encoder_tokens_max) == (3025, 12100)
    # Llama 4: 16 tiles + the global one, 336 / 14 = 24^2 = 576 patches (+ class) each, pixel shuffle 0.5: 144.
    llama4 = _spec("llama-4-scout-17b-16e").vision
    assert (llama4.image_tokens_max, llama4.image_encoder_tokens_max) == (17 * 144, 17 * 577)


def test_mllama_profiles_one_image_per_dummy_sequence_with_its_tile_mask():
    # Llama 3.2 Vision: 4 tiles of (560 / 14)^2 + 1 = 1601 tokens; one <|image|> token in the decoder, so
    # the V0 clamp leaves all max_num_seqs sequences (enc_dec_model_runner profiles one image per sequence).
    spec = _spec("llama-3.2-11b-vision-instruct")
    v = spec.vision
    assert (v.image_tokens_max, v.image_encoder_tokens_max, v.num_tiles_max) == (1, 4 * 1601, 4)
    tokens, kept, _ = profile_vision(engine_rules("vllm", "0.6.6").multimodal, image_tokens=1,
                                     image_encoder_tokens=6404, max_num_seqs=128, max_num_batched_tokens=65536,
                                     max_model_len=65536, images_per_prompt=None)
    assert (tokens, kept) == (128 * 6404, 0)
    # Each tile padded to 1608 tokens; the dense mask is 128 x (4 x 1608)^2 bf16 elements, and the pixels
    # are held twice in fp32 (1600 patches of 3 x 14 x 14 values per tile).
    from shardplan.cost.vision import tiled_tower_extra_bytes, tower_tokens

    assert tower_tokens(v, tokens) == 128 * 4 * 1608
    assert tiled_tower_extra_bytes(v, tokens, BF16) == 128 * 6432**2 * BF16 + 2 * 128 * 4 * 1600 * 588 * 4


def test_v0_clamps_the_dummy_sequences_by_the_images_tokens():
    mm = engine_rules("vllm", "0.6.4").multimodal
    # 5120 tokens over images of 576: min(256, 5120 // 576 = 8) sequences, one image each.
    tokens, kept, why = profile_vision(mm, image_tokens=576, image_encoder_tokens=577, max_num_seqs=256,
                                       max_num_batched_tokens=5120, max_model_len=4096, images_per_prompt=None)
    assert (tokens, kept) == (8 * 577, 0) and "8 image(s)" in why
    # Images longer than the pass: one sequence, at least one image (the warning's "Setting it to 1").
    tokens, _, _ = profile_vision(mm, image_tokens=16384, image_encoder_tokens=65536, max_num_seqs=256,
                                  max_num_batched_tokens=5120, max_model_len=4096, images_per_prompt=None)
    assert tokens == 65536


def test_v0_from_0_7_profiles_text_only_when_the_images_do_not_fit_the_sequence():
    mm = engine_rules("vllm", "0.7.3").multimodal
    tokens, kept, why = profile_vision(mm, image_tokens=16384, image_encoder_tokens=65536, max_num_seqs=256,
                                       max_num_batched_tokens=10240, max_model_len=10240, images_per_prompt=None)
    assert (tokens, kept) == (0, 0) and "text only" in why


@pytest.mark.parametrize("version, items, kept", [
    ("0.8.5", 32, 32 * 256),  # ceil(8192 / 256) = 32, at most 256 x 999
    ("0.10.1", 32, 32 * 256),  # floor, at most 256 x max(1, min(999, 16384 // 256))
    ("0.11.0", 32, 32 * 8192),  # each kept output padded to the whole budget's 8192 rows
    ("0.21.0", 32, 32 * 256),
])
def test_v1_encoder_budget_by_version(version, items, kept):
    mm = engine_rules("vllm", version).multimodal
    tokens, kept_rows, _ = profile_vision(mm, image_tokens=256, image_encoder_tokens=4096, max_num_seqs=256,
                                          max_num_batched_tokens=8192, max_model_len=16384, images_per_prompt=None)
    assert (tokens, kept_rows) == (items * 4096, kept)


def test_v1_rounding_and_the_context_cap_differ_between_0_9_and_0_10():
    # A budget of 10000 tokens over 3025-token images: ceil gives 4 (0.9), floor 3 (0.10); a
    # max_model_len of 4096 allows one image a prompt from 0.10, so 2 sequences cap it at 2.
    kwargs = dict(image_tokens=3025, image_encoder_tokens=12100, max_num_seqs=2, max_num_batched_tokens=10000,
                  max_model_len=4096, images_per_prompt=None)
    assert profile_vision(engine_rules("vllm", "0.9.2").multimodal, **kwargs)[0] == 4 * 12100
    assert profile_vision(engine_rules("vllm", "0.10.1").multimodal, **kwargs)[0] == 2 * 12100
    # --limit-mm-per-prompt 1 caps 0.9's count at max_num_seqs x 1 too.
    assert profile_vision(engine_rules("vllm", "0.9.2").multimodal, **{**kwargs, "images_per_prompt": 1})[0] == 2 * 12100


def test_tower_block_peak_by_hand():
    # CLIP-L: hidden 1024, 16 heads of 64, fc1 4096 (not gated); 577 tokens, tp 1:
    # stream 3 x 577 x 1024, MLP 2 x 577 x 4096 (larger than attention's 4 x 577 x 1024).
    v = _spec("llava-1.5-7b").vision
    assert vision_block_peak_bytes(v, 577, 1, BF16) == (3 * 577 * 1024 + 2 * 577 * 4096) * BF16
    # tp 2 halves the sharded part only.
    assert vision_block_peak_bytes(v, 577, 2, BF16) == (3 * 577 * 1024 + 577 * 4096) * BF16


def _llava_estimate(version: str, max_model_len: int):
    spec = _spec("llava-1.5-7b")
    hw = cluster(load_hardware("a100-sxm-80gb"), gpus=1, nodes=None, gpus_per_node=None)
    wl = inference_workload(max_model_len=max_model_len, max_num_seqs=None, max_num_batched_tokens=None,
                            gpu_memory_utilization=None, block_size=None, kv_cache_dtype=None, weight_dtype=None,
                            quantization=None, enforce_eager=False, input_len=1024, output_len=128, batch_size=None,
                            engine=engine_rules("vllm", version), hw=hw, model_max_len=spec.max_position_embeddings,
                            vision=spec.vision)
    return spec, wl, estimate(spec, hw, Layout(), wl)


def test_v0_multimodal_profiles_at_least_5120_tokens_without_chunked_prefill():
    _, wl, rep = _llava_estimate("0.6.4", 4096)
    assert wl.max_num_batched_tokens == 5120  # max(4096, 2048) raised to 5120 (PR #8028)
    assert any("at least 5,120 tokens" in a for a in rep.assumptions)
    assert wl.vision_encoder_tokens == 8 * 577 and wl.vision_kept_tokens == 0


def test_the_first_stage_peak_is_the_tower_or_the_text_pass_with_kept_outputs():
    spec, wl, rep = _llava_estimate("0.11.0", 4096)
    text = activation_peak_bytes(spec, Layout(), wl, last_stage=True)
    v = spec.vision
    tower = vision_block_peak_bytes(v, wl.vision_encoder_tokens, 1, BF16) + \
        wl.vision_encoder_tokens * v.patch_embedding_inputs * BF16
    kept = wl.vision_kept_tokens * spec.hidden_size * BF16
    assert rep.memory.per_rank[0].per_gpu_bytes["activations"] == pytest.approx(max(tower, text + kept))
    # A text-only model of the same shape profiles less.
    bare = spec.model_copy(update={"vision": None})
    assert activation_peak_bytes(bare, Layout(), wl, last_stage=True) == text < max(tower, text + kept)


def test_a_plan_without_vision_fields_reads_back_with_none_counted():
    from shardplan.plan.schema import InferenceWorkloadSection

    fields = InferenceWorkloadSection.model_fields
    assert fields["vision_encoder_tokens"].default == 0 and fields["vision_kept_tokens"].default == 0


def test_limit_mm_per_prompt_is_checked(cli):
    r = cli("estimate", str(MODELS / "llava-1.5-7b.yaml"), "-H", "a100-sxm-80gb", "--gpus", "1",
            "--limit-mm-per-prompt", "0")
    assert r.exit_code == 2 and "--limit-mm-per-prompt" in r.stderr
    r = cli("estimate", str(MODELS / "llava-1.5-7b.yaml"), "-H", "a100-sxm-80gb", "--gpus", "1",
            "--engine-version", "0.10.1", "--limit-mm-per-prompt", "2", "--json")
    assert r.exit_code in (0, 3), r.stderr
    w = r.json()["workload"]
    # 0.10: min(budget // 576, 256 x max(1, min(2, max_model_len // 576))) images of 577 tower tokens.
    budget = max(w["max_num_batched_tokens"], 576)
    assert w["vision_encoder_tokens"] == min(budget // 576, 256 * 2) * 577


def test_mllama_on_vllm_v1_rules_is_refused_with_the_version_that_ran_it(cli):
    """Llama 3.2 Vision cross-attends to its encoder: vLLM ran it on V0 only (V1 never ran
    encoder-decoder models; PR #24907 removed them in 2025-09), so shardplan's V1 eras do not size
    it: one line naming --engine-version, exit 2; V0's rules (0.7.3 and older) do."""
    model = str(REPO / "shardplan" / "validation" / "corpus" / "models" / "llama-3.2-11b-vision-instruct.yaml")
    res = cli("estimate", model, "--gpus", "1", "--json")
    assert res.exit_code == 2 and "--engine-version" in res.stderr and "0.7.3" in res.stderr
    assert len([line for line in res.stderr.splitlines() if line.strip()]) == 1
    ok = cli("estimate", model, "--gpus", "1", "--engine-version", "0.6.6", "--max-model-len", "8192",
             "--max-num-seqs", "16", "--json")
    assert ok.exit_code == 0, ok.stderr
    assert ok.json()["kv_cache"]["capacity_tokens"] > 8192
