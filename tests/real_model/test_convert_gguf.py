"""`ds-rlhf convert-gguf`'s special-token fix-up and its refusals, without the real model: the fix-up on the tiny
kit's ChatML tokenizer, the errors on files and directories a user can get wrong."""

from __future__ import annotations

import sys

import pytest
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from ds_rlhf.engines.gguf_import import GGUFImportError, convert_gguf, end_of_turn_token, fix_special_tokens
from ds_rlhf.entrypoints.main import main as ds_rlhf


@pytest.fixture
def chatml(tiny_model_path):
    """The tiny kit's tokenizer (ChatML: eos <|im_end|>, pad <|pad|>), config and generation config."""
    return (AutoTokenizer.from_pretrained(tiny_model_path), AutoConfig.from_pretrained(tiny_model_path),
            GenerationConfig.from_pretrained(tiny_model_path))


def test_eos_read_as_turn_start_is_set_to_the_templates_end_of_turn(chatml):
    tok, config, gen = chatml
    im_start, im_end, endoftext = (tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>",
                                                                          "<|endoftext|>"))
    pad = tok.pad_token_id
    tok.eos_token = "<|im_start|>"
    config.eos_token_id, gen.eos_token_id = im_start, [im_start, endoftext]
    assert end_of_turn_token(tok) == "<|im_end|>"
    changes = fix_special_tokens(tok, config, gen)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == im_end
    assert gen.eos_token_id == [im_end, endoftext]  # the end of turn first; other stop ids stay, the wrong eos goes
    assert config.eos_token_id == im_end
    assert tok.pad_token_id == pad  # <|pad|> is no token the template writes: left alone
    assert [c["field"] for c in changes] == ["tokenizer.eos_token", "generation_config.eos_token_id",
                                             "config.eos_token_id"]
    assert changes[0]["from"] == "<|im_start|>" and changes[0]["to"] == "<|im_end|>"


def test_pad_that_the_template_writes_or_none_becomes_eos(chatml):
    tok, config, gen = chatml
    tok.pad_token = "<|im_start|>"  # would hide every turn start from the masks
    fix_special_tokens(tok, config, gen)
    assert tok.pad_token == "<|im_end|>" and gen.pad_token_id == config.pad_token_id == tok.eos_token_id
    tok.pad_token = None
    assert [c["field"] for c in fix_special_tokens(tok, config, gen)] == ["tokenizer.pad_token"]
    assert tok.pad_token == "<|im_end|>"


def test_without_an_end_of_turn_in_the_template_eos_is_kept(chatml):
    tok, config, gen = chatml
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    tok.eos_token = "<|endoftext|>"
    assert end_of_turn_token(tok) is None
    fix_special_tokens(tok, config, gen)
    assert tok.eos_token == "<|endoftext|>"
    tok.chat_template = None
    assert end_of_turn_token(tok) is None


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_cli_refuses_missing_and_non_gguf_files(tmp_path, capsys):
    assert ds_rlhf(["convert-gguf", str(tmp_path / "nope.gguf"), str(tmp_path / "out")]) == 2
    assert "nope.gguf: no such file" in _err(capsys)
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip, not a GGUF")
    assert ds_rlhf(["convert-gguf", str(fake), str(tmp_path / "out")]) == 2
    assert "model.gguf is not a GGUF file" in _err(capsys)
    fake.write_bytes(b"GGUF\x03\x00\x00\x00 cut short")
    assert ds_rlhf(["convert-gguf", str(fake), str(tmp_path / "out")]) == 2
    assert "cannot read it as GGUF" in _err(capsys)
    assert not (tmp_path / "out").exists()


def test_cli_refuses_a_non_empty_out_dir_without_overwrite(tmp_path, capsys):
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF\x03\x00\x00\x00")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert ds_rlhf(["convert-gguf", str(src), str(out)]) == 2
    assert "exists and is not empty: pass --overwrite" in _err(capsys)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_missing_gguf_package_is_one_line(tmp_path, capsys, monkeypatch):
    src = tmp_path / "model.gguf"
    src.write_bytes(b"GGUF\x03\x00\x00\x00")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    assert ds_rlhf(["convert-gguf", str(src), str(tmp_path / "out")]) == 2
    assert "needs the `gguf` package: pip install gguf==" in _err(capsys)
    with pytest.raises(GGUFImportError, match="dtype 'int8'"):
        convert_gguf(src, tmp_path / "out", dtype="int8")
