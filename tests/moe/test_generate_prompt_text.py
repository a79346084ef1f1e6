"""`lazytrain generate prompt=...` takes the text as the shell passes it: Hydra's grammar refused
`def f(x):` and `it's` (in lines naming its lexer) and dropped leading/trailing spaces (review,
2026-12-02); prompt_file=PATH reads it from a file."""

import json

import pytest

from lazytrain.cli import generate as gen_cli


@pytest.fixture(scope="module")
def store_and_tok(tiny_moe, tmp_path_factory):
    from lazytrain.data.tokenizer import build_tokenizer
    from lazytrain.moe import convert_model

    d = tmp_path_factory.mktemp("gen_prompt")
    text = d / "t.txt"
    text.write_text("def f(x): return x  # it's the cache, (a=b) {c}\n" * 100)
    tok_dir = build_tokenizer([text], d / "tok", vocab_size=300)
    convert_model(tiny_moe("mixtral", vocab_size=300), d / "s", tokenizer_dir=tok_dir)
    from transformers import AutoTokenizer

    return d / "s", AutoTokenizer.from_pretrained(str(tok_dir))


def _prefill(capsys, argv) -> tuple[int, dict | None]:
    rc = gen_cli.main([*argv, "max_new_tokens=2", "--json"])
    out = capsys.readouterr().out
    return rc, (json.loads(out) if rc == 0 else None)


@pytest.mark.parametrize("typed, text", [
    ("def f(x):", "def f(x):"), ("it's", "it's"), (" leading space", " leading space"),
    ("trailing ", "trailing "), ("null", "null"), ("a=b {c}", "a=b {c}"), ("x, y", "x, y"),
    ("echo ${HOME}", "echo ${HOME}"), ("const s = `${a}`;", "const s = `${a}`;"),
    ("'def f(x):'", "def f(x):"),          # Hydra's own quoting still means what it meant
    ("'it\\'s'", "it's"),
])
def test_prompt_is_the_text_as_typed(store_and_tok, capsys, typed, text):
    store, tok = store_and_tok
    rc, got = _prefill(capsys, [f"moe.store={store}", f"prompt={typed}"])
    assert rc == 0, capsys.readouterr().err
    assert got["stats"]["prefill_tokens"] == len(tok(text)["input_ids"])
    rc, ids = _prefill(capsys, [f"moe.store={store}",
                                f"prompt_ids=[{','.join(map(str, tok(text)['input_ids']))}]"])
    assert ids["token_ids"] == got["token_ids"]


def test_prompt_file(store_and_tok, capsys, tmp_path):
    store, tok = store_and_tok
    f = tmp_path / "p.txt"
    f.write_text("  def f(x):\n    return it's\n", encoding="utf-8")
    rc, got = _prefill(capsys, [f"moe.store={store}", f"prompt_file={f}"])
    assert rc == 0 and got["stats"]["prefill_tokens"] == len(tok(f.read_text())["input_ids"])
    assert gen_cli.main([f"moe.store={store}", f"prompt_file={tmp_path / 'missing.txt'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prompt_file=" in err[0] and "missing.txt" in err[0]


def test_last_prompt_wins_and_prompt_with_ids_is_refused(store_and_tok, capsys):
    store, tok = store_and_tok
    rc, got = _prefill(capsys, [f"moe.store={store}", "prompt=a", "prompt=${oc.env:HOME} x"])
    assert rc == 0 and got["stats"]["prefill_tokens"] == len(tok("${oc.env:HOME} x")["input_ids"])
    assert gen_cli.main([f"moe.store={store}", "prompt=hi", "prompt_ids=[1,2]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not both" in err[0]
