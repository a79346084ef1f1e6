"""A full fine-tune's final/ loads back a tokenizer that encodes as the run's did, or says where
one that does is: transformers picks Qwen2Tokenizer for a qwen2 model dir whatever its
tokenizer_config says, and that class splits digits its own way (review, 2026-12-02)."""

from transformers import AutoTokenizer

from lazytrain.cli.config import load_config
from lazytrain.recipes.train import TOKENIZER_PROBE, run


def _run(ov, out):
    notes = []
    run(load_config([*ov, "job.max_steps=1", "save_every=0", f"output_dir={out}"], config_name="train"), out,
        echo=notes.append)
    return [n for n in notes if n.startswith("note: AutoTokenizer")]


def test_a_qwen2_model_with_its_own_tokenizer_gets_a_note_and_final_tokenizer(base_overrides, text_data, tmp_path):
    from lazytrain.data.tokenizer import build_tokenizer

    text, _ = text_data
    digits = tmp_path / "digits.txt"   # (merges such as "Ġ1", which Qwen2Tokenizer's digit split never makes)
    digits.write_text(text.read_text() + "of 1234 and 5678, in 2026 and 1999.\n" * 200)
    tok_dir = build_tokenizer([digits], tmp_path / "tok", vocab_size=400)
    ours = AutoTokenizer.from_pretrained(str(tok_dir))
    ov = [o for o in base_overrides if not o.startswith(("data.tokenizer", "model.hf_config.vocab_size"))]
    notes = _run([*ov, f"data.tokenizer={tok_dir}", "model.hf_config.vocab_size=400",
                  "model.hf_config.model_type=qwen2"], tmp_path / "q")
    final = tmp_path / "q" / "final"
    assert len(notes) == 1 and "Qwen2Tokenizer" in notes[0] and str(final / "tokenizer") in notes[0]
    assert AutoTokenizer.from_pretrained(str(final))(TOKENIZER_PROBE)["input_ids"] != ours(TOKENIZER_PROBE)["input_ids"]
    again = AutoTokenizer.from_pretrained(str(final / "tokenizer"))
    assert again(TOKENIZER_PROBE)["input_ids"] == ours(TOKENIZER_PROBE)["input_ids"]


def test_a_llama_model_needs_no_note(base_overrides, tmp_path):
    assert _run(base_overrides, tmp_path / "l") == []
    assert not (tmp_path / "l" / "final" / "tokenizer").exists()
