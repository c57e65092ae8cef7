import torch

from confkv import LLM
from confkv.bench.reference import ReferenceStore, build_references
from confkv.scoring import ScoreItem, Scorer


def test_references_are_computed_once_and_reused(tiny, tmp_path):
    full = LLM("tiny-random", "full", loaded=tiny, compact_interval=16)
    tok = full.tokenizer
    gen_prompt = tok("Generate after this prompt.")["input_ids"]
    text = tok("A text scored from its tenth token on, teacher forced. " * 3)["input_ids"]
    store = ReferenceStore(full, tmp_path)
    items = [(gen_prompt, 24, None), (text, 0, 10)]
    first = build_references(full, items, store)
    assert len(list(store.folder.glob("*.safetensors"))) == 2
    gen, scored = first
    assert len(gen.continuation) <= 24 and gen.scored_ids == gen_prompt + gen.continuation
    assert gen.topk.ids.shape == (len(gen.continuation), 32)
    assert scored.continuation == [] and scored.topk.ids.shape[0] == len(text) - 10
    # a second build reads the files (a changed engine would otherwise give different numbers)
    second = build_references(full, items, store)
    for a, b in zip(first, second, strict=True):
        assert a.continuation == b.continuation and a.scored_ids == b.scored_ids
        assert torch.equal(a.topk.ids, b.topk.ids) and torch.equal(a.topk.logprobs, b.topk.logprobs)
    # the full cache has zero KL to its own reference
    (again,) = Scorer(full.engine).score([ScoreItem(scored.scored_ids, scored.score_from, scored.topk)])
    assert again.kl is not None and float(again.kl.max()) < 1e-5


def test_a_model_re_exported_in_place_gets_new_references(tmp_path):
    """References are keyed on the files the weights came from: new weights saved over a local folder (same config)
    are not scored against the old model's answers."""
    import os

    from confkv.bench.reference import model_key
    from confkv.model_loader import tiny_random_model, tiny_random_tokenizer

    folder = tmp_path / "ckpt"
    tiny_random_model(0).save_pretrained(folder)
    tiny_random_tokenizer().save_pretrained(folder)
    before = model_key(LLM(str(folder), "full", kv_cache_memory="8MiB"))
    assert model_key(LLM(str(folder), "full", kv_cache_memory="8MiB")) == before  # stable while nothing changes
    tiny_random_model(1).save_pretrained(folder)  # fine-tuned, say: same config, other weights
    weights = next(folder.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
    assert model_key(LLM(str(folder), "full", kv_cache_memory="8MiB")) != before


def test_a_gguf_file_is_converted_to_one_folder_whatever_the_process(tmp_path):
    """The converted copy's folder is named the same by every process (it was named by ``hash()`` of a string,
    which Python salts per process, so each run converted the file again), and anew for a new version of the file."""
    import os
    import subprocess
    import sys

    from confkv.model_loader import model_folder

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    code = f"from confkv.model_loader import model_folder; print(model_folder({str(gguf)!r}, {str(tmp_path)!r}))"

    def folder_in_a_process(seed: str) -> str:
        env = {**os.environ, "PYTHONHASHSEED": seed}
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout

    folders = {folder_in_a_process(seed).strip() for seed in ("1", "2")}
    assert folders == {str(model_folder(str(gguf), str(tmp_path)))}
    assert folders.pop().startswith(str(tmp_path / "models" / "m-"))
    before = model_folder(str(gguf), str(tmp_path))
    gguf.write_bytes(b"GGUF, another version")
    assert model_folder(str(gguf), str(tmp_path)) != before
