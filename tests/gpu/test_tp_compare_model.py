"""`tiny-llama-wide`, the model of the CPU's TP compare (experiments/configs/compare_tiny_llama_wide_tp2.yaml):
the simulator's preset is the built checkpoint's architecture, and TP=2 splits its heads."""
from __future__ import annotations

import dataclasses

from servetwin.gpu.models.registry import resolve_model
from servetwin.sim.model_spec import PRESETS, load_model_spec


def test_the_sim_preset_is_the_built_models_architecture():
    built = resolve_model("tiny-llama-wide").spec  # read from the checkpoint's config.json
    preset = load_model_spec("tiny-llama-wide")
    assert dataclasses.replace(built, name=preset.name) == preset
    assert preset == PRESETS["tiny-llama-wide"]


def test_it_is_tiny_llama_wider_and_splits_over_two_ranks():
    wide, tiny = PRESETS["tiny-llama-wide"], PRESETS["tiny-llama"]
    assert (wide.num_layers, wide.vocab_size, wide.tie_word_embeddings) == (
        tiny.num_layers, tiny.vocab_size, tiny.tie_word_embeddings)  # the same 6 collectives per TP step
    assert wide.num_heads % 2 == 0 and wide.num_kv_heads % 2 == 0
    assert wide.layer_matmul_params >= 100 * tiny.layer_matmul_params  # the matmuls, not the collectives, dominate
