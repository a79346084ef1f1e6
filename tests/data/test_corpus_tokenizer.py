from transformers import AutoTokenizer

from lazytrain.data.corpus import build_corpus
from lazytrain.data.tokenizer import build_tokenizer


def test_corpus_is_real_text_and_split(tmp_path):
    train, val = build_corpus(tmp_path)
    t, v = train.read_text(), val.read_text()
    assert len(t) > 200_000 and len(v) > 5_000
    assert "the" in t.split()[:5000] and t.count(" ") > len(t) / 12  # prose, not code or bytes
    assert v[:500] not in t  # validation documents are held out


def test_tokenizer_roundtrip(tmp_path):
    train, _ = build_corpus(tmp_path / "c")
    d = build_tokenizer([train], tmp_path / "tok", vocab_size=512)
    tok = AutoTokenizer.from_pretrained(d)
    text = "The for statement iterates over the elements of a sequence."
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 2  # BPE merges learned on the corpus compress English
    assert tok.eos_token_id is not None and len(tok) <= 512
