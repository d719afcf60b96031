"""Where `prepare` puts the weights off the CPU: everything on the device except an untied embedding table, which
stays the FTW's host mmap view and is gathered row by row (runtime/model.py, `Embedding`). The `meta` device stands
in for a GPU here; tests/runtime/gpu/test_gpu_model.py checks the CUDA path's values."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from ft.compiler import compile_checkpoint
from ft.compiler.synth import synth
from ft.formats import FtwReader
from ft.runtime.layers.base import place
from ft.runtime.model import load_model


def test_untied_embedding_table_stays_on_the_host(ftw_for):
    reader = FtwReader(ftw_for("qwen3_5_moe", "nvfp4"))
    assert not reader.config.tie_word_embeddings
    model = load_model(reader, device="meta")
    table = model.embed_tokens.weight
    assert table.device.type == "cpu" and table.data_ptr() == reader.tensor("embed_tokens.weight").data_ptr()
    assert model.lm_head.weight.device.type == "meta" and model.norm.weight.device.type == "meta"
    assert model.layers[0].mlp.gate.weight.device.type == "meta"
    rows = model.embed_tokens(torch.tensor([3, 1, 3]))
    assert rows.device.type == "meta" and rows.shape == (3, reader.config.hidden_size) and rows.dtype == model.dtype


def test_tied_embedding_table_goes_to_the_device(tmp_path):
    hf = synth("qwen2_moe", "tiny", tmp_path / "tied", dtype="fp32", overrides={"tie_word_embeddings": True},
               max_shard_size="100MB")
    tensors = load_file(hf / "model.safetensors")  # as transformers saves a tied model: no lm_head.weight
    del tensors["lm_head.weight"]
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    reader = FtwReader(compile_checkpoint(hf, tmp_path / "tied.ftw", progress=False))
    assert reader.config.tie_word_embeddings
    model = load_model(reader, device="meta")  # the table is the LM head too: read whole every step
    assert model.embed_tokens.weight.device.type == "meta"
    assert model.embed_tokens(torch.tensor([2])).device.type == "meta"


def test_cpu_model_keeps_every_weight_as_the_mmap_view(ftw_for):
    reader = FtwReader(ftw_for("qwen3_moe"))
    model = load_model(reader, device="cpu")
    assert model.embed_tokens.weight.data_ptr() == reader.tensor("embed_tokens.weight").data_ptr()
    ids = torch.tensor([5, 0, 5])
    assert torch.equal(model.embed_tokens(ids), reader.tensor("embed_tokens.weight")[ids])


def test_place_casts_and_moves():
    t = torch.arange(6, dtype=torch.float32).view(2, 3) / 3
    out = place(t, "meta", torch.bfloat16)  # meta stands in for the GPU
    assert out.device.type == "meta" and out.dtype == torch.bfloat16 and out.shape == (2, 3)
    same = place(t, "cpu", torch.bfloat16)
    assert same.dtype == torch.bfloat16 and torch.equal(same, t.to(torch.bfloat16))  # the same rounding


def test_place_casts_a_tensor_already_on_the_target_device():
    t = torch.ones(4, dtype=torch.float32, device="meta")
    out = place(t, "meta", torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.device.type == "meta"
